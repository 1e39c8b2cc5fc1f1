"""What kvtrace's decoders share at their edge: the two entry points and which programs to export.

Every decoder here (LlamaDecoder, GemmaDecoder, HFDecoder) implements ``_run(tokens, input_pos, key_pos,
state)`` and gets from ``Step``::

    forward(tokens [B, T], input_pos [T], *state)                -> logits   full layers attend to all S slots
    forward_live(tokens [B, T], input_pos [T], key_pos [L], *state) -> logits   ... to the live prefix 0 .. L-1
    forward_slots(tokens [R, T], input_pos [R, T], key_pos [L], slots [R], *state) -> logits [R, T, V]
        rows ``slots`` of the cache only, each at its own positions (``ProgramSpec.slots``: one conversation
        per row, for ``kvtrace serve``); decoders whose ``_run`` takes ``slots`` say so (``runs_slots``)

``programs_for(spec)`` picks the programs to export: the live-prefix ones (``ProgramSpec.key_pos``) when
some layer reads a prefix that can be shorter than its buffer, else the plain ones (a cache of rings only,
or one too small to be worth it). ``slot_programs(decoder)``: the slot programs, or why the decoder cannot.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtrace._errors import UnsupportedError
from kvtrace.cache import full, sliding
from kvtrace.cache.kinds import kind_of
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.program import DEFAULT_PROGRAMS, ProgramSpec

__all__ = ["LIVE_PROGRAMS", "MIN_LIVE_PREFIX", "SLOT_PROGRAMS", "Step", "programs_for", "ring_layers", "slot_programs"]

# Caches this small attend to every slot: nothing to save, and export needs example lengths L > T >= 2.
MIN_LIVE_PREFIX = 8
LIVE_PROGRAMS = (ProgramSpec("prefill", method="forward_live", key_pos=True),
                 ProgramSpec("decode", method="forward_live", single_token=True, key_pos=True))


# One conversation per cache row (kvtrace serve): prefill one slot (R = 1), decode every active slot (R rows).
SLOT_PROGRAMS = (ProgramSpec("prefill", method="forward_slots", key_pos=True, slots=True),
                 ProgramSpec("decode", method="forward_slots", single_token=True, key_pos=True, slots=True))


def ring_layers(spec: CacheSpec) -> tuple[bool, ...]:
    """Per layer: True for a sliding ring (attention over the ring plus the call's keys)."""
    return tuple(kind_of(layer) is sliding.OPS for layer in spec.layers)


def programs_for(spec: CacheSpec) -> tuple[ProgramSpec, ...]:
    """LIVE_PROGRAMS when some layer reads a live prefix (a full layer of >= MIN_LIVE_PREFIX slots), else
    DEFAULT_PROGRAMS."""
    live = spec.max_seq_len >= MIN_LIVE_PREFIX and not all(ring_layers(spec))
    return LIVE_PROGRAMS if live else DEFAULT_PROGRAMS


def slot_programs(decoder: nn.Module) -> tuple[ProgramSpec, ...]:
    """SLOT_PROGRAMS for ``decoder``, or UnsupportedError naming what it lacks: a ``_run`` that takes
    ``slots`` (``runs_slots``), full-attention layers only, K/V in the model's dtype, >= MIN_LIVE_PREFIX slots."""
    spec: CacheSpec = decoder.cache_spec
    name = type(decoder).__name__
    why = []
    if not getattr(type(decoder), "runs_slots", False):
        why.append(f"{name} does not run per-row positions yet (LlamaDecoder, the llama family, does)")
    kinds = sorted({layer.kind.value for layer in spec.layers if kind_of(layer) is not full.OPS})
    if kinds:
        why.append(f"its cache has {'/'.join(kinds)} layers (slot programs write full-attention layers only)")
    if spec.kv_dtype is not None:
        why.append(f"its cache holds {spec.kv_dtype} K/V (slot programs hold K/V in the model's dtype)")
    if spec.max_seq_len < MIN_LIVE_PREFIX:
        why.append(f"max_seq_len {spec.max_seq_len} < {MIN_LIVE_PREFIX}")
    if why:
        raise UnsupportedError(f"cannot export conversation slots (batched serving) for this model: {'; '.join(why)}. "
                               "Serve it one conversation at a time (an artifact exported without slots, --parallel 1)")
    return SLOT_PROGRAMS


class Step(nn.Module):
    """The entry points of a decoder over ``_run``."""

    runs_slots = False  # True where ``_run`` takes ``slots`` (forward_slots)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        """Full layers attend over all max_seq_len cache slots (stale ones masked by position)."""
        return self._run(tokens, input_pos, None, state)

    def forward_live(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor,
                     *state: torch.Tensor) -> torch.Tensor:
        """Full layers attend over cache slots ``key_pos = 0 .. L-1`` only (L = the position after this call)."""
        return self._run(tokens, input_pos, key_pos, state)

    def forward_slots(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor, slots: torch.Tensor,
                      *state: torch.Tensor) -> torch.Tensor:
        """Rows ``slots [R]`` of the cache, row r at positions ``input_pos[r]`` (tokens [R, T], input_pos [R, T]);
        full layers attend over slots ``key_pos = 0 .. L-1`` (L: the longest row's end), masked per row."""
        if not self.runs_slots:
            raise UnsupportedError(f"{type(self).__name__} does not run slot programs (see slot_programs)")
        return self._run(tokens, input_pos, key_pos, state, slots=slots)

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor | None,
             state: tuple[torch.Tensor, ...], slots: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError
