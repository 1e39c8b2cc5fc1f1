"""HFDecoder: any HF decoder-only causal LM as a Decoder (contract: ``spec/decoder.py``), asked last.

``HFDecoder`` runs the HF model's own modules, so every family quirk stays HF's (q/k norms, logit
soft-capping, scaled embeddings, per-layer-type RoPE, partial rotary, multipliers, length-dependent RoPE
such as Phi-3's longrope). What it swaps in (``hf_attention``): the ``cache`` of each call is a
``KvCache`` over the state buffers, written exactly as each layer's kind says (FULL at input_pos, SLIDING
rings at input_pos % window), and attention is kvtrace's function registered with transformers'
``AttentionInterface``, masking by position::

    forward(tokens [B, T], input_pos [T], k0, v0, ...) -> logits [B, T, V]
    forward_live(tokens, input_pos, key_pos [L], k0, v0, ...)   full layers read slots [0, L) only
    forward_slots(tokens [R, T], input_pos [R, T], key_pos [L], slots [R], k0, ...)   rows ``slots`` only,
        each at its own ``position_ids`` (``kvtrace serve``; refused for a length-dependent RoPE)
    k_i, v_i: [B, H_kv, S, D]; S = max_seq_len (FULL) or window (SLIDING)

The caller's model is never touched: HFDecoder holds a *view* of it (``_share``: new module objects, the
same parameter and buffer tensors) whose config is a copy naming ``"kvtrace"`` as ``_attn_implementation``.

``refusal(config)`` says why a config cannot go this way (None when it can): encoder-decoder models,
cross-attention layers, ``layer_types`` outside ``full_attention`` / ``sliding_attention`` (chunked,
linear/mamba, ...), bidirectional attention, a model class whose attention bypasses the interface.
``hf_cache_spec`` declares the cache of any such config, sliding layers as rings of ``window`` slots.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from typing import Any

import torch

from kvtrace._errors import UnsupportedError
from kvtrace.cache import full, sliding
from kvtrace.cache.kinds import kind_of
from kvtrace.models import hf_attention
from kvtrace.models.registry import Family
from kvtrace.models.step import Step, programs_for
from kvtrace.spec import config as hfconfig
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

__all__ = ["FAMILY", "LAYER_TYPES", "HFDecoder", "hf_cache_spec", "refusal"]

LAYER_TYPES = (hfconfig.FULL_ATTENTION, hfconfig.SLIDING_ATTENTION)  # the HF layer types kvtrace holds


def _layer_type_refusal(cfg: Any) -> str | None:
    types = hfconfig.layer_types(cfg)
    odd = {t: [i for i, x in enumerate(types) if x == t] for t in types if t not in LAYER_TYPES}
    if not odd:
        return None
    what = ", ".join(f"{t!r} (layers {idx})" for t, idx in odd.items())
    return f"its layer_types hold {what}, a cache kind kvtrace does not declare (it holds {list(LAYER_TYPES)})"


def hf_cache_spec(config: Any, *, max_seq_len: int, batch_size: int, dtype: torch.dtype) -> CacheSpec:
    """Derive the CacheSpec of an HF decoder config, one layer per ``layer_types`` entry: a
    ``sliding_attention`` layer whose window is shorter than max_seq_len is a SLIDING ring of ``window``
    slots; a ``full_attention`` layer (and a window >= max_seq_len, which changes nothing) is FULL; any other
    layer type is refused (UnsupportedError naming it)."""
    cfg = hfconfig.text_config(config)
    hfconfig.check_max_seq_len(cfg, max_seq_len)
    odd = _layer_type_refusal(cfg)
    if odd:
        raise UnsupportedError(f"model type {cfg.model_type!r} cannot be exported: {odd}")
    window = hfconfig.sliding_window(cfg)
    n_kv, head_dim = hfconfig.kv_heads(cfg), hfconfig.head_dim(cfg)
    every = LayerSpec(LayerKind.FULL, n_kv, head_dim, max_seq_len)
    sliding_layers = window is not None and window < max_seq_len
    ring = LayerSpec(LayerKind.SLIDING, n_kv, head_dim, window, window=window) if sliding_layers else every
    types = hfconfig.layer_types(cfg)
    return CacheSpec(
        layers=tuple(ring if t == hfconfig.SLIDING_ATTENTION else every for t in types),
        batch_size=batch_size,
        max_seq_len=max_seq_len,
        dtype=str(dtype).removeprefix("torch."),
    )


def _model_class(config: Any) -> type | None:
    """The transformers causal-LM class of ``config.model_type``, or None when transformers names none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return getattr(transformers, name, None) if isinstance(name, str) else None


def _class_refusal(cls: type) -> str | None:
    if not getattr(cls, "_supports_attention_backend", False):
        return (f"{cls.__name__}'s attention does not go through transformers' attention interface "
                "(_supports_attention_backend is False), so kvtrace cannot hold its cache")
    return None


