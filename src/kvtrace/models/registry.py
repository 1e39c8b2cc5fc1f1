"""Model families: which Decoder adapts an HF model, asked in priority order.

A family is a predicate on the HF config plus a builder of its Decoder (``spec.decoder``)::

    Family(name, model_types, supports(config) -> bool,
           build(model, *, max_seq_len, batch_size, image_tokens) -> Decoder, priority, vision,
           refusal(config) -> str | None: why it says no, named in the error when no family does, kv_dtypes)

``quant``: its Decoder owns its weights (copied from the HF model), so quantized weights
(``models.quant``) can replace its linear layers without touching the caller's model.

``kv_dtypes``: the quantized caches (``CacheSpec.kv_dtype``, e.g. ``"int8"``) its builder takes as
``build(..., kv_dtype=...)``; ``make_decoder`` refuses any other for that family (UnsupportedError).

``make_decoder`` asks every family, lowest ``priority`` first (ties: registration order), and builds
the first one whose ``supports`` accepts the config. Built-in families are each module's ``FAMILY``,
listed in ``BUILTIN`` (imported on first use, so importing this module imports no family); others
are added with ``register`` and removed with ``unregister``. Adding a family: one module defining its
Decoder and ``FAMILY``, plus its module name in ``BUILTIN``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

import torch

from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.spec.decoder import Decoder

__all__ = ["BUILTIN", "Family", "families", "family_for", "make_decoder", "register", "unregister"]

# Built-in family modules, each defining FAMILY.
BUILTIN = ("kvtrace.models.mllama", "kvtrace.models.llama", "kvtrace.models.gemma", "kvtrace.models.hf_generic")


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # what it covers, for error messages (``supports`` decides)
    supports: Callable[[Any], bool]  # HF config (model.config) -> True when this family adapts it
    build: Callable[..., Decoder]  # build(model, *, max_seq_len, batch_size, image_tokens) -> Decoder
    priority: int = 50  # lower is asked first: specialised decoders before general ones
    vision: bool = False  # takes image_tokens (cross-attention over image features)
    refusal: Callable[[Any], str | None] | None = None  # why ``supports`` says no (one clause), for the error
    kv_dtypes: tuple[str, ...] = ()  # quantized caches build(..., kv_dtype=) accepts, e.g. ("int8",)
    quant: bool = False  # its Decoder owns its weights, so ``models.quant.quantize_decoder`` may rewrite it


_registered: list[Family] = []
_builtin: list[Family] = []


def _builtins() -> list[Family]:
    if not _builtin:
        _builtin.extend([import_module(m).FAMILY for m in BUILTIN])  # all or none
    return _builtin


def families() -> tuple[Family, ...]:
    """Every family, in the order ``make_decoder`` asks them."""
    return tuple(sorted([*_builtins(), *_registered], key=lambda f: f.priority))


def register(family: Family) -> None:
    """Add a family; its name must be new."""
    if any(f.name == family.name for f in families()):
        raise UsageError(f"a model family named {family.name!r} is already registered; "
                         f"unregister it first or pick another name")
    _registered.append(family)


def unregister(name: str) -> None:
    """Remove a family added with ``register`` (built-in families stay)."""
    found = [f for f in _registered if f.name == name]
    if not found:
        raise UsageError(f"no registered model family named {name!r}; registered: {[f.name for f in _registered]}")
    _registered.remove(found[0])


def family_for(config: Any) -> Family:
    """The first family (in ``families()`` order) that supports ``config``; UnsupportedError if none does."""
    ordered = families()
    for f in ordered:
        if f.supports(config):
            return f
    reasons = "; ".join(dict.fromkeys(r for f in ordered if f.refusal and (r := f.refusal(config))))
    covered = tuple(dict.fromkeys(t for f in ordered for t in f.model_types))
    raise UnsupportedError(f"model type {config.model_type!r} is not supported for export: "
                           f"{reasons or f'no family adapts it (families cover {covered})'}")


def make_decoder(model: torch.nn.Module, *, max_seq_len: int, batch_size: int = 1,
                 image_tokens: int | None = None, kv_dtype: str | None = None) -> Decoder:
    """The Decoder to export for an HF model, built by the first family that supports its config;
    ``kv_dtype`` (e.g. ``"int8"``) asks for a quantized cache, None for K/V in the model's dtype."""
    family = family_for(model.config)
    if image_tokens is not None and not family.vision:
        raise UsageError(f"image_tokens applies to vision decoders (MllamaForCausalLM); "
                         f"{model.config.model_type!r} is a text-only model, so leave it unset")
    if kv_dtype is None:
        return family.build(model, max_seq_len=max_seq_len, batch_size=batch_size, image_tokens=image_tokens)
    if kv_dtype not in family.kv_dtypes:
        takes = sorted({f.name for f in families() if kv_dtype in f.kv_dtypes})
        raise UnsupportedError(
            f"the {family.name} decoder ({model.config.model_type!r}) does not run kv_dtype={kv_dtype!r} caches; "
            f"{kv_dtype} caches are offered by the {', '.join(takes) or 'no'} decoder(s). Export without kv_dtype")
    return family.build(model, max_seq_len=max_seq_len, batch_size=batch_size, image_tokens=image_tokens,
                        kv_dtype=kv_dtype)
