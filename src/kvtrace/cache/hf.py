"""HF cache objects <-> flat lists of tensors. The only module that knows HF cache internals.

A captured program never sees an HF cache object from the caller. It sees tensors:

* DynamicCache state: ``[k_i, v_i, ...]`` for the *held* layers ``i`` in layer order (see ``held_layers``):
  every self-attention layer once the cache holds P >= 1 past tokens, each ``[B, H_kv, P, D]`` (P symbolic,
  one P for all of them), and every cross-attention layer that holds image tokens, ``[B, H_kv, N_c, D]``
  (N_c symbolic). Inside the trace a *new* DynamicCache is built around those tensors (the other layers
  stay uninitialized, as in the caller's cache). The program returns the K/V of the layers the call
  *writes* (``written_layers``): self layers grown to ``[B, H_kv, P + T, D]``, and cross layers
  ``[B, H_kv, N_c + N, D]`` only when the call brings new image features (``cross_attention_states``
  ``[B, N, hidden]``); without them cross layers are only read and are not returned. The epilogue stores
  the returned tensors in the caller's object, creating layers the way ``DynamicCache.update`` does.
* The layer pattern (``layer_pattern``): one state per model layer, ``"self"``, ``"cross-filled"``
  (a cross-attention layer holding image tokens) or ``"cross-empty"`` (not initialized, or not even
  created). It is graph structure, part of a program's key; lengths never are. Decoder-only models
  have only ``"self"`` layers, and the state is ``[k0, v0, k1, v1, ...]``.
* Sliding-window layers (``DynamicSlidingWindowLayer``, label ``"sliding"``, see ``kvtrace.cache.sliding``):
  held as their stored tail ``[B, H_kv, S_w, D]`` (S_w = min(P, W - 1), its own size), returned as the new
  tail. When a filled cache has such layers, the state ends with ``past`` ``[0, P]`` (no elements): P, the
  layers' ``cumulative_length``, as a symbolic size (the tail stops telling it once P >= W).
* StaticCache state: ``[k0, v0, n0, k1, v1, n1, ...]`` with k/v ``[B, H_kv, S, D]`` and ``n`` the
  0-d int64 ``cumulative_length``. The program mutates them in place (declared input mutations),
  exactly as eager StaticCache does. S is ``max_cache_len`` for a ``StaticLayer`` and the window W for a
  ``StaticSlidingWindowLayer`` (``static_windows``), which keeps its last W tokens in order and branches on
  a Python int, its ``cumulative_length_int`` = P: with such layers the state ends with ``past`` ``[0, P]``
  (P as a symbolic size, as for DynamicCache above) and the epilogue advances the int
  (``advance_static_sliding``). Not supported for models with cross-attention layers.
"""

from __future__ import annotations

import copy
import enum
import inspect
from collections.abc import Collection, Mapping
from typing import Any

import torch

from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.cache import kinds
from kvtrace.cache.cross import CROSS_EMPTY as CROSS_EMPTY
from kvtrace.cache.cross import CROSS_FILLED as CROSS_FILLED
from kvtrace.cache.cross import check_hf_layers
from kvtrace.cache.full import SELF as SELF
from kvtrace.cache.kinds import IMAGE as IMAGE
from kvtrace.cache.kinds import PAST as PAST
from kvtrace.cache.kinds import TAIL as TAIL
from kvtrace.cache.sliding import SLIDING as SLIDING
from kvtrace.spec import config as hfconfig
from kvtrace.spec.cache import LayerKind

SUPPORTED = (
    "transformers.DynamicCache with full-attention or sliding-window layers (fresh or filled), "
    "transformers.StaticCache with full-attention or sliding-window layers, or no cache (use_cache=True creates a "
    "DynamicCache)"
)


class CacheKind(enum.StrEnum):
    NONE = "none"  # use_cache=False: stateless forward
    DYNAMIC_FRESH = "dynamic-fresh"  # DynamicCache with nothing in it yet
    DYNAMIC = "dynamic"  # DynamicCache holding P >= 1 past tokens
    STATIC = "static"  # StaticCache (initialized or not)

    @property
    def stateful(self) -> bool:
        """The call carries a cache (use_cache=True)."""
        return self is not CacheKind.NONE

    @property
    def dynamic(self) -> bool:
        """A DynamicCache (fresh or filled): the program takes the held layers' K/V and returns the written ones."""
        return self in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH)

    @property
    def static(self) -> bool:
        """A StaticCache: ``[k, v, cumulative_length]`` per layer, mutated in place, S_max a static size."""
        return self is CacheKind.STATIC

    @property
    def fresh(self) -> bool:
        """A DynamicCache holding nothing yet: P = 0 is no tensor size of the program."""
        return self is CacheKind.DYNAMIC_FRESH

    @property
    def filled(self) -> bool:
        """A DynamicCache holding P >= 1 past tokens: P is a symbolic size of the held self layers."""
        return self is CacheKind.DYNAMIC


