"""What kvtrace's decoders share at their edge: the two entry points and which programs to export.

Every decoder here (LlamaDecoder, GemmaDecoder, HFDecoder) implements ``_run(tokens, input_pos, key_pos,
state)`` and gets from ``Step``::

    forward(tokens [B, T], input_pos [T], *state)                -> logits   full layers attend to all S slots
    forward_live(tokens [B, T], input_pos [T], key_pos [L], *state) -> logits   ... to the live prefix 0 .. L-1

``programs_for(spec)`` picks the programs to export: the live-prefix ones (``ProgramSpec.key_pos``) when
some layer reads a prefix that can be shorter than its buffer, else the plain ones (a cache of rings only,
or one too small to be worth it).
"""

from __future__ import annotations

import torch
from torch import nn

from kvtrace.cache import sliding
from kvtrace.cache.kinds import kind_of
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.program import DEFAULT_PROGRAMS, ProgramSpec

__all__ = ["LIVE_PROGRAMS", "MIN_LIVE_PREFIX", "Step", "programs_for", "ring_layers"]

# Caches this small attend to every slot: nothing to save, and export needs example lengths L > T >= 2.
MIN_LIVE_PREFIX = 8
LIVE_PROGRAMS = (ProgramSpec("prefill", method="forward_live", key_pos=True),
                 ProgramSpec("decode", method="forward_live", single_token=True, key_pos=True))


def ring_layers(spec: CacheSpec) -> tuple[bool, ...]:
    """Per layer: True for a sliding ring (attention over the ring plus the call's keys)."""
    return tuple(kind_of(layer) is sliding.OPS for layer in spec.layers)


def programs_for(spec: CacheSpec) -> tuple[ProgramSpec, ...]:
    """LIVE_PROGRAMS when some layer reads a live prefix (a full layer of >= MIN_LIVE_PREFIX slots), else
    DEFAULT_PROGRAMS."""
    live = spec.max_seq_len >= MIN_LIVE_PREFIX and not all(ring_layers(spec))
    return LIVE_PROGRAMS if live else DEFAULT_PROGRAMS


class Step(nn.Module):
    """The two entry points of a decoder over ``_run``."""

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        """Full layers attend over all max_seq_len cache slots (stale ones masked by position)."""
        return self._run(tokens, input_pos, None, state)

    def forward_live(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor,
                     *state: torch.Tensor) -> torch.Tensor:
        """Full layers attend over cache slots ``key_pos = 0 .. L-1`` only (L = the position after this call)."""
        return self._run(tokens, input_pos, key_pos, state)

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor | None,
             state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError
