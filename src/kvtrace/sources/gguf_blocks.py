"""A GGUF's quantized blocks, found again for the weights of a decoder built from its dequantized model.

transformers dequantizes a GGUF to float32 (``sources.load``), and kvtrace's decoders then fuse, reorder and
tie those weights (q/k/v into one matrix, llama.cpp's rope row order undone, a tied head). ``GGUFBlocks`` maps
each of the GGUF's dequantized rows (by its exact float32 bytes) back to the row of blocks it came from, so a
decoder weight ``[N, K]`` — whatever rows it was assembled from — gets its blocks row by row, with no
knowledge of any family's layout, and is checked to dequantize back to exactly that weight, bit for bit.

Kept as blocks: Q4_0, Q4_1, Q8_0 (32 weights per block, float16 d and m). A weight with rows of any other
type (F32, F16, K-quants) or rows from tensors of different types is reported as dequantized, with why.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvtrace.sources.gguf import check_gguf

__all__ = ["KEPT", "GGUFBlocks", "kept_share"]

# ggml type name -> (kvtrace format, bytes per block of 32)
KEPT = {"Q4_0": ("q4_0", 18), "Q4_1": ("q4_1", 20), "Q8_0": ("q8_0", 34)}
_KEPT_TYPE_IDS = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}  # their ggml type ids (fixed by the GGUF format)


def kept_share(path: Path) -> float:
    """The share of a GGUF's matrix weights (2-D tensors, by element count) stored as blocks kvtrace keeps (KEPT),
    read from the remembered header walk (``check_gguf``): no tensor data is touched."""
    mats = [t for t in check_gguf(path).tensors if len(t.dims) == 2]
    total = sum(t.dims[0] * t.dims[1] for t in mats)
    kept = sum(t.dims[0] * t.dims[1] for t in mats if t.ggml_type in _KEPT_TYPE_IDS)
    return kept / total if total else 0.0


class GGUFBlocks:
    """Call it with a float32 weight [N, K]: (format, q [N, K/32, 32], d [N, K/32], m [N, K/32] or None), or
    (None, why) when its rows are not all blocks of one kept type."""

    def __init__(self, path: Path):
        import gguf.quants
        from gguf.constants import GGMLQuantizationType

        info = check_gguf(path)
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self._raw: list[tuple[str, str, np.ndarray]] = []  # (tensor name, ggml type name, raw rows [R, bytes])
        self._index: dict[bytes, tuple[int, int]] = {}  # row's float32 bytes digest -> (tensor, row)
        for t in info.tensors:
            if len(t.dims) != 2:
                continue
            qtype = GGMLQuantizationType(t.ggml_type)
            k, rows = t.dims
            from gguf.constants import GGML_QUANT_SIZES

            block, block_bytes = GGML_QUANT_SIZES[qtype]
            start = info.data_start + t.offset
            raw = self._mm[start:start + rows * (k // block) * block_bytes].reshape(rows, -1)
            deq = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(rows, k)
            i = len(self._raw)
            self._raw.append((t.name, qtype.name, raw))
            for r in range(rows):
                self._index.setdefault(_digest(deq[r]), (i, r))

    def __call__(self, weight: torch.Tensor) -> tuple:
        w = weight.detach().float().contiguous().numpy()
        found = [self._index.get(_digest(row)) for row in w]
        if any(f is None for f in found):
            return None, "its rows are not rows of the GGUF (a weight transformed after dequantizing)"
        tensors = {f[0] for f in found}
        types = {self._raw[i][1] for i in tensors}
        if len(types) > 1 or next(iter(types)) not in KEPT:
            names = ", ".join(sorted(self._raw[i][0] for i in tensors))[:120]
            return None, f"GGUF {'/'.join(sorted(types))} ({names}): dequantized to float32 as before"
        fmt, nbytes = KEPT[next(iter(types))]
        raw = np.stack([self._raw[i][2][r] for i, r in found])  # [N, G * nbytes]
        n, k = w.shape
        blocks = torch.from_numpy(raw.reshape(n, k // 32, nbytes).copy())  # [N, G, bytes]
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, G]
        m = None
        if fmt == "q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8)  # [N, G, 32]
        else:
            qs = blocks[..., 4:] if fmt == "q4_1" else blocks[..., 2:]  # [N, G, 16]: element j low, j + 16 high
            q = torch.cat([qs & 15, qs >> 4], dim=-1).contiguous()  # [N, G, 32] uint8 0..15
            if fmt == "q4_1":
                m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
        deq = q.float() - (8 if fmt == "q4_0" else 0)
        deq = deq * d.float()[..., None] + (0 if m is None else m.float()[..., None])
        if not torch.equal(deq.reshape(n, k), weight.detach().float()):
            return None, f"its {fmt} blocks do not dequantize to the weight exactly"
        return fmt, q, d.contiguous(), None if m is None else m.contiguous()


def _digest(row: np.ndarray) -> bytes:
    import hashlib

    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()