# Per-layer cache states (a program's layer pattern): SELF (a FULL layer: P past tokens, or none yet),
# CROSS_FILLED / CROSS_EMPTY (a CROSS layer with or without image tokens). Each kind module defines its own.


def cache_kwarg_name(model: torch.nn.Module) -> str:
    """transformers 5.x calls the argument ``cache``; 4.x called it ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cross_layers(config: Any) -> tuple[int, ...]:
    """Indices of the cross-attention layers of a decoder (Mllama's text model); () for decoder-only models."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return tuple(sorted(getattr(cfg, "cross_attention_layers", None) or ()))


def classify(cache: Any, cross: Collection[int] = ()) -> CacheKind:
    """Which kind of cache the caller passed; a clear error for anything unsupported.

    ``cross``: the model's cross-attention layer indices. The kind is decided by the self-attention layers
    (all filled with one length, or none); cross layers may hold image tokens or not (see ``layer_pattern``).
    """
    from transformers.cache_utils import (
        DynamicCache,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        StaticCache,
        StaticLayer,
        StaticSlidingWindowLayer,
    )

    if cache is None:
        return CacheKind.NONE
    if type(cache) is DynamicCache:
        if getattr(cache, "offloading", False):
            raise UnsupportedError(f"an offloading DynamicCache is not supported; kvtrace supports {SUPPORTED}")
        bad = [type(layer).__name__ for layer in cache.layers
               if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)]
        if bad:
            raise UnsupportedError(
                f"DynamicCache with layer types {sorted(set(bad))} is not supported; "
                f"kvtrace supports {SUPPORTED}. Pass fallback='eager' to run such calls uncompiled."
            )
        if any(getattr(layer, "record_past", False) for layer in cache.layers):
            raise UnsupportedError(
                "a DynamicCache whose sliding-window layers record their past (activate_past_recording) is not "
                f"supported; kvtrace supports {SUPPORTED}. Pass fallback='eager' to run such calls uncompiled."
            )
        check_hf_layers(cache, cross)
        what = "self-attention layers" if cross else "layers"
        own = [layer for i, layer in enumerate(cache.layers) if i not in cross]
        filled = [layer.is_initialized for layer in own]
        if not any(filled):
            return CacheKind.DYNAMIC_FRESH
        if not all(filled):
            raise UsageError(
                f"DynamicCache is partly filled: {sum(filled)} of {len(filled)} {what} hold tensors; "
                "expected all or none. Pass a fresh DynamicCache() or the one returned by the previous call."
            )
        lengths = {past_length(layer) for layer in own}
        if len(lengths) != 1:
            raise UsageError(f"DynamicCache {what} hold different lengths {sorted(lengths)}; expected one length")
        (past,) = lengths
        tails = [layer.keys.shape[-2] for layer in own
                 if is_sliding(layer) and layer.keys.shape[-2] != min(past, layer.sliding_window - 1)]
        if tails:
            raise UsageError(f"DynamicCache sliding-window layers hold {tails[0]} tokens of {past}; expected the "
                             "last sliding_window - 1 (as DynamicSlidingWindowLayer.update leaves them)")
        return CacheKind.DYNAMIC
    if type(cache) is StaticCache:
        if cross:
            raise UnsupportedError(
                f"a StaticCache for a model with cross-attention layers {list(cross)} is not supported; pass a "
                "DynamicCache (or no cache). Pass fallback='eager' to run such calls uncompiled."
            )
        bad = [type(layer).__name__ for layer in cache.layers
               if type(layer) not in (StaticLayer, StaticSlidingWindowLayer)]
        if bad:
            raise UnsupportedError(
                f"StaticCache with layer types {sorted(set(bad))} is not supported; "
                f"kvtrace supports {SUPPORTED}. Pass fallback='eager' to run such calls uncompiled."
            )
        if cache.layers[0].is_initialized:
            static_past(cache)  # one past length in every layer, or a UsageError
        return CacheKind.STATIC
    raise UnsupportedError(f"cache of type {type(cache).__name__} is not supported; kvtrace supports {SUPPORTED}")


