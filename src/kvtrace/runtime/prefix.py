"""Prefix reuse: how much of a cache that holds the K/V of ``held`` tokens a new ``prompt`` may keep.

Attention is causal, so the K/V at a position depend only on the tokens at and before it: the positions of
the longest common prefix of ``held`` and ``prompt`` already hold what prefilling ``prompt`` would write
there. Keeping them means rewinding the cache from ``len(held)`` to that prefix (the positions after it are
masked by position until they are written again) and prefilling only the rest of the prompt.

Two limits apply (``reusable``):
- at least one prompt token is prefilled, whose logits start the answer (at most ``len(prompt) - 1`` kept);
- every layer must still hold what the kept prefix reads after the rewind (``KindOps.max_rewind``: any
  rewind for full-attention layers; a sliding-window ring past its window only 0 or 1 token, since the
  positions the new tokens read were overwritten) — else nothing is kept;
- a cache with extra state shared by its layers (``CacheSpec.extra``: the vision decoder's cross-attention
  flags) keeps nothing, as ``Session.rewind`` refuses it.

Used by ``Conversation`` (a chat's turns, through ``Session.rewind``) and ``SlotEngine`` (a new request in a
free slot that held an earlier conversation: ``kvtrace serve``'s prefix cache).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtrace.cache.kinds import kind_of
from kvtrace.spec.cache import CacheSpec

__all__ = ["common_prefix", "reusable"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter one bounds it
        if x != y:
            break
        n += 1
    return n


def reusable(spec: CacheSpec, held: Sequence[int], prompt: Sequence[int]) -> int:
    """How many positions of a cache holding ``held`` (its tokens, position ``len(held)``) to keep for ``prompt``:
    their common prefix, at most ``len(prompt) - 1``, or 0 where a layer of ``spec`` cannot rewind that far."""
    keep = min(common_prefix(held, prompt), len(prompt) - 1)
    if keep <= 0 or spec.extra:
        return 0
    drop = len(held) - keep
    if drop and any(drop > kind_of(layer).max_rewind(layer, len(held)) for layer in spec.layers):
        return 0
    return keep
