"""``kvtrace cache``: list or clear the converted-weights and compiled-artifact caches."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from kvtrace.cli.ui import UI


def cmd_cache(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.artifact.store import clear_artifacts, list_artifacts
    from kvtrace.sources.store import cache_dir, clear_cache, list_cache

    if args.action == "clear":
        freed = clear_cache() + clear_artifacts()
        ui.out.print(f"freed {freed / 2**20:.1f} MiB from {cache_dir()}")
        return 0
    entries = [*list_cache(), *list_artifacts()]
    if ui.json_mode:
        print(json.dumps([{"path": str(p), "bytes": n} for p, n in entries]))
        return 0
    ui.out.print(f"cache: {cache_dir()}")
    for p, n in entries:
        ui.out.print(f"  {n / 2**20:9.1f} MiB  {p}")
    if not entries:
        ui.out.print("  (empty)")
    return 0


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace cache`` to the parser (``add(name, help)`` makes the subparser)."""
    p = add("cache", "List or clear kvtrace's caches (converted weights, compiled artifacts).")
    p.add_argument("action", choices=("list", "clear"))
    p.set_defaults(func=cmd_cache)

