"""LayerKind.FULL: self-attention over every past token, one slot per position.

    k, v: [B, H_kv, max_seq_len, D]; slot j holds position j once a program wrote it

Written by every program (prefill and decode) at ``input_pos``; slots ``[0, position)`` are valid, the
rest are stale or initial and masked by position, so rewinding only moves the position. A slots program
(``ProgramSpec.slots``: each batch row its own conversation) writes and reads rows ``slots [R]`` only, each
at its own positions (``write_rows`` / ``read_rows``). In a
transformers DynamicCache such a layer holds the P past tokens ``[B, H_kv, P, D]`` (label ``"self"``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtrace.cache.kinds import PAST, KindOps
from kvtrace.spec.cache import LayerKind

__all__ = ["OPS", "SELF", "FullOps", "live", "position_mask"]

SELF = "self"  # HF layer-pattern label: a self-attention layer holding P past tokens (or none yet)


def live(cache: torch.Tensor, key_pos: torch.Tensor | None, view: bool) -> torch.Tensor:
    """Slots ``key_pos [L]`` of ``cache`` [B, H_kv, S, ...] -> [B, H_kv, L, ...], the whole cache when key_pos is
    None. key_pos is the live prefix 0 .. L-1 (the Session's contract, ``ProgramSpec.key_pos``).

    ``view``: the first L slots as a view, no copy; else gathered (a copy of L slots). A view of L of S slots
    is contiguous exactly when L == S, which torch.export turns into the guard L != S unless the program is
    captured size-obliviously (``capture.export._size_oblivious``: one-token programs of decoders whose
    attention is SDPA in ``llama.cached_attention``; with T symbolic, or a matmul reading the view, other
    guards appear). SmolLM2 decode, gather -> view, artifacts alternated (stop 46, 64 tokens after a prompt of
    37 / 300 / 900): Q4_1 110 -> 121 / 118 -> 122 / 33 -> 75 tokens/s, fp32 50.5 -> 52.1 / 45.4 -> 46.0 /
    28.3 -> 41.7 (the gather's copy grew costly with L)."""
    if key_pos is None:
        return cache
    if view:
        return cache[:, :, : key_pos.shape[0]]
    return cache.index_select(2, key_pos)


def position_mask(key_pos: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """What a full layer's queries see: key slot j is visible to query i iff j <= input_pos[i], so stale slots
    past the position stay hidden. key_pos [L] (or all S slots), input_pos [T] -> mask [T, L]; per row (a slots
    program) input_pos [R, T] -> [R, 1, T, L], broadcast over heads. The rank is a trace-time fact."""
    if input_pos.dim() == 1:
        return key_pos[None, :] <= input_pos[:, None]
    return (key_pos[None, None, :] <= input_pos[:, :, None])[:, None]


class FullOps(KindOps):
    kind = LayerKind.FULL
    written_by_decode = True
    hf_labels = (SELF,)

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v [B, H_kv, T, D] into slots ``input_pos [T]`` of k_cache, v_cache [B, H_kv, S, D]."""
        k_cache.index_copy_(2, input_pos, k)
        v_cache.index_copy_(2, input_pos, v)

    def write_rows(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, input_pos: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [R, H_kv, T, D] into rows ``slots [R]`` of k_cache, v_cache [B, H_kv, S, D], row r at its slots
        ``input_pos[r] [T]``: one scatter each, indexed [R, H_kv, T] (broadcast), the head dim kept whole."""
        rows, heads, pos = _row_index(slots, k_cache.shape[1], input_pos)
        k_cache[rows, heads, pos] = k
        v_cache[rows, heads, pos] = v

    def read_rows(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  key_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``slots [R]`` of k_cache, v_cache [B, H_kv, S, D] at cache slots ``key_pos [L]``: one gather each,
        indexed [R, H_kv, L] -> contiguous [R, H_kv, L, D]."""
        rows, heads, keys = _row_index(slots, k_cache.shape[1], key_pos[None, :])
        return k_cache[rows, heads, keys], v_cache[rows, heads, keys]

    def valid(self, k: torch.Tensor, v: torch.Tensor, position: int,
              prefilled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``position`` slots: [B, H_kv, position, D]."""
        return k[:, :, :position], v[:, :, :position]

    def hf_label(self, cache: Any, i: int) -> str:
        return SELF

    def hf_length(self, label: str) -> str:
        return PAST


def _row_index(slots: torch.Tensor, n_heads: int, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Advanced indices over [B, H_kv, S] that broadcast to [R, H_kv, T]: rows [R, 1, 1], heads [1, H_kv, 1],
    positions [R or 1, 1, T] (``pos`` [R or 1, T])."""
    heads = torch.arange(n_heads, device=slots.device)
    return slots[:, None, None], heads[None, :, None], pos[:, None, :]


OPS = FullOps()