def is_sliding(layer: Any) -> bool:
    """An HF cache layer keeping only the last ``sliding_window - 1`` tokens (DynamicSlidingWindowLayer)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return type(layer) is DynamicSlidingWindowLayer


def past_length(layer: Any) -> int:
    """P, the past tokens an initialized self-attention layer has seen: a sliding layer's ``cumulative_length``
    (it keeps fewer), else its S."""
    return int(layer.cumulative_length) if is_sliding(layer) else layer.keys.shape[-2]


def windows(cache: Any, n_layers: int) -> tuple[int, ...]:
    """Per model layer, the window of an HF sliding-window cache layer, 0 for any other (or missing) layer."""
    layers = getattr(cache, "layers", None) or ()
    return tuple(int(layers[i].sliding_window) if i < len(layers) and is_sliding(layers[i]) else 0
                 for i in range(n_layers))


def layer_kinds(n_layers: int, cross: Collection[int], cache: Any = None) -> tuple[kinds.KindOps, ...]:
    """The kind of each model layer: CROSS for the cross-attention layers, SLIDING for the cache's sliding-window
    layers, FULL for the others."""
    slide = windows(cache, n_layers)
    return tuple(kinds.ops(LayerKind.CROSS if i in cross else LayerKind.SLIDING if slide[i] else LayerKind.FULL)
                 for i in range(n_layers))


def layer_pattern(cache: Any, n_layers: int, cross: Collection[int]) -> tuple[str, ...]:
    """Per model layer, its kind's label: ``SELF``, ``SLIDING``, ``CROSS_FILLED`` or ``CROSS_EMPTY`` (a layer the
    cache lacks counts as empty)."""
    return tuple(k.hf_label(cache, i) for i, k in enumerate(layer_kinds(n_layers, cross, cache)))


def length_of(label: str) -> str | None:
    """What the S dimension of a held layer with this label counts: ``PAST``, ``IMAGE``, or None (not held)."""
    return kinds.ops_for_label(label).hf_length(label)


def held_layers(kind: CacheKind, pattern: tuple[str, ...]) -> tuple[int, ...]:
    """Layers whose K/V are program inputs: self layers of a filled cache, cross layers holding image tokens."""
    if not kind.dynamic:
        return ()
    return tuple(i for i, s in enumerate(pattern) if kinds.ops_for_label(s).hf_held(s, kind.filled))


def written_layers(kind: CacheKind, pattern: tuple[str, ...], image: bool) -> tuple[int, ...]:
    """Layers whose K/V a program returns: every self layer (it grows by T); cross layers only when the call
    brings new image features (``image``), which eager appends to them; otherwise they are only read."""
    if not kind.dynamic:
        return ()
    return tuple(i for i, s in enumerate(pattern) if kinds.ops_for_label(s).hf_written(s, image))


def new_dynamic_cache(config: Any) -> Any:
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=config)


# --- DynamicCache -------------------------------------------------------------------------------
def dynamic_state(cache: Any, layers: Collection[int] | None = None) -> list[torch.Tensor]:
    """A DynamicCache -> ``[k_i, v_i, ...]`` for ``layers`` (default: all), the cache's own tensors, not copies.

    Used on the caller's cache (the held layers) and, inside the trace, on the new one (the written layers).
    """
    out: list[torch.Tensor] = []
    for i, layer in enumerate(cache.layers):
        if layers is None or i in layers:
            out += [layer.keys, layer.values]  # [B, H_kv, S, D]
    return out


def build_dynamic(state: list[torch.Tensor], n_layers: int, held: Collection[int] = (),
                  window: tuple[int, ...] = (), past: Any = 0) -> Any:
    """Inside the trace: a new DynamicCache of ``n_layers`` layers; the ``held`` ones wrap ``state`` (no copy),
    the others stay uninitialized (a fresh self layer, a cross layer without image tokens).

    ``window``: per layer, the sliding window of a ``DynamicSlidingWindowLayer`` (0: a ``DynamicLayer``);
    ``past``: P (a symbolic size), the ``cumulative_length`` of the held sliding layers.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    pairs = iter(zip(state[0::2], state[1::2], strict=True))
    layers = []
    for i in range(n_layers):
        w = window[i] if i < len(window) else 0
        layer = DynamicSlidingWindowLayer(sliding_window=w) if w else DynamicLayer()
        if i in held:
            k, v = next(pairs)  # [B, H_kv, P, D] (self), [B, H_kv, N_c, D] (cross), [B, H_kv, S_w, D] (sliding)
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            if w:
                layer.cumulative_length = past
        layers.append(layer)
    cache = DynamicCache()
    cache.layers = layers
    cache.layer_class_to_replicate = None
    return cache


