"""What kvtrace's decoders share at their edge: the two entry points and which programs to export.

Every decoder here (LlamaDecoder, GemmaDecoder, HFDecoder) implements ``_run(tokens, input_pos, key_pos,
state)`` and gets from ``Step``::

    forward(tokens [B, T], input_pos [T], *state)                -> logits   full layers attend to all S slots
    forward_live(tokens [B, T], input_pos [T], key_pos [L], *state) -> logits   ... to the live prefix 0 .. L-1
    forward_slots(tokens [R, T], input_pos [R, T], key_pos [L], slots [R], *state) -> logits [R, T, V]
        rows ``slots`` of the cache only, each at its own positions (``ProgramSpec.slots``: one conversation
        per row, for ``kvtrace serve``); full layers read the live prefix, rings their own rows
        (``cache.attend.update_rows``); a decoder says whether its ``_run`` takes ``slots`` (``slots_refusal``)

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

__all__ = ["LIVE_PROGRAMS", "MIN_LIVE_PREFIX", "SLOT_KINDS", "SLOT_PROGRAMS", "Step", "programs_for", "ring_layers", "slot_programs"]

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


# The cache kinds a slots program reads and writes per row (``write_rows``); int8 K/V on either.
SLOT_KINDS = (full.OPS, sliding.OPS)


def slot_programs(decoder: nn.Module) -> tuple[ProgramSpec, ...]:
    """SLOT_PROGRAMS for ``decoder``, or UnsupportedError naming what it lacks: a ``_run`` that takes
    ``slots`` (``Step.slots_refusal`` is None), full and sliding layers only (K/V in the model's dtype or
    int8), no extra state, >= MIN_LIVE_PREFIX slots."""
    spec: CacheSpec = decoder.cache_spec
    why = []
    refusal = (decoder.slots_refusal() if isinstance(decoder, Step)
               else f"{type(decoder).__name__} does not run per-row positions")
    if refusal:
        why.append(refusal)
    kinds = sorted({layer.kind.value for layer in spec.layers if kind_of(layer) not in SLOT_KINDS})
    if kinds:
        why.append(f"its cache has {'/'.join(kinds)} layers (slot programs hold full and sliding layers)")
    if spec.extra:
        why.append(f"its cache has shared state {[b.name for b in spec.extra]} (slot programs hold per-row state only)")
    if spec.max_seq_len < MIN_LIVE_PREFIX:
        why.append(f"max_seq_len {spec.max_seq_len} < {MIN_LIVE_PREFIX}")
    if why:
        raise UnsupportedError(f"cannot export conversation slots (batched serving) for this model: {'; '.join(why)}. "
                               "Serve it one conversation at a time (an artifact exported without slots, --parallel 1)")
    return SLOT_PROGRAMS


class Step(nn.Module):
    """The entry points of a decoder over ``_run``."""

    def slots_refusal(self) -> str | None:
        """Why this decoder cannot run slot programs (one clause), None when its ``_run`` takes ``slots``."""
        return f"{type(self).__name__} does not run per-row positions"

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
        why = self.slots_refusal()
        if why:
            raise UnsupportedError(f"cannot run slot programs: {why} (see slot_programs)")
        return self._run(tokens, input_pos, key_pos, state, slots=slots)

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor | None,
             state: tuple[torch.Tensor, ...], slots: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError
