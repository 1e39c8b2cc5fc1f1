"""Compiled-artifact cache: (source, options, versions) -> an artifact file built once.

The second ``kvtrace generate`` on the same model and options loads the cached artifact instead of
exporting and compiling again. Entries live in ``cache_dir()/artifacts/<key>.kvt``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["BuildResult", "artifact_key", "cached_artifact", "list_artifacts"]


@dataclass(frozen=True)
class BuildResult:
    path: Path
    cache_hit: bool
    seconds: float  # export + compile time, 0 on a cache hit


def artifact_key(digest: str, *, backend: str, max_seq_len: int, dtype: str, batch_size: int,
                 prefill_logits: str = "last") -> str:
    from kvtrace import __version__

    blob = json.dumps([digest, backend, max_seq_len, dtype, batch_size, __version__, torch.__version__,
                       *([] if prefill_logits == "all" else [prefill_logits])])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _artifacts_dir() -> Path:
    from kvtrace._sources import cache_dir

    d = cache_dir() / "artifacts"
    d.mkdir(parents=True, exist_ok=True)
    return d


def cached_artifact(source: str | None, *, backend: str, max_seq_len: int, dtype: str = "float32",
                    batch_size: int = 1, prefill_logits: str = "last", progress: Any = None) -> BuildResult:
    """The artifact for ``source`` with these options, exporting it on a cache miss. Its prefill returns
    the last position's logits by default (what a generation samples from; see ``export``)."""
    from kvtrace._export import export
    from kvtrace._sources import resolve_source

    src = resolve_source(source)
    key = artifact_key(src.digest, backend=backend, max_seq_len=max_seq_len, dtype=dtype, batch_size=batch_size,
                       prefill_logits=prefill_logits)
    path = _artifacts_dir() / f"{src.name}-{backend}-{key}.kvt"
    if path.is_file():
        return BuildResult(path, True, 0.0)
    t0 = time.perf_counter()
    export(src, path, max_seq_len=max_seq_len, dtype=dtype, batch_size=batch_size, backend=backend,
           prefill_logits=prefill_logits, progress=progress)
    return BuildResult(path, False, time.perf_counter() - t0)


def list_artifacts() -> list[tuple[Path, int]]:
    d = _artifacts_dir()
    return [(p, p.stat().st_size) for p in sorted(d.glob("*.kvt"))]


def clear_artifacts() -> int:
    freed = 0
    for p, size in list_artifacts():
        p.unlink()
        freed += size
    return freed
