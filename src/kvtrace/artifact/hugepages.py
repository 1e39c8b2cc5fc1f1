"""An artifact's weights in transparent huge pages (``kvtrace.load(path, huge_pages=True)``, ``--huge-pages``).

Batch-1 decode streams every weight once per token. In 4 KiB pages that is a TLB miss per 4 KiB read (135k a
token for SmolLM2's 540 MB of float32 weights), each a page walk, two-level under a VM's nested paging; in
2 MiB pages, 512 times fewer. Two ways in, both Linux's transparent huge pages (THP) through ``madvise``, both
best effort (another OS, an older kernel, THP off: nothing changes and the weights work as before):

- ``advise(buf)``: memory kvtrace allocates itself and has not touched yet (the weights read from an
  artifact, ``reader``) is marked ``MADV_HUGEPAGE``, so the reads that fill it fault in 2 MiB pages;
- ``collapsed()``: memory a backend's own runtime allocates while kvtrace builds a program (XNNPACK packing a
  ``.pte``'s weights into buffers of its own, an AOTInductor library's constants) is collapsed into huge
  pages after the block: every anonymous writable mapping the block created, ``MADV_COLLAPSE`` (Linux >= 6.1).

Measured on this project's 2-vCPU Firecracker VMs (SmolLM2-135M, 2 threads, 64 greedy tokens after a
37-token prompt, plain and huge-page instances alternated in one process, stop 48): float32 ``aoti`` decode
53.9-56.0 -> 58.7-60.4 tokens/s, the float32 ``.pte`` 55.8-56.9 -> 58.7-60.0; int4 ``aoti`` +2 %, the 8da4w
``.pte`` none (its 4-bit GEMMs are compute-bound there). The price is load time: a huge page's first touch
is slow on those VMs (guest memory backed lazily by the host), the aoti float32 load 0.44 -> 0.9-1.4 s and a
``.pte`` session's collapse 0.4-2 s for its ~600 MiB. Hence off by default: worth it for long generations and
servers, not for a one-shot short answer.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["HUGE_PAGE", "Report", "advise", "collapsed"]

HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) PMD size
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # linux/mman.h (MADV_COLLAPSE: Linux >= 6.1)
MAPS = "/proc/self/maps"


@dataclass
class Report:
    """What one ``advise``/``collapsed`` asked for and got: bytes in 2 MiB-aligned spans, and the spans the
    kernel refused (errno), e.g. EINVAL from a kernel without MADV_COLLAPSE."""

    bytes_asked: int = 0
    bytes_done: int = 0
    refused: list[int] = field(default_factory=list)  # errno per refused span


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    f.restype = ctypes.c_int
    return f


def _inner(start: int, end: int) -> tuple[int, int]:
    """The 2 MiB-aligned span inside [start, end) (empty: begin >= end)."""
    return (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), end & ~(HUGE_PAGE - 1)


def _advise_spans(spans: list[tuple[int, int]], advice: tuple[int, ...], report: Report) -> Report:
    madvise = _madvise()
    for start, end in spans:
        lo, hi = _inner(start, end)
        if hi <= lo:
            continue
        report.bytes_asked += hi - lo
        if madvise is None:
            report.refused.append(0)
            continue
        for a in advice:
            if madvise(lo, hi - lo, a) != 0:
                report.refused.append(ctypes.get_errno())
                break
        else:
            report.bytes_done += hi - lo
    return report


def advise(buf: torch.Tensor) -> Report:
    """Mark ``buf``'s memory (a CPU tensor not yet written: its pages not yet faulted) MADV_HUGEPAGE, so
    filling it faults 2 MiB pages. Only the 2 MiB-aligned span inside it; a buffer under 2 MiB is left."""
    n = buf.numel() * buf.element_size()
    return _advise_spans([(buf.data_ptr(), buf.data_ptr() + n)] if buf.device.type == "cpu" else [],
                         (MADV_HUGEPAGE,), Report())


def _anonymous_writable() -> set[tuple[int, int]] | None:
    """[start, end) of every anonymous read-write mapping of this process (None where there is no
    /proc/self/maps). A line: ``start-end perms offset dev inode [path]``; anonymous ones have no path, or
    ``[heap]`` (malloc's main arena: allocations under its mmap threshold, which grows to 32 MiB as large
    blocks are freed, come from there, e.g. most of XNNPACK's packed weights)."""
    try:
        with open(MAPS) as f:
            lines = f.readlines()
    except OSError:
        return None
    out = set()
    for line in lines:
        parts = line.split()
        if (len(parts) == 5 or parts[5:] == ["[heap]"]) and parts[1].startswith("rw"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.add((lo, hi))
    return out


@contextmanager
def collapsed(enabled: bool = True) -> Iterator[Report]:
    """Collapse into huge pages the anonymous writable mappings created while the block runs (those it did
    not find before: a mapping that grew or merged with a new one counts as new). The Report fills in on
    exit. ``enabled`` False: nothing is read or asked."""
    report = Report()
    before = _anonymous_writable() if enabled else None
    yield report
    if before is None:
        return
    after = _anonymous_writable()
    if after is not None:
        _advise_spans(sorted(after - before), (MADV_HUGEPAGE, MADV_COLLAPSE), report)