def refusal(config: Any) -> str | None:
    """Why the general HF decoder cannot export ``config`` (one clause), or None when it can."""
    cfg = hfconfig.text_config(config)
    if getattr(config, "is_encoder_decoder", False) or getattr(cfg, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; kvtrace exports decoder-only causal LMs"
    if getattr(cfg, "cross_attention_layers", None):
        return f"its layers {list(cfg.cross_attention_layers)} cross-attend (vision decoders need their own family)"
    odd = _layer_type_refusal(cfg)
    if odd:
        return odd
    if getattr(cfg, "use_bidirectional_attention", False):
        return "it attends bidirectionally (use_bidirectional_attention); kvtrace's caches are causal"
    cls = _model_class(cfg)
    return _class_refusal(cls) if cls is not None else None


def supports(config: Any) -> bool:
    return refusal(config) is None


def _share(module: torch.nn.Module, configs: dict[int, Any], memo: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """A new module tree over the same parameter/buffer tensors: every module object is new (so attributes a
    trace sets, e.g. longrope's ``long_inv_freq``, land on the view), dict attributes are copied, and every
    attribute that is one of the original configs (``configs``: id -> its copy) is that copy."""
    if id(module) in memo:
        return memo[id(module)]
    new = copy.copy(module)  # a new object with a shallow copy of __dict__
    memo[id(module)] = new
    d = new.__dict__
    for key, val in list(d.items()):
        if id(val) in configs:
            d[key] = configs[id(val)]
        elif type(val) in (dict, OrderedDict):  # _parameters, _buffers, hooks: the view's own
            d[key] = type(val)(val)
    d["_modules"] = {k: None if m is None else _share(m, configs, memo) for k, m in module._modules.items()}
    return new


def _config_copies(config: Any) -> tuple[Any, dict[int, Any]]:
    """A deep copy of ``config`` using kvtrace's attention, and id(original (sub)config) -> its copy."""
    mine = copy.deepcopy(config)
    mine._attn_implementation = hf_attention.IMPLEMENTATION  # recurses into the sub-configs
    pairs = {id(config): mine}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            pairs[id(sub)] = getattr(mine, key)
    return mine, pairs


class HFDecoder(Step):
    """An HF decoder-only causal LM as a Decoder over a declared cache of full and sliding layers."""

    last_logits = False  # True on a program's copy (ProgramSpec.logits == "last"): HF's logits_to_keep=1

    def __init__(self, model: torch.nn.Module, *, max_seq_len: int, batch_size: int = 1, kv_dtype: str | None = None):
        super().__init__()
        from kvtrace.cache.hf import cache_kwarg_name

        cfg = model.config
        why = refusal(cfg) or _class_refusal(type(model))
        if why:
            raise UnsupportedError(f"model type {cfg.model_type!r} cannot be exported: {why}")
        dtype = next(model.parameters()).dtype
        spec = hf_cache_spec(cfg, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype)
        self.cache_spec = dataclasses.replace(spec, kv_dtype=kv_dtype)  # int8: read and written by cache.attend
        for i, layer in enumerate(self.cache_spec.layers):
            if kind_of(layer) not in (full.OPS, sliding.OPS):
                raise UnsupportedError(f"layer {i}: the general HF decoder runs full and sliding cache layers, "
                                       f"not {layer.kind.value!r}")
        hf_attention.register()
        _, configs = _config_copies(cfg)
        self.model = _share(model, configs, {})  # the caller's tensors, kvtrace's config: see the module docstring
        self._cache_kw = cache_kwarg_name(model)
        self.programs = programs_for(self.cache_spec)

    def slots_refusal(self) -> str | None:
        """HF's modules run each row at its own ``position_ids``, except a length-dependent RoPE (dynamic,
        longrope), which HF switches on the batch's longest position: one row's length would change another's."""
        rope = _length_dependent_rope(self.model.config)
        if rope:
            return (f"its RoPE ({rope!r}) depends on the sequence length, which HF's modules take from the whole "
                    "batch, so one conversation's length would change another's answer")
        return None

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor | None,
             state: tuple[torch.Tensor, ...], slots: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T], input_pos [T]; or (``slots [R]``, a slots program) tokens [R, T], input_pos [R, T]."""
        cache = hf_attention.KvCache(self.cache_spec, state, input_pos, key_pos, slots)
        positions = input_pos if slots is not None else input_pos.unsqueeze(0).expand(tokens.shape[0], -1)
        with hf_attention.active(cache):
            out = self.model(
                input_ids=tokens,  # [B, T]
                position_ids=positions,  # [B, T]: each row its own with slots
                use_cache=True,
                return_dict=True,
                **({"logits_to_keep": 1} if self.last_logits else {}),
                **{self._cache_kw: cache},
            )
        cache.check()
        return out.logits  # [B, T or 1, V]


def _length_dependent_rope(config: Any) -> str | None:
    """The first length-dependent RoPE type (``LENGTH_DEPENDENT_ROPE``) the config's text model uses, else None;
    per-layer-type parameters (Gemma 3's ``{layer_type: {...}}``) are each looked at."""
    from kvtrace.models.llama_args import LENGTH_DEPENDENT_ROPE

    cfg = hfconfig.text_config(config)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    found = [hfconfig.rope_type(cfg)]
    if isinstance(params, dict):
        found += [str(p.get("rope_type", p.get("type", "default"))) for p in params.values() if isinstance(p, dict)]
    return next((t for t in found if t in LENGTH_DEPENDENT_ROPE), None)


def _build(model: torch.nn.Module, *, max_seq_len: int, batch_size: int, image_tokens: int | None = None,
           kv_dtype: str | None = None) -> HFDecoder:
    return HFDecoder(model, max_seq_len=max_seq_len, batch_size=batch_size, kv_dtype=kv_dtype)


# The general decoder: HF's own modules over kvtrace's cache and attention, any decoder-only family; asked last.
# Offers int8 KV caches.
FAMILY = Family("hf", ("any decoder-only causal LM",), supports, _build, priority=90, refusal=refusal,
                kv_dtypes=("int8",))
