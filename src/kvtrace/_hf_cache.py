"""HF cache objects <-> flat lists of tensors. The only module that knows HF cache internals.

A captured program never sees an HF cache object from the caller. It sees tensors:

* DynamicCache state: ``[k0, v0, k1, v1, ...]``, each ``[B, H_kv, P, D]`` (P = past length,
  symbolic). Inside the trace a *new* DynamicCache is built around those tensors; the program
  returns the grown tensors ``[B, H_kv, P + T, D]`` and the epilogue stores them in the caller's object.
* StaticCache state: ``[k0, v0, n0, k1, v1, n1, ...]`` with k/v ``[B, H_kv, S_max, D]`` and ``n`` the
  0-d int64 ``cumulative_length``. The program mutates them in place (declared input mutations),
  exactly as eager StaticCache does.
"""

from __future__ import annotations

import copy
import enum
import inspect
from typing import Any

import torch

from kvtrace._errors import UnsupportedError, UsageError

SUPPORTED = (
    "transformers.DynamicCache with full-attention layers (fresh or filled), "
    "transformers.StaticCache with full-attention layers, or no cache (use_cache=True creates a DynamicCache)"
)


class CacheKind(enum.StrEnum):
    NONE = "none"  # use_cache=False: stateless forward
    DYNAMIC_FRESH = "dynamic-fresh"  # DynamicCache with nothing in it yet
    DYNAMIC = "dynamic"  # DynamicCache holding P >= 1 past tokens
    STATIC = "static"  # StaticCache (initialized or not)


def cache_kwarg_name(model: torch.nn.Module) -> str:
    """transformers 5.x calls the argument ``cache``; 4.x called it ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def classify(cache: Any) -> CacheKind:
    """Which kind of cache the caller passed; a clear error for anything unsupported."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache, StaticLayer

    if cache is None:
        return CacheKind.NONE
    if type(cache) is DynamicCache:
        if getattr(cache, "offloading", False):
            raise UnsupportedError(f"an offloading DynamicCache is not supported; kvtrace supports {SUPPORTED}")
        bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer]
        if bad:
            raise UnsupportedError(
                f"DynamicCache with layer types {sorted(set(bad))} is not supported (e.g. sliding-window); "
                f"kvtrace supports {SUPPORTED}. Pass fallback='eager' to run such calls uncompiled."
            )
        filled = [layer.is_initialized for layer in cache.layers]
        if not any(filled):
            return CacheKind.DYNAMIC_FRESH
        if not all(filled):
            raise UsageError(
                f"DynamicCache is partly filled: {sum(filled)} of {len(filled)} layers hold tensors; "
                "expected all or none. Pass a fresh DynamicCache() or the one returned by the previous call."
            )
        lengths = {layer.keys.shape[-2] for layer in cache.layers}
        if len(lengths) != 1:
            raise UsageError(f"DynamicCache layers hold different lengths {sorted(lengths)}; expected one length")
        return CacheKind.DYNAMIC
    if type(cache) is StaticCache:
        bad = [type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer]
        if bad:
            raise UnsupportedError(
                f"StaticCache with layer types {sorted(set(bad))} is not supported (e.g. sliding-window); "
                f"kvtrace supports {SUPPORTED}. Pass fallback='eager' to run such calls uncompiled."
            )
        return CacheKind.STATIC
    raise UnsupportedError(f"cache of type {type(cache).__name__} is not supported; kvtrace supports {SUPPORTED}")


def new_dynamic_cache(config: Any) -> Any:
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config)


# --- DynamicCache -------------------------------------------------------------------------------
def dynamic_state(cache: Any) -> list[torch.Tensor]:
    """Caller's filled DynamicCache -> [k0, v0, k1, v1, ...] (the caller's own tensors, not copies)."""
    out: list[torch.Tensor] = []
    for layer in cache.layers:
        out += [layer.keys, layer.values]
    return out


def build_dynamic(state: list[torch.Tensor] | None, n_layers: int) -> Any:
    """Inside the trace: a new DynamicCache around ``state`` (no copy), or an empty one."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = []
    for i in range(n_layers):
        layer = DynamicLayer()
        if state is not None:
            k, v = state[2 * i], state[2 * i + 1]  # [B, H_kv, P, D]
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        layers.append(layer)
    cache = DynamicCache()
    cache.layers = layers
    cache.layer_class_to_replicate = None
    return cache


def write_back_dynamic(cache: Any, new_state: list[torch.Tensor]) -> None:
    """Epilogue: the caller's DynamicCache now holds what eager would (grown tensors, same object)."""
    n = len(new_state) // 2
    for i in range(n):
        k, v = new_state[2 * i], new_state[2 * i + 1]  # [B, H_kv, P + T, D]
        if i < len(cache.layers) and cache.layers[i].is_initialized:
            cache.layers[i].keys, cache.layers[i].values = k, v
        else:
            cache.update(k, v, i)  # fresh layer: HF's own lazy init (one copy, at prefill only)


# --- StaticCache --------------------------------------------------------------------------------
def static_max_len(cache: Any) -> int:
    return int(cache.layers[0].max_cache_len)


def ensure_static_initialized(cache: Any, batch: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                              device: torch.device) -> None:
    """Run HF's own lazy initialization on layers that have none yet (what eager does on first use)."""
    for layer in cache.layers:
        if not layer.is_initialized:
            probe = torch.empty(batch, n_kv_heads, 0, head_dim, dtype=dtype, device=device)
            layer.lazy_initialization(probe, probe)


def static_state(cache: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for layer in cache.layers:
        out += [layer.keys, layer.values, layer.cumulative_length]
    return out


def static_template(cache: Any) -> Any:
    """A structural copy of the caller's StaticCache whose tensors are replaced inside the trace."""
    tmpl = copy.copy(cache)
    tmpl.layers = [copy.copy(layer) for layer in cache.layers]
    return tmpl


def build_static(template: Any, state: list[torch.Tensor]) -> Any:
    cache = copy.copy(template)
    cache.layers = []
    for i, proto in enumerate(template.layers):
        layer = copy.copy(proto)
        layer.keys, layer.values, layer.cumulative_length = state[3 * i : 3 * i + 3]
        layer.is_initialized = True
        cache.layers.append(layer)
    return cache


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(n_layers, n_kv_heads, head_dim) of a decoder config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return cfg.num_hidden_layers, n_kv, head_dim


def output_class(model: torch.nn.Module) -> type:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast


def make_output(model: torch.nn.Module, logits: torch.Tensor, cache: Any, return_dict: bool) -> Any:
    cls = output_class(model)
    field = "cache" if "cache" in getattr(cls, "__dataclass_fields__", {}) else "past_key_values"
    out = cls(logits=logits, **{field: cache})
    return out if return_dict else out.to_tuple()
