"""int8 K/V: a cache option on any self-attention kind (``CacheSpec.kv_dtype == "int8"``).

    k, v:             [B, H_kv, S, D] int8     q = round(x / scale) clamped to [-127, 127]
    k_scale, v_scale: [B, H_kv, S, 1] float16  scale = max(max|x| over D, 127 * 2**-14) / 127, per token and head

Symmetric, no zero point: x ~ q * scale (``dequantize``), error at most half a step, scale / 2 (the scale is
rounded to float16 first and the values divided by the stored scale, so the bound holds for what is stored).
Why symmetric: a read is one multiply, a layer has 2 scale buffers and no zero points, and the bytes leave room
under 0.3x fp32 down to head_dim 16 ((D + 2) / 4D: 0.281; an int8 zero point per token and head makes it
(D + 3) / 4D, 0.297). Measured on SmolLM2-135M's cache after a 145-token prompt (all 30 layers, float32): an
asymmetric variant (scale = (max - min) / 255, int8 zero point) has 29 % lower mean abs error on K (0.0158 vs
0.0221, mean |K| 1.47) and 13 % on V (0.0040 vs 0.0047, mean |V| 0.62); llama.cpp's q8_0 is symmetric too.
The floor on the scale (float16's smallest normal) keeps an all-zero row finite (q = 0).

A kind's ``write`` stores the quantized values and the scales at the slots it says (full: ``input_pos``;
sliding: ``input_pos % W``): the scales are [B, H_kv, S, 1] tensors indexed like K/V on dim 2, so the kind's
own write does both (``write``). Attention reads dequantized K/V (``read``); the call's own keys are read as
the cache stores them too (``stored``), so every key a query sees went through the int8 round trip.
"""

from __future__ import annotations

import torch

from kvtrace.cache import full
from kvtrace.cache.kinds import KindOps

__all__ = ["MIN_SCALE", "QMAX", "dequantize", "quantize", "read", "read_rows", "stored", "valid", "write", "write_rows"]

QMAX = 127  # symmetric: -127 .. 127 (-128 unused)
MIN_SCALE = 2.0**-14  # float16's smallest normal: the smallest scale stored at full float16 precision


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (q [..., D] int8, scale [..., 1] float16); q * scale ~ x."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).clamp(min=MIN_SCALE).to(torch.float16)  # [..., 1]
    q = torch.round(xf / scale.float()).clamp(-QMAX, QMAX).to(torch.int8)  # divided by the scale as stored
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] int8, scale [..., 1] -> [..., D] in ``dtype`` (computed in float32, rounded once)."""
    return (q.float() * scale.float()).to(dtype)


def stored(x: torch.Tensor) -> torch.Tensor:
    """What the cache returns for x once written: x quantized and dequantized, in x's dtype."""
    return dequantize(*quantize(x), x.dtype)


def write(kind: KindOps, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
          input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [B, H_kv, T, D] quantized into the int8 k_cache, v_cache [B, H_kv, S, D] and their scales
    [B, H_kv, S, 1] (``scales``), at the slots ``kind`` writes for ``input_pos`` [T]."""
    (qk, sk), (qv, sv) = quantize(k), quantize(v)
    kind.write(k_cache, v_cache, input_pos, qk, qv)
    kind.write(scales[0], scales[1], input_pos, sk, sv)


def write_rows(kind: KindOps, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
               slots: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``write`` per row (a slots program): k, v [R, H_kv, T, D] into rows ``slots [R]``, row r at the slots
    ``kind`` writes for ``input_pos[r]`` ([R, T]; ``kind.write_rows``), values and scales alike."""
    (qk, sk), (qv, sv) = quantize(k), quantize(v)
    kind.write_rows(k_cache, v_cache, slots, input_pos, qk, qv)
    kind.write_rows(scales[0], scales[1], slots, input_pos, sk, sv)


def read_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
              dtype: torch.dtype, slots: torch.Tensor, key_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``slots [R]`` dequantized in ``dtype``: at cache slots ``key_pos [L]`` -> [R, H_kv, L, D] (a full
    layer's live prefix), or the whole rows (key_pos None: a ring) -> [R, H_kv, S, D]."""
    if key_pos is None:
        k, v, sk, sv = (t.index_select(0, slots) for t in (k_cache, v_cache, *scales))
    else:
        (k, v), (sk, sv) = full.OPS.read_rows(k_cache, v_cache, slots, key_pos), full.OPS.read_rows(*scales, slots, key_pos)
    return dequantize(k, sk, dtype), dequantize(v, sv, dtype)


def read(k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
         slots: torch.Tensor | None = None, view: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K, V [B, H_kv, S, D] in ``dtype``; with ``slots [L]`` (the live prefix 0 .. L-1) only those
    ([B, H_kv, L, D]: gathered, or a view with ``view``; ``full.live``), dequantized after (L slots of work,
    not S)."""
    k_scale, v_scale = scales
    if slots is not None:
        k_cache, v_cache = full.live(k_cache, slots, view), full.live(v_cache, slots, view)
        k_scale, v_scale = full.live(k_scale, slots, view), full.live(v_scale, slots, view)
    return dequantize(k_cache, k_scale, dtype), dequantize(v_cache, v_scale, dtype)


def valid(kind: KindOps, k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor], position: int,
          prefilled: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The slots ``kind`` says hold data at ``position``, dequantized: what verify compares (a wrong or stale
    scale shows as a wrong value), None when the layer holds nothing yet."""
    kv = kind.valid(k, v, position, prefilled)
    sc = kind.valid(scales[0], scales[1], position, prefilled)
    if kv is None or sc is None:
        return None
    return dequantize(kv[0], sc[0], dtype), dequantize(kv[1], sc[1], dtype)
