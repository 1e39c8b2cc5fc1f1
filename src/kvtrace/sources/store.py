"""The weights cache: where dequantized GGUF models live (``cache_dir()/models/<digest>/``).

``cache_dir`` (``$KVTRACE_CACHE``, else ``$XDG_CACHE_HOME/kvtrace``, else ``~/.cache/kvtrace``),
``list_cache`` and ``clear_cache``; entries are written by ``sources.load`` and keyed by
``sources.resolve``'s digests, which include ``FORMAT``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvtrace._errors import UsageError

__all__ = ["FORMAT", "cache_dir", "clear_cache", "list_cache"]

FORMAT = 1  # bump when the cache entry layout changes; it is part of every digest


def cache_dir() -> Path:
    """$KVTRACE_CACHE, else $XDG_CACHE_HOME/kvtrace, else ~/.cache/kvtrace; created on demand."""
    if os.environ.get("KVTRACE_CACHE"):
        d = Path(os.environ["KVTRACE_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        d = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvtrace"
    else:
        d = Path.home() / ".cache" / "kvtrace"
    try:
        d.mkdir(parents=True, exist_ok=True)
        writable = os.access(d, os.W_OK | os.X_OK)
    except OSError as e:
        writable, why = False, f"{type(e).__name__}: {e.strerror or e}"
    else:
        why = "no write permission"
    if not writable:
        origin = "KVTRACE_CACHE" if os.environ.get("KVTRACE_CACHE") else "the cache folder"
        raise UsageError(f"{origin} {d} is not a writable folder ({why}); expected a folder kvtrace can create "
                         "and write. Set KVTRACE_CACHE to one, e.g. KVTRACE_CACHE=/tmp/kvtrace-cache")
    return d


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def list_cache() -> list[tuple[Path, int]]:
    """Complete weights-cache entries (cache_dir()/models/<digest>) with their sizes in bytes."""
    models = cache_dir() / "models"
    return (
        [(p, _size(p)) for p in sorted(models.iterdir()) if not p.name.startswith(".")]
        if models.is_dir()
        else []
    )


def clear_cache() -> int:
    """Delete every weights-cache entry (and leftover temp folders) and the remembered GGUF checks
    (``sources.gguf.CHECKS_DIR``); return the bytes freed."""
    from kvtrace.sources.gguf import CHECKS_DIR

    models, checks = cache_dir() / "models", cache_dir() / CHECKS_DIR
    freed = 0
    for p in [*(sorted(models.iterdir()) if models.is_dir() else []), *([checks] if checks.is_dir() else [])]:
        freed += _size(p)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return freed
