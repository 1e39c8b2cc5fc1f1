"""Compiled-artifact cache: (source, options, versions) -> an artifact file built once.

The second ``kvtrace generate`` on the same model and options loads the cached artifact instead of
exporting and compiling again. Entries live in ``cache_dir()/artifacts/<name>-<backend>-<key>.kvt``.

Invariants:
- the key covers every file that shapes the artifact (``ModelSource.digest``) and every option; a native-code
  entry also this CPU's extensions (``cpu_isa.fingerprint``): machines sharing one cache build their own;
- an entry appears only complete (``write_artifact`` renames it into place) and only from a build
  that succeeded; a build that fails leaves nothing behind;
- one build per entry at a time: builders hold ``fcntl.flock`` on ``<entry>.lock``, so a second
  process waits for the first and then takes its result from the cache;
- an entry that ``kvtrace.load`` refuses (ArtifactError: corrupt, truncated, tampered) is rebuilt
  once, with a one-line notice, when the caller asks for the loaded artifact.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import ArtifactError, UsageError

__all__ = ["BuildResult", "artifact_key", "cached_artifact", "clear_artifacts", "entry_path", "list_artifacts"]


@dataclass(frozen=True)
class BuildResult:
    path: Path
    cache_hit: bool
    seconds: float  # export + compile time, 0 on a cache hit
    artifact: Any = None  # the loaded kvtrace Artifact when cached_artifact(load=True), else None
    rebuilt: bool = False  # a cached entry failed its integrity check and was built again


def artifact_key(digest: str, *, backend: str, max_seq_len: int, dtype: str, batch_size: int,
                 prefill_logits: str = "last", kv_dtype: str | None = None, device: str = "cpu",
                 quant: str | None = None, slots: int | None = None) -> str:
    """``quant``: the quantization's ``QuantSpec.key`` (scheme, group size, head), None for none."""
    from kvtrace import __version__
    from kvtrace.artifact.archive import VERSION  # a new artifact format never serves entries of the old one
    from kvtrace.backends import registry
    from kvtrace.backends.cpu_isa import fingerprint

    chosen = registry.get(backend)  # native code is compiled for this CPU (-march=native; a CUDA library's host code too)
    blob = json.dumps([digest, chosen.name, max_seq_len, dtype, batch_size, __version__, VERSION, torch.__version__,
                       *([] if prefill_logits == "all" else [prefill_logits]),
                       *([] if kv_dtype in (None, "auto") else [f"kv_dtype={kv_dtype}"]),
                       *([] if device == "cpu" else [f"device={device}"]),  # a CPU entry's key as before
                       *([] if quant is None else [f"quant={quant}"]),
                       *([] if slots is None else [f"slots={slots}"]),
                       *([f"cpu={fingerprint()}"] if chosen.native_code else [])])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def entry_path(src: Any, *, backend: str, max_seq_len: int, dtype: str = "float32", batch_size: int = 1,
               prefill_logits: str = "last", kv_dtype: str | None = None, device: str = "cpu",
               quant: str | None = None, slots: int | None = None) -> Path:
    """Where the cache keeps the artifact of a resolved source (``ModelSource``) with these options
    (``quant``: a ``QuantSpec.key``)."""
    key = artifact_key(src.digest, backend=backend, max_seq_len=max_seq_len, dtype=dtype, batch_size=batch_size,
                       prefill_logits=prefill_logits, kv_dtype=kv_dtype, device=device, quant=quant, slots=slots)
    return _artifacts_dir() / f"{src.name}-{backend}{'' if slots is None else f'-slots{slots}'}-{key}.kvt"


def _artifacts_dir() -> Path:
    from kvtrace.sources.store import cache_dir

    d = cache_dir() / "artifacts"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"could not create the artifact cache {d} ({e.strerror or e}); "
                         "set KVTRACE_CACHE to a writable folder") from e
    return d


def _lock_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".lock")


