"""The cache-kind protocol: what every ``LayerKind`` says about its own K/V buffers, and the lookup.

One module per kind (``full``, ``cross``, ``sliding``; quantized kinds go the same way) defines a
``KindOps`` subclass and an instance ``OPS``; ``ops(kind)`` finds it. Nothing outside ``spec`` and
``cache`` tests ``layer.kind is LayerKind.X``: it asks the kind.

What a kind answers (``LayerSpec`` ``layer`` of CacheSpec ``spec``; K and V are ``[B, H_kv, S, D]``):
  * (buffers are not a kind's answer: ``CacheSpec.buffers`` is the one listing of every state tensor, a
    layer's S being its ``LayerSpec.max_len``; a kind sharing state across its layers declares it as the
    spec's ``extra`` buffers, e.g. ``cross.extra_buffers``);
  * ``write(k_cache, v_cache, input_pos, k, v)``: how a program stores new K/V (in place);
    ``write_rows(k_cache, v_cache, slots, input_pos, k, v)`` the same per cache row (a slots program: rows
    ``slots [R]``, row r at its own positions ``input_pos[r]``), for the kinds slot programs hold;
  * ``valid(k, v, position, prefilled)``: the slots holding data at ``position`` (what verify compares),
    None when the layer holds nothing yet;
  * ``max_rewind(layer, position)``: how many tokens ``Session.rewind`` may drop at ``position`` (all of them
    for most kinds; a ring only while the rewound-to window is still held); ``written_by_decode``: False
    when only a prefill program (one that runs once, e.g. the image prefill) fills it;
  * the HF mapping: ``hf_label(cache, i)`` (layer ``i`` of a transformers DynamicCache as a layer-pattern
    label), ``hf_held`` / ``hf_written`` (whether a captured program takes / returns that layer) and
    ``hf_length`` (what the layer's S dimension counts: ``PAST`` tokens, ``IMAGE`` tokens, the ``TAIL`` of a
    sliding window, or nothing).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, ClassVar

import torch

from kvtrace._errors import UnsupportedError
from kvtrace.spec.cache import LayerKind, LayerSpec

__all__ = ["IMAGE", "PAST", "TAIL", "KindOps", "kind_of", "ops", "ops_for_label"]

# What a held HF layer's S dimension counts (``KindOps.hf_length``).
PAST = "P"  # past text tokens, one P for every such layer
IMAGE = "N_c"  # cached image tokens, one N_c for every such layer
TAIL = "S_w"  # the last min(P, W - 1) past tokens a sliding-window layer keeps (P itself is its cumulative_length)

# LayerKind -> the module defining its OPS. Adding a kind: one module and one line here.
_MODULES: dict[LayerKind, str] = {
    LayerKind.FULL: "kvtrace.cache.full",
    LayerKind.CROSS: "kvtrace.cache.cross",
    LayerKind.SLIDING: "kvtrace.cache.sliding",
}


class KindOps:
    """One cache kind's semantics. Subclasses set the class attributes and override what differs."""

    kind: ClassVar[LayerKind]
    written_by_decode: ClassVar[bool]  # False: only a prefill program (ProgramSpec.once) writes it
    hf_labels: ClassVar[tuple[str, ...]]  # the layer-pattern labels hf_label returns

    def max_rewind(self, layer: LayerSpec, position: int) -> int:
        """The most tokens ``Session.rewind`` may drop at ``position``: every one, as slots are indexed by
        position and a stale slot is masked until it is written again."""
        return position

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        raise NotImplementedError

    def write_rows(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, input_pos: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError(f"{self.kind.value} cache layers have no per-row write (slot programs)")

    def valid(self, k: torch.Tensor, v: torch.Tensor, position: int,
              prefilled: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise NotImplementedError

    def hf_label(self, cache: Any, i: int) -> str:
        raise NotImplementedError

    def hf_held(self, label: str, has_past: bool) -> bool:
        """Self-attention kinds: a program takes the layer's K/V once the cache holds past tokens (P >= 1)."""
        return has_past

    def hf_written(self, label: str, image: bool) -> bool:
        """Self-attention kinds: every call appends its T tokens, so the program returns the layer's K/V."""
        return True

    def hf_length(self, label: str) -> str | None:
        raise NotImplementedError


@functools.cache
def ops(kind: LayerKind | str) -> KindOps:
    """The semantics of ``kind``; UnsupportedError for a kind no module implements yet."""
    kind = LayerKind(kind)
    name = _MODULES.get(kind)
    if name is None:
        raise UnsupportedError(
            f"cache layer kind {kind.value!r} has no implementation yet (implemented: "
            f"{[k.value for k in _MODULES]}); export the model with full-attention layers"
        )
    return importlib.import_module(name).OPS


def kind_of(layer: LayerSpec) -> KindOps:
    """The semantics of one declared layer."""
    return ops(layer.kind)


@functools.cache
def ops_for_label(label: str) -> KindOps:
    """The kind whose HF layers get layer-pattern label ``label`` (see ``KindOps.hf_label``)."""
    for kind in _MODULES:
        o = ops(kind)
        if label in o.hf_labels:
            return o
    raise UnsupportedError(f"unknown cache layer state {label!r}; expected one of "
                           f"{[s for k in _MODULES for s in ops(k).hf_labels]}")