def write_back_dynamic(cache: Any, new_state: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Epilogue: the caller's DynamicCache now holds what eager would (new tensors, same object).

    ``new_state``: layer index -> (keys, values) ``[B, H_kv, S, D]`` for the layers the call wrote, and only
    those; the other layers are left as they are (read-only cross layers, skipped ones). A sliding-window
    layer gets its new tail; its ``cumulative_length`` is ``advance_sliding``'s to grow.
    """
    for i in sorted(new_state):
        k, v = new_state[i]
        layer = cache.layers[i] if i < len(cache.layers) else None
        if layer is not None and is_sliding(layer):  # as its update leaves it: the tail (HF's lazy init first)
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        elif layer is not None and layer.is_initialized:
            layer.keys, layer.values = k, v
        else:  # fresh or not yet created: HF's own lazy init and layer creation (one copy, at prefill only)
            cache.update(k, v, i)


def advance_sliding(cache: Any, layers: Collection[int], added: int) -> None:
    """Epilogue, after ``write_back_dynamic``: the written sliding-window ``layers`` have seen ``added`` (T) more
    tokens, as their ``update`` counts them (``cumulative_length``: P + T, while they store only the tail)."""
    for i in layers:
        if i < len(cache.layers) and is_sliding(cache.layers[i]):
            cache.layers[i].cumulative_length += added


# --- StaticCache --------------------------------------------------------------------------------
def is_static_sliding(layer: Any) -> bool:
    """A StaticCache layer keeping only its last ``max_cache_len`` (= the window) tokens."""
    from transformers.cache_utils import StaticSlidingWindowLayer

    return type(layer) is StaticSlidingWindowLayer


def static_windows(cache: Any) -> tuple[int, ...]:
    """Per layer of a StaticCache, the window W a ``StaticSlidingWindowLayer`` holds (its ``max_cache_len``:
    min(sliding_window, the cache's max_cache_len)), 0 for a ``StaticLayer``."""
    return tuple(int(layer.max_cache_len) if is_static_sliding(layer) else 0 for layer in cache.layers)


def static_max_len(cache: Any) -> int | None:
    """Positions the full-attention layers of a StaticCache hold (its max_cache_len); None when every layer
    slides (a window bounds nothing: eager runs past max_cache_len)."""
    full = [int(layer.max_cache_len) for layer in cache.layers if not is_static_sliding(layer)]
    return min(full) if full else None


def static_past(cache: Any) -> int:
    """P, the tokens an initialized StaticCache has seen: its sliding layers' ``cumulative_length_int`` (their
    tensor stops counting once the window is crossed), else the full layers' ``cumulative_length`` (a host read,
    outside any trace). UsageError when the layers disagree."""
    lengths = {layer.cumulative_length_int if is_static_sliding(layer) else int(layer.cumulative_length)
               for layer in cache.layers}
    if len(lengths) != 1:
        raise UsageError(f"StaticCache layers have seen different lengths {sorted(lengths)}; expected one length "
                         "(pass the cache the previous call returned, or a fresh one)")
    return lengths.pop()


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


def build_static(template: Any, state: list[torch.Tensor], past: Any = 0) -> Any:
    """Inside the trace: a copy of ``template`` whose layers hold ``state``; ``past`` (P, a symbolic size) is
    the sliding layers' ``cumulative_length_int``."""
    cache = copy.copy(template)
    cache.layers = []
    for i, proto in enumerate(template.layers):
        layer = copy.copy(proto)
        layer.keys, layer.values, layer.cumulative_length = state[3 * i : 3 * i + 3]
        layer.is_initialized = True
        if is_static_sliding(layer):
            layer.cumulative_length_int = past
        cache.layers.append(layer)
    return cache


def advance_static_sliding(cache: Any, added: int) -> None:
    """Epilogue: the sliding layers of the caller's StaticCache have seen ``added`` (T) more tokens, as their
    ``update`` counts them (the program already wrote their tensors in place)."""
    for layer in cache.layers:
        if is_static_sliding(layer):
            layer.cumulative_length_int += added


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(n_layers, n_kv_heads, head_dim) of a decoder config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = hfconfig.head_dim(cfg)
    return cfg.num_hidden_layers, n_kv, head_dim


def output_class(model: torch.nn.Module) -> type:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast


def make_output(model: torch.nn.Module, logits: torch.Tensor, cache: Any, return_dict: bool) -> Any:
    cls = output_class(model)
    field = "cache" if "cache" in getattr(cls, "__dataclass_fields__", {}) else "past_key_values"
    out = cls(logits=logits, **{field: cache})
    return out if return_dict else out.to_tuple()
