"""artifact.hugepages: weights in transparent huge pages, asked of the kernel by madvise (best effort)."""

from __future__ import annotations

import hashlib
import mmap
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from tests.conftest import tiny_model

import kvtrace
from kvtrace.artifact import hugepages, reader

MIB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage").is_dir()
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/maps are Linux's")


def test_inner_spans_are_the_2mib_aligned_part():
    h = hugepages.HUGE_PAGE
    assert hugepages._inner(0, 3 * h) == (0, 3 * h)
    assert hugepages._inner(1, 3 * h - 1) == (h, 2 * h)
    lo, hi = hugepages._inner(h + 1, 2 * h + 5)  # no whole huge page inside
    assert hi <= lo


@linux
def test_advise_asks_for_the_aligned_interior_of_an_untouched_buffer():
    buf = torch.empty(9 * MIB, dtype=torch.uint8)
    r = hugepages.advise(buf)
    lo, hi = hugepages._inner(buf.data_ptr(), buf.data_ptr() + buf.numel())
    assert r.bytes_asked == hi - lo >= 6 * MIB
    if THP:  # a kernel built with transparent huge pages takes MADV_HUGEPAGE (whatever its sysfs policy)
        assert r.bytes_done == r.bytes_asked and not r.refused
    else:  # one without refuses it (EINVAL), and nothing else changes
        assert r.bytes_done == 0 and r.refused
    buf.fill_(7)  # still ordinary memory
    assert int(buf.sum()) == 7 * buf.numel()
    assert hugepages.advise(torch.empty(MIB, dtype=torch.uint8)).bytes_asked == 0  # under one huge page


@linux
def test_collapsed_finds_the_mappings_the_block_made_and_only_those():
    with hugepages.collapsed() as r:
        m = _private(9 * MIB, b"x")  # a runtime's buffer (a malloc too large for its heap)
    lo, hi = hugepages._inner(*_span_of(m))
    assert r.bytes_asked >= hi - lo >= 6 * MIB
    assert m[:1] == b"x" and m[-1:] == b"x"  # contents kept
    # MADV_COLLAPSE is Linux >= 6.1: older kernels refuse it (EINVAL), the mapping stays as it was
    assert r.bytes_done + (hi - lo) * len(r.refused) >= hi - lo
    with hugepages.collapsed() as again:  # nothing new mapped
        pass
    assert again.bytes_asked == 0
    with hugepages.collapsed(enabled=False) as off:
        m2 = _private(9 * MIB, b"y")
    assert off.bytes_asked == 0
    m.close()
    m2.close()


def _private(n: int, fill: bytes) -> mmap.mmap:
    """An anonymous private read-write mapping of ``n`` bytes, filled in place (Python's default mmap is shared,
    which /proc/self/maps lists as /dev/zero: shared memory, not what runtimes allocate)."""
    import ctypes

    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    ctypes.memset(_span_of(m)[0], fill[0], n)
    return m


def _span_of(m: mmap.mmap) -> tuple[int, int]:
    import ctypes

    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    return start, start + len(m)


def test_without_proc_maps_or_madvise_nothing_is_asked_and_nothing_breaks(monkeypatch):
    monkeypatch.setattr(hugepages, "MAPS", "/nonexistent/maps")
    with hugepages.collapsed() as r:
        pass
    assert r.bytes_asked == 0 and not r.refused
    monkeypatch.setattr(hugepages, "_madvise", lambda: None)  # another OS: spans counted as refused, none done
    r = hugepages.advise(torch.empty(9 * MIB, dtype=torch.uint8))
    assert r.bytes_asked >= 6 * MIB and r.bytes_done == 0 and r.refused == [0]


def test_the_weights_buffer_is_advised_before_it_is_filled(tmp_path, monkeypatch):
    blob = bytes(range(256)) * (40 * 1024)  # 10 MiB
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("weights.safetensors", blob)
    seen = []

    def spy(buf):
        seen.append(buf.data_ptr())
        return hugepages.Report()

    monkeypatch.setattr(hugepages, "advise", spy)
    with zipfile.ZipFile(path) as zf, path.open("rb") as f:
        info = zf.getinfo("weights.safetensors")
        out, digest = reader._read_stored(path, f, info, len(blob), huge_pages=True)
        assert len(seen) == 1 and seen[0] <= out.data_ptr() < seen[0] + 64  # the buffer the bytes went to
        assert digest == hashlib.sha256(blob).hexdigest() and bytes(out.numpy()) == blob
        out2, _ = reader._read_stored(path, f, info, len(blob))
    assert len(seen) == 1 and bytes(out2.numpy()) == blob  # off by default


def test_a_huge_pages_load_computes_what_a_plain_one_does(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "t.kvt"
    kvtrace.export(model, path, max_seq_len=16, backend="exported")
    plain, huge = kvtrace.load(path), kvtrace.load(path, huge_pages=True)
    assert (plain.huge_pages, huge.huge_pages) == (False, True)
    a, b = plain.session(), huge.session()
    ids = torch.tensor([[5, 17, 42, 8]])
    assert torch.equal(a.prefill(ids), b.prefill(ids))
    assert torch.equal(a.decode(torch.tensor([[3]])), b.decode(torch.tensor([[3]])))
