"""Decoder: the uniform, functional view of a model that capture traces and a Session runs.

Every Decoder is an ``nn.Module`` offering::

    cache_spec: CacheSpec                   what its cache is (layers, batch, max_seq_len, dtype, extras)
    forward(tokens: LongTensor[B, T], input_pos: LongTensor[T], *state) -> logits[B, T, V]

``state`` is the cache, exactly ``cache_spec.buffers()`` in order (k0, v0, k1, v1, ..., extras), and
is updated in place at ``input_pos``. ``input_pos`` holds absolute positions; the caller (a Session)
advances it in one visible place. Nothing in a forward calls ``.item()``.

Optional (read by ``spec.program.program_specs`` and ``supports_last_logits`` below):

    programs: tuple[ProgramSpec, ...]      the programs to capture (default: prefill + decode of forward;
                                           a program may name another method, e.g. ``forward_live``)
    last_logits: bool  (class attribute)   when a copy sets it True the head runs on the last position
                                           only (logits [B, 1, V]); having it allows prefill_logits="last"
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from kvtrace.spec.cache import CacheSpec

__all__ = ["Decoder", "is_decoder", "supports_last_logits"]


@runtime_checkable
class Decoder(Protocol):
    """What every decoder module offers (module docstring); ``isinstance`` checks the attributes only."""

    cache_spec: CacheSpec

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        """tokens [B, T], input_pos [T], state = cache_spec.buffers() (written in place) -> logits [B, T, V]."""
        ...


def is_decoder(obj: Any) -> bool:
    """True for an ``nn.Module`` with a ``cache_spec`` (a Decoder, as opposed to an HF model to adapt)."""
    return isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "cache_spec", None), CacheSpec)


def supports_last_logits(decoder: Any) -> bool:
    """True when the Decoder's class declares ``last_logits`` (it can run its head on the last row only)."""
    return hasattr(type(decoder), "last_logits")
