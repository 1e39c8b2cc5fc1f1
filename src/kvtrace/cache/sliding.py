"""LayerKind.SLIDING: self-attention over the last ``window`` positions, held in a ring of ``window`` slots.

    k, v: [B, H_kv, W, D]   W = window; position p lives in slot p % W

A query at position q sees the keys at positions q - W < p <= q: the previous W - 1 tokens and itself
(transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``, on top of the causal mask).

What a slot holds is a function of the position alone, kept in no buffer: before a call starting at
position P, slot s holds position ``P - 1 - ((P - 1 - s) mod W)`` when that is >= 0, and nothing otherwise
(``slot_positions``). That stays true after ``Session.rewind`` as far as it matters: the query at the
rewound-to position P' reads positions P' - W + 1 .. P' - 1 only (the formula's oldest slot, P' - W, is
masked), and rewind is allowed only while those are still in the ring, i.e. none was overwritten by a
position written later (``max_rewind``: position p is overwritten once p + W was written). A call of T
tokens attends over the ring as it was plus its own T keys (``attention_inputs``: ``[B, H_kv, W + T, D]``,
masked by ``visible``), then ``write`` stores them: each slot gets the latest of the call's rows that maps
to it, so a prefill longer than the window keeps its last W tokens (every row is written, duplicates with
the same value: no data-dependent branch, T symbolic).

``valid`` at position P: the last ``min(P, W - 1)`` positions in position order, which is exactly what
transformers' ``DynamicSlidingWindowLayer`` keeps (``[-sliding_window + 1:]``); the ring's one further slot,
position P - W, is never read again (the next query, at P, sees P - W + 1 .. P). verify compares those
slots one for one with eager's layer.

transformers' sliding cache layers (``DynamicSlidingWindowLayer``) get label ``"sliding"``. Under
``kvtrace.jit`` a program takes such a layer's stored tail ``[B, H_kv, S_w, D]`` (S_w = min(P, W - 1), its
own size: ``TAIL``) once the cache holds past tokens, plus the past length P itself (its ``cumulative_length``,
which the tail no longer tells once P >= W), and returns the new tail (last W - 1 of old + new), which is
what eager's ``update`` stores (it attends over old + new and keeps only the tail).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtrace.cache import full
from kvtrace.cache.kinds import TAIL, KindOps
from kvtrace.spec.cache import LayerKind, LayerSpec

__all__ = ["OPS", "SLIDING", "SlidingOps", "attention_inputs", "attention_inputs_rows", "slot_positions", "visible"]

SLIDING = "sliding"  # HF layer-pattern label: a DynamicSlidingWindowLayer


def slot_positions(start: torch.Tensor, window: int) -> torch.Tensor:
    """The position each ring slot holds before a call starting at ``start`` (0-d int64) -> [W] int64,
    negative where the slot holds nothing yet; per row for ``start [R]`` (a slots program) -> [R, W]."""
    last = start - 1 if start.dim() == 0 else start[:, None] - 1  # the rank: a trace-time fact
    # + window keeps the operand >= 0 (last >= -1): ExecuTorch 1.5's remainder kernel truncates negative
    # integers toward zero (remainder(-1, 4) = -1, not 3), and an exported ring must mean the same there
    return last - torch.remainder(last - torch.arange(window, device=start.device) + window, window)


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """query_pos [T], key_pos [K] -> mask [T, K], True where the query sees the key (HF's sliding window);
    per row: [R, T], [R, K] -> [R, T, K]."""
    q, k = query_pos[..., :, None], key_pos[..., None, :]
    return (k >= 0) & (k <= q) & (k > q - window)


def attention_inputs(k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a call's queries attend over, read before ``write``: the ring [B, H_kv, W, D] and the call's own
    k, v [B, H_kv, T, D] -> keys, values [B, H_kv, W + T, D] and mask [T, W + T] (True = visible)."""
    window = k_cache.shape[2]
    key_pos = torch.cat([slot_positions(input_pos[0], window), input_pos])  # [W + T]
    mask = visible(input_pos, key_pos, window)
    return torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2), mask


def attention_inputs_rows(k_ring: torch.Tensor, v_ring: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_inputs`` per row (a slots program): the rows' rings k_ring, v_ring [R, H_kv, W, D] as they
    were, the call's k, v [R, H_kv, T, D] at positions ``input_pos [R, T]`` (each row its own) -> keys, values
    [R, H_kv, W + T, D] and mask [R, 1, T, W + T] (True = visible; broadcast over heads)."""
    window = k_ring.shape[2]
    key_pos = torch.cat([slot_positions(input_pos[:, 0], window), input_pos], dim=1)  # [R, W + T]
    mask = visible(input_pos, key_pos, window)[:, None]  # [R, 1, T, W + T]
    return torch.cat([k_ring, k], dim=2), torch.cat([v_ring, v], dim=2), mask


def _latest(t: int, window: int, device: torch.device) -> torch.Tensor:
    """[T]: for each of a call's T rows, the last row with the same ring slot (r + W * ((T - 1 - r) // W))."""
    r = torch.arange(t, device=device)
    return r + window * torch.div(t - 1 - r, window, rounding_mode="floor")


class SlidingOps(KindOps):
    kind = LayerKind.SLIDING
    written_by_decode = True
    hf_labels = (SLIDING,)

    def max_rewind(self, layer: LayerSpec, position: int) -> int:
        """At position P the ring holds positions P - W .. P - 1; after rewinding n the next query needs
        max(0, P - n - W + 1) .. P - n - 1, still held iff n <= 1 or P <= W (nothing overwritten yet);
        rewinding to 0 needs nothing."""
        return position if position <= layer.window else 1

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v [B, H_kv, T, D] at positions ``input_pos [T]`` into slots ``input_pos % W`` of the ring
        [B, H_kv, W, D]. Row r is replaced by the last row with the same slot (r + W * ((T - 1 - r) // W)),
        so slots written twice (T > W) get one value whatever the order: the last W tokens."""
        window = k_cache.shape[2]
        latest = _latest(k.shape[2], window, input_pos.device)  # [T]
        slots = torch.remainder(input_pos, window)
        k_cache.index_copy_(2, slots, k.index_select(2, latest))
        v_cache.index_copy_(2, slots, v.index_select(2, latest))

    def write_rows(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, input_pos: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
        """``write`` per row (a slots program): k, v [R, H_kv, T, D] into the rings of rows ``slots [R]`` of
        k_cache, v_cache [B, H_kv, W, D], row r at ring slots ``input_pos[r] % W`` ([R, T]), the latest of a
        row's duplicates (T > W) written for every one of them, so the scatter's order does not matter."""
        window = k_cache.shape[2]
        latest = _latest(k.shape[2], window, input_pos.device)  # [T]: the same for every row (T is shared)
        ring = torch.remainder(input_pos, window)  # [R, T]
        full.OPS.write_rows(k_cache, v_cache, slots, ring, k.index_select(2, latest), v.index_select(2, latest))

    def valid(self, k: torch.Tensor, v: torch.Tensor, position: int,
              prefilled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``position - min(position, W - 1) .. position - 1`` in order: [B, H_kv, <= W - 1, D],
        as transformers' DynamicSlidingWindowLayer holds them."""
        window = k.shape[2]
        n = min(position, window - 1)
        slots = torch.arange(position - n, position, device=k.device) % window
        return k.index_select(2, slots), v.index_select(2, slots)

    def hf_label(self, cache: Any, i: int) -> str:
        return SLIDING

    def hf_length(self, label: str) -> str:
        return TAIL


OPS = SlidingOps()
