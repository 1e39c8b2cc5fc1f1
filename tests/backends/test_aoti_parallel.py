"""AOTI programs compiled in parallel child processes (``backends/aoti._compile_in_processes``) are the
programs a serial compile in this process makes: Inductor specializes each CPU kernel's OpenMP loop for the
thread count at code generation, so a child that ran with one thread wrote single-threaded kernels (every
artifact built in parallel decoded on one core). Neither way leaves Inductor's files behind."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

import kvtrace
from conftest import tiny_model
from kvtrace.backends import aoti

pytestmark = pytest.mark.compile


def _parallel_regions(path) -> dict[str, int]:
    """Kernel source file -> its number of OpenMP parallel regions."""
    outer = zipfile.ZipFile(path)
    inner = zipfile.ZipFile(io.BytesIO(outer.read("programs/aoti.pt2")))
    return {n.rsplit("/", 1)[-1]: inner.read(n).decode(errors="ignore").count("#pragma omp parallel")
            for n in inner.namelist() if n.endswith(".kernel.cpp")}


def test_parallel_compile_writes_the_kernels_a_serial_compile_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(aoti.os, "cpu_count", lambda: 2)  # the parallel path, even on a one-core machine
    monkeypatch.setattr(aoti, "SHARED_DECODE", False)  # two programs to compile (a shared decode is one)
    inductor = tmp_path / "inductor"  # Inductor's cache dir, this test's own (children inherit it)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    model = tiny_model("llama", hidden_size=256, intermediate_size=1024, vocab_size=4096)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        regions = {}
        for parallel in (False, True):
            monkeypatch.setattr(aoti, "PARALLEL_COMPILE", parallel)
            path = kvtrace.export(model, tmp_path / f"p{parallel}.kvt", max_seq_len=128, backend="aoti")
            regions[parallel] = _parallel_regions(path)
    finally:
        torch.set_num_threads(threads)
    assert set(regions[True]) == {"prefill.kernel.cpp", "decode.kernel.cpp"}
    assert regions[True] == regions[False] and min(regions[True].values()) >= 1, regions
    # compiled with the caches off, in this process and in children, Inductor left none of its per-compile dirs
    assert not [p.name for p in inductor.glob("tmp*")], sorted(p.name for p in inductor.iterdir())