@contextlib.contextmanager
def _locked(entry: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``<entry>.lock``; yields False (holding nothing) if ``wait`` is
    False and another process holds it.

    The lock file is removed on release while still held; a waiter that then gets the lock on the
    removed file sees that the path names another inode (or none) and locks again, so at most one
    holder exists per entry and no lock file outlives its build (unless the process is killed:
    ``clear_artifacts`` removes those).
    """
    lock = _lock_path(entry)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(f"could not create the build lock {lock} ({e.strerror or e}); "
                             "set KVTRACE_CACHE to a writable folder") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            busy = False
        except BlockingIOError:
            busy = True
        except BaseException:
            os.close(fd)
            raise
        if busy:
            os.close(fd)
            yield False
            return
        try:
            current = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        yield True
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def cached_artifact(source: str | None, *, backend: str, max_seq_len: int, dtype: str = "float32",
                    batch_size: int = 1, prefill_logits: str = "last", progress: Any = None,
                    load: bool = False, notice: Callable[[str], None] | None = None,
                    kv_dtype: str | None = None, device: str = "cpu", quant: str | None = None,
                    quant_group_size: int | None = None, quant_head: bool = True, slots: int | None = None,
                    build: bool = True, huge_pages: bool = False) -> BuildResult | None:
    """The artifact for ``source`` with these options, exporting it on a cache miss. Its prefill returns
    the last position's logits by default (what a generation samples from; see ``export``); ``kv_dtype``
    ("int8") asks for a quantized KV cache, ``quant`` (``export``'s) for quantized weights, ``device`` ("cuda")
    programs compiled for a GPU (keyed by the device type; loaded on ``device``), ``slots`` (N) an artifact of
    N conversation slots (``export``): each a separate entry.

    ``load=True`` also loads it (``BuildResult.artifact``): a cached entry that ``kvtrace.load``
    refuses is then deleted and rebuilt, and ``notice`` (if given) gets one line saying so. A freshly
    built artifact that does not load raises its ArtifactError and is not kept. ``huge_pages``: its weights
    loaded into transparent huge pages (``kvtrace.load(..., huge_pages=True)``).

    ``build=False`` looks only: None on a miss (a refused entry is deleted, so that a build rebuilds it).
    """
    from kvtrace.artifact.archive import load as load_artifact
    from kvtrace.artifact.export import export
    from kvtrace.sources.resolve import resolve_source
    from kvtrace.spec.device import check_available
    from kvtrace.spec.device import resolve as resolve_device
    from kvtrace.spec.quant import parse_quant

    dev = resolve_device(device, what="device")
    check_available(dev, f"device {dev}")  # before any model is read or compiled
    src = resolve_source(source)
    qspec = parse_quant(quant, quant_group_size, quant_head)
    path = entry_path(src, backend=backend, max_seq_len=max_seq_len, dtype=dtype, batch_size=batch_size,
                      prefill_logits=prefill_logits, kv_dtype=kv_dtype, device=dev.type,
                      quant=qspec.key if qspec else None, slots=slots)
    refused: tuple[int, int, int] | None = None  # the stamp of the entry that failed to load

    def hit() -> BuildResult | None:
        nonlocal refused
        stamp = _stamp(path)
        if stamp is None or stamp == refused:
            return None
        if not load:
            return BuildResult(path, True, 0.0)
        try:
            return BuildResult(path, True, 0.0, load_artifact(path, device=dev, huge_pages=huge_pages))
        except ArtifactError as e:
            refused = stamp
            if notice is not None:
                notice(f"cached artifact {path.name} failed its integrity check ({e}); rebuilding it")
            return None

    found = hit()
    if found is not None or not build:
        if found is None and refused is not None:
            with _locked(path):  # nobody else is writing it
                if _stamp(path) == refused:
                    path.unlink(missing_ok=True)
        return found
    with _locked(path):
        found = hit()  # another process may have built (or rebuilt) it while this one waited
        if found is not None:
            return found
        if refused is not None:
            path.unlink(missing_ok=True)  # under the lock: nobody else is writing it
        t0 = time.perf_counter()
        try:
            export(src, path, max_seq_len=max_seq_len, dtype=dtype, batch_size=batch_size, backend=backend,
                   prefill_logits=prefill_logits, progress=progress, kv_dtype=kv_dtype, device=dev, quant=qspec,
                   slots=slots)
        except OSError as e:
            raise UsageError(f"could not write the cached artifact {path} ({e.strerror or e}); "
                             "set KVTRACE_CACHE to a writable folder with free space") from e
        seconds = time.perf_counter() - t0
        art = None
        if load:
            try:
                art = load_artifact(path, device=dev, huge_pages=huge_pages)
            except ArtifactError:
                path.unlink(missing_ok=True)  # never cache what does not load
                raise
    return BuildResult(path, False, seconds, art, rebuilt=refused is not None)


def list_artifacts() -> list[tuple[Path, int]]:
    d = _artifacts_dir()
    return [(p, p.stat().st_size) for p in sorted(d.glob("*.kvt"))]


def clear_artifacts() -> int:
    """Delete every cached artifact and build leftover (temp files of interrupted writes, lock files of
    killed builds); return the bytes freed. A build running meanwhile keeps its lock and temp file."""
    d = _artifacts_dir()
    freed = 0
    busy: list[str] = []
    with contextlib.ExitStack() as held:
        for lock in sorted(d.glob("*.kvt.lock")):
            entry = lock.with_name(lock.name.removesuffix(".lock"))
            if not held.enter_context(_locked(entry, wait=False)):  # released (and removed) on exit
                busy.append(entry.name)
        for p in sorted(d.iterdir()):
            # write_artifact's temp files: ".<entry name>.<random>.tmp"
            leftover = p.name.startswith(".") and p.name.endswith(".tmp")
            if not (p.suffix == ".kvt" or leftover) or not p.is_file():
                continue
            if leftover and any(p.name.startswith(f".{b}.") for b in busy):
                continue
            size = p.stat().st_size
            p.unlink(missing_ok=True)
            freed += size
    return freed
