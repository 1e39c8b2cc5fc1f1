"""A fused cache-attention implementation a backend may substitute while it captures a program.

Decoders whose full self-attention layers all go through ``llama.cached_attention`` say so with a class
attribute ``fused_attention = True`` (LlamaDecoder, MllamaDecoder). While ``substituted(fn)`` is active
(during one capture, e.g. ExecuTorch's, whose runtime has its own fused KV-cache write + SDPA kernels),
such a layer calls::

    fn(q [B, H, T, D], k [B, H_kv, T, D], v [B, H_kv, T, D], input_pos [T],
       k_cache [B, H_kv, S, D], v_cache [B, H_kv, S, D], scale) -> [B, H, T, D] or None

instead of writing the cache at ``input_pos`` and attending itself: ``fn`` writes k, v into the cache and
attends over the live prefix (positions ``0 .. input_pos[-1]``, causal). None: ``fn`` does not serve this
cache (e.g. a buffer it did not lay out), and the layer runs its own code. Outside ``substituted`` nothing
changes (``attention`` returns None at the cost of one ContextVar read).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["Attention", "attention", "substituted"]

Attention = Callable[..., "torch.Tensor | None"]
_ACTIVE: ContextVar[Attention | None] = ContextVar("kvtrace_fused_attention", default=None)


@contextmanager
def substituted(fn: Attention) -> Iterator[None]:
    """Layers of a ``fused_attention`` decoder call ``fn`` inside this block (one capture)."""
    token = _ACTIVE.set(fn)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, scale: float | None) -> torch.Tensor | None:
    """The substituted attention's output, or None when none is active (or it declines this cache)."""
    fn = _ACTIVE.get()
    return None if fn is None else fn(q, k, v, input_pos, k_cache, v_cache, scale)
