"""``kvtrace lint``: what in a model's forward breaks capture; exit 1 on a finding."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from kvtrace.cli.ui import UI, output_file


def cmd_lint(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.tools.lint import run_cli_lint

    with output_file(args.json, "--json"):
        report = run_cli_lint(args, step=ui.step)
        if args.json:
            Path(args.json).write_text(report.to_json())
    ui.out.print("\n".join(report.lines()), markup=False, highlight=False, soft_wrap=True)
    return 0 if report.ok else 1


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace lint`` to the parser (``add(name, help)`` makes the subparser)."""
    p = add("lint", "Check that a model captures under kvtrace.jit with no length baked in, no recapture and no "
            "side effects.", json_flag=False)
    p.add_argument("source", help="smollm2-135m-instruct, a HF model dir, or a GGUF file")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.set_defaults(func=cmd_lint)

