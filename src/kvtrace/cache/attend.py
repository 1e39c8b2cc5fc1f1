"""One self-attention layer's cache access in a program: write the call's K/V, return what its queries read.

Every decoder (``models.llama``, ``models.gemma``, the general path's ``models.hf_attention``) calls ``update``
once per self-attention layer and then attends with its own kernel (SDPA, soft-capped, HF's modules), so
what a layer reads and writes for each kind and each ``kv_dtype`` is decided here, once::

    FULL     writes k, v at slots input_pos; reads every slot [B, H_kv, S, D], or with key_pos [L] the
             live prefix [B, H_kv, L, D] (key_pos = 0 .. L-1; gathered, or a view where the caller asks,
             ``full.live``); the caller masks by position ([T, S] or [T, L])
    SLIDING  reads the ring as it was plus the call's keys [B, H_kv, W + T, D] with the ring's own mask
             [T, W + T] (``sliding.attention_inputs``), then writes slots input_pos % W

A slots program (``update_rows``) does the same per cache row: rows ``slots [R]``, row r at its own
positions ``input_pos[r]``, masks per row.

An int8 cache (``LayerState.scales`` set, ``cache/int8.py``) is written quantized and read dequantized in the
call's dtype; the call's own keys are read as the cache stores them (``int8.stored``), so every key a query
sees went through the int8 round trip, on every path alike.
"""

from __future__ import annotations

import torch

from kvtrace.cache import full, int8, sliding
from kvtrace.cache.kinds import KindOps
from kvtrace.spec.cache import LayerState

__all__ = ["update", "update_rows"]


def update(layer: LayerState, ring: bool, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           key_pos: torch.Tensor | None = None,
           view: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """k, v [B, H_kv, T, D] at positions ``input_pos [T]`` into ``layer`` -> (keys, values, mask): what the
    call's queries attend over, and for a ring (``ring``: a SLIDING layer) its mask [T, W + T] (True = visible);
    None for a full layer, which the caller masks by position. ``view``: the live prefix (key_pos) is read as a
    view of the cache, not gathered (``full.live``; only for callers whose attention is SDPA, in one-token calls)."""
    scales = layer.scales
    if ring:
        if scales is None:
            old_k, old_v, new_k, new_v = layer.k, layer.v, k, v
        else:
            old_k, old_v = int8.read(layer.k, layer.v, scales, k.dtype)  # [B, H_kv, W, D]
            new_k, new_v = int8.stored(k), int8.stored(v)
        keys, values, mask = sliding.attention_inputs(old_k, old_v, input_pos, new_k, new_v)  # [B, H_kv, W + T, D]
        _write(sliding.OPS, layer, input_pos, k, v)  # slots input_pos % W, after the read
        return keys, values, mask
    _write(full.OPS, layer, input_pos, k, v)  # slots input_pos of [B, H_kv, S, D]
    if scales is not None:
        keys, values = int8.read(layer.k, layer.v, scales, k.dtype, key_pos, view)  # [B, H_kv, L or S, D]
    else:
        keys, values = full.live(layer.k, key_pos, view), full.live(layer.v, key_pos, view)  # [B, H_kv, L or S, D]
    return keys, values, None


def update_rows(layer: LayerState, ring: bool, slots: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, key_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``update`` for a slots program (``ProgramSpec.slots``: each cache row its own conversation): k, v
    [R, H_kv, T, D] of rows ``slots [R]``, row r at positions ``input_pos[r]`` ([R, T]) -> (keys, values, mask)
    of those rows only: a full layer's live prefix [R, H_kv, L, D] at slots ``key_pos [L]`` (L: the longest
    row's end; the caller masks each row by its positions), or a ring's [R, H_kv, W + T, D] with its mask
    [R, 1, T, W + T] (``sliding.attention_inputs_rows``). Rows never mix: row r reads and writes row slots[r]."""
    scales = layer.scales
    if ring:
        if scales is None:
            old_k, old_v, new_k, new_v = layer.k.index_select(0, slots), layer.v.index_select(0, slots), k, v
        else:
            old_k, old_v = int8.read_rows(layer.k, layer.v, scales, k.dtype, slots, None)  # [R, H_kv, W, D]
            new_k, new_v = int8.stored(k), int8.stored(v)
        keys, values, mask = sliding.attention_inputs_rows(old_k, old_v, input_pos, new_k, new_v)
        _write_rows(sliding.OPS, layer, slots, input_pos, k, v)  # ring slots input_pos % W of each row, after the read
        return keys, values, mask
    _write_rows(full.OPS, layer, slots, input_pos, k, v)  # row slots[r], slots input_pos[r]
    if scales is not None:
        keys, values = int8.read_rows(layer.k, layer.v, scales, k.dtype, slots, key_pos)  # [R, H_kv, L, D]
    else:
        keys, values = full.OPS.read_rows(layer.k, layer.v, slots, key_pos)  # [R, H_kv, L, D]
    return keys, values, None


def _write_rows(kind: KindOps, layer: LayerState, slots: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    if layer.scales is None:
        kind.write_rows(layer.k, layer.v, slots, input_pos, k, v)
    else:
        int8.write_rows(kind, layer.k, layer.v, layer.scales, slots, input_pos, k, v)


def _write(kind: KindOps, layer: LayerState, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if layer.scales is None:
        kind.write(layer.k, layer.v, input_pos, k, v)
    else:
        int8.write(kind, layer.k, layer.v, layer.scales, input_pos, k, v)
