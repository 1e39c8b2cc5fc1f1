"""HFDecoder: any supported HF causal LM as a Decoder (contract: ``spec/decoder.py``).

``HFDecoder`` adapts a HuggingFace causal LM: it hands the model a ``StaticCache`` whose tensors are
the state buffers and whose write offset is ``input_pos[0]``; HF's causal mask (by position) hides
every slot at or beyond the current position, so stale slots after ``rewind`` are never read.
``hf_cache_spec`` declares the cache of any such config, sliding-window layers (``layer_types``) as
SLIDING rings of ``window`` slots; HFDecoder itself runs full-attention caches only and refuses the rings
(LlamaDecoder runs them).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from kvtrace._errors import UnsupportedError
from kvtrace.cache import full
from kvtrace.cache import hf as hfc
from kvtrace.cache.kinds import kind_of
from kvtrace.models.registry import Family
from kvtrace.spec import config as hfconfig
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

__all__ = ["FAMILY", "HFDecoder", "hf_cache_spec"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3")


def hf_cache_spec(config: Any, *, max_seq_len: int, batch_size: int, dtype: torch.dtype) -> CacheSpec:
    """Derive the CacheSpec of an HF decoder config, one layer per ``layer_types`` entry: a
    ``sliding_attention`` layer whose window is shorter than max_seq_len is a SLIDING ring of ``window``
    slots; every other layer (and a window >= max_seq_len, which changes nothing) is FULL."""
    cfg = hfconfig.text_config(config)
    hfconfig.check_max_seq_len(cfg, max_seq_len)
    window = hfconfig.sliding_window(cfg)
    n_kv, head_dim = hfconfig.kv_heads(cfg), hfconfig.head_dim(cfg)
    every = LayerSpec(LayerKind.FULL, n_kv, head_dim, max_seq_len)
    sliding = window is not None and window < max_seq_len
    ring = LayerSpec(LayerKind.SLIDING, n_kv, head_dim, window, window=window) if sliding else every
    types = hfconfig.layer_types(cfg)
    return CacheSpec(
        layers=tuple(ring if t == hfconfig.SLIDING_ATTENTION else every for t in types),
        batch_size=batch_size,
        max_seq_len=max_seq_len,
        dtype=str(dtype).removeprefix("torch."),
    )


class HFDecoder(torch.nn.Module):
    """An HF causal LM as a Decoder over a declared static cache."""

    last_logits = False  # True on a program's copy (ProgramSpec.logits == "last"): HF's logits_to_keep=1

    def __init__(self, model: torch.nn.Module, *, max_seq_len: int, batch_size: int = 1):
        super().__init__()
        from transformers import StaticCache

        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedError(
                f"model type {cfg.model_type!r} is not supported for export; supported: {SUPPORTED_MODEL_TYPES}"
            )
        dtype = next(model.parameters()).dtype
        self.model = model
        self.cache_spec = hf_cache_spec(cfg, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype)
        window = hfconfig.sliding_window(cfg)
        if any(kind_of(layer) is not full.OPS for layer in self.cache_spec.layers):
            raise UnsupportedError(
                f"{cfg.model_type} uses a sliding window of {window} < max_seq_len {max_seq_len}; the general HF "
                f"decoder runs full-attention caches only. Export with --max-seq-len <= {window}."
            )
        self._cache_kw = hfc.cache_kwarg_name(model)
        # A structural template; its tensors are replaced by the state inputs on every call.
        template = StaticCache(config=cfg, max_cache_len=max_seq_len)
        n_kv, head_dim = self.cache_spec.layers[0].n_kv_heads, self.cache_spec.layers[0].head_dim
        probe = torch.empty(batch_size, n_kv, 0, head_dim, dtype=dtype)  # [B, H_kv, 0, D]
        for layer in template.layers:
            layer.lazy_initialization(probe, probe)
            layer.keys = layer.values = None  # drop the template's own allocation
        self._template = template

    def _cache(self, state: tuple[torch.Tensor, ...], start: torch.Tensor) -> Any:
        cache = copy.copy(self._template)
        cache.layers = []
        for i, proto in enumerate(self._template.layers):
            layer = copy.copy(proto)
            layer.keys, layer.values = state[2 * i], state[2 * i + 1]  # [B, H_kv, S, D], written in place
            layer.cumulative_length = start.clone()  # HF writes at arange(T) + this
            cache.layers.append(layer)
        return cache

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        cache = self._cache(state, input_pos[0])
        out = self.model(
            input_ids=tokens,  # [B, T]
            position_ids=input_pos.unsqueeze(0).expand(tokens.shape[0], -1),  # [B, T]
            use_cache=True,
            return_dict=True,
            **({"logits_to_keep": 1} if self.last_logits else {}),
            **{self._cache_kw: cache},
        )
        return out.logits  # [B, T or 1, V]


def supports(config: Any) -> bool:
    return config.model_type in SUPPORTED_MODEL_TYPES


def _build(model: torch.nn.Module, *, max_seq_len: int, batch_size: int, image_tokens: int | None = None) -> HFDecoder:
    return HFDecoder(model, max_seq_len=max_seq_len, batch_size=batch_size)


# The general decoder: HF's own forward over a StaticCache; asked last.
FAMILY = Family("hf", SUPPORTED_MODEL_TYPES, supports, _build, priority=90)
