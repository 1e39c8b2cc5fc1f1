"""Decoder: the uniform, functional view of a model that export captures.

Contract of every Decoder (an ``nn.Module`` with a ``cache_spec`` attribute)::

    forward(tokens: LongTensor[B, T], input_pos: LongTensor[T], *state) -> logits[B, T, V]

``state`` is the cache, exactly ``cache_spec.buffers()`` in order (k0, v0, k1, v1, ..., extras),
and is updated in place at ``input_pos``. ``input_pos`` holds absolute positions; the caller (a
Session) advances it in one visible place. Nothing here calls ``.item()``.

``HFDecoder`` adapts a HuggingFace causal LM: it hands the model a ``StaticCache`` whose tensors are
the state buffers and whose write offset is ``input_pos[0]``; HF's causal mask (by position) hides
every slot at or beyond the current position, so stale slots after ``rewind`` are never read.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.cache import hf as hfc
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

__all__ = ["HFDecoder", "hf_cache_spec", "make_decoder"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3")


def hf_cache_spec(config: Any, *, max_seq_len: int, batch_size: int, dtype: torch.dtype) -> CacheSpec:
    """Derive the CacheSpec of an HF decoder config (full-attention layers only, for now)."""
    cfg = config.get_text_config(decoder=True)
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        if cfg.sliding_window < max_seq_len:
            raise UnsupportedError(
                f"{cfg.model_type} uses a sliding window of {cfg.sliding_window} < max_seq_len {max_seq_len}; "
                f"sliding-window caches are not supported yet. Export with --max-seq-len <= {cfg.sliding_window}."
            )
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit and max_seq_len > limit:
        raise UsageError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings {limit}")
    n_layers, n_kv, head_dim = hfc.kv_geometry(cfg)
    layer = LayerSpec(LayerKind.FULL, n_kv, head_dim, max_seq_len)
    return CacheSpec(
        layers=(layer,) * n_layers,
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


def make_decoder(model: torch.nn.Module, *, max_seq_len: int, batch_size: int = 1,
                 image_tokens: int | None = None) -> torch.nn.Module:
    """The Decoder to export for an HF model: MllamaDecoder for the Llama 3.2 Vision text decoder, the
    lean LlamaDecoder for plain Llama-family configs (Llama, SmolLM2, Qwen2, Mistral without sliding
    window), else the general HFDecoder."""
    from kvtrace.models.llama import LlamaDecoder, supports
    from kvtrace.models.mllama import DEFAULT_IMAGE_TOKENS, MllamaDecoder, is_mllama, mllama_cache_spec

    dtype = next(model.parameters()).dtype
    if is_mllama(model.config):
        spec = mllama_cache_spec(model.config, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype,
                                 image_tokens=DEFAULT_IMAGE_TOKENS if image_tokens is None else image_tokens)
        return MllamaDecoder.from_hf(model, spec)
    if image_tokens is not None:
        raise UsageError(f"image_tokens applies to vision decoders (MllamaForCausalLM); "
                         f"{model.config.model_type!r} is a text-only model, so leave it unset")
    if supports(model.config):
        spec = hf_cache_spec(model.config, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype)
        return LlamaDecoder.from_hf(model, spec)
    return HFDecoder(model, max_seq_len=max_seq_len, batch_size=batch_size)
