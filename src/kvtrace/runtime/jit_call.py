"""kvtrace.jit's prologue: one HF-style call read into a frozen ``CallKey`` and a ``_Call``, validated.

What changes a captured graph goes into the key (which kwargs, which cache kind and layer pattern, dtypes,
batch, size classes of T and P, and with sliding-window layers the side of the window the call is on:
``sliding_regime``); lengths and positions never do. ``arg_shapes`` / ``program_args`` lay the
call out as a program's arguments: the inputs (``_SEQ_DIM`` order, then the cross-attention inputs),
then the cache state the program takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtrace._errors import CacheOverflowError, UnsupportedError, UsageError
from kvtrace.cache import hf as hfc
from kvtrace.cache.hf import CacheKind
from kvtrace.runtime.jit_cross import _check_cross_inputs, _image_tokens, _unmasked_cross

# Tensor inputs a call may carry, in program-signature order, with their sequence dimension.
_SEQ_DIM = {"input_ids": 1, "inputs_embeds": 1, "attention_mask": 1, "position_ids": -1, "cache_position": 0}
_FLAGS = ("use_cache", "return_dict", "logits_to_keep")


@dataclass(frozen=True)
class CallKey:
    """What changes a captured graph. Sequence length, past length and positions are *not* here."""

    cache: CacheKind
    inputs: tuple[str, ...]  # names of the tensor inputs present, in signature order
    dtypes: tuple[str, ...]  # their dtypes, then the cache dtype
    batch: int
    device: str
    model_dtype: str
    static_len: int | None  # StaticCache max_cache_len of its full layers (a static shape), else None
    logits_to_keep: int
    layers: tuple[str, ...] = ()  # per model layer: "self", "cross-filled" or "cross-empty" (the kinds' hf_label)
    # Cross layers attending without a cross_attention_mask: HF's sdpa path is then a different graph for one
    # new token (it attends every image token) and for more (is_causal=True). "one-token" (a program with
    # T fixed at 1) or "causal"; "" when a mask is given or no cross layer runs.
    unmasked_cross: str = ""
    # Size classes of (T new tokens, P past tokens): min(size, 2). torch.export treats 0 and 1 as their own
    # graphs (it specialises them and traces every other size as >= 2 *without recording a guard*), so a
    # program traced at T >= 2 could take another branch of ``if T == 1:`` than eager does, unseen by any
    # contract. Keyed here, a program only ever runs sizes of the class it was traced with: decode (T = 1)
    # and extend (T >= 2 on a filled cache) are two programs; within a class lengths stay symbolic.
    sizes: tuple[int, int] = (2, 2)
    # Per model layer, the window of a sliding-window cache layer (DynamicSlidingWindowLayer, or a StaticCache's
    # StaticSlidingWindowLayer: its max_cache_len), 0 for others; () when the cache has none. The window is
    # graph structure (the mask, the stored tail).
    windows: tuple[int, ...] = ()
    # Which side of each window the call is on (``sliding_regime``; "" without sliding layers): HF's sliding
    # code branches on it, so a program holds for one regime, symbolic in every length within it.
    regime: str = ""


# Regimes of a call of T new tokens on a cache with a sliding-window layer of window W that has seen P tokens.
# DynamicCache (``DynamicSlidingWindowLayer``) stores the tail S = min(P, W - 1). HF's code branches on two
# things: ``update`` keeps ``cat(tail, new)[-W + 1:]`` (torch.export guards on S + T against W - 1: shorter,
# exactly W - 1 (the slice is the whole, contiguous tensor) or longer), and ``get_mask_sizes`` on ``P >= W``
# (``is_full``: the mask offset P - W + 1). Below the window S = P, so S + T = P + T:
#
#   filling   P + T <  W - 1       new tail P + T (symbolic), P symbolic
#   reaching  P + T == W - 1       new tail W - 1; T = W - 1 - P (one symbol for both)
#   crossing  P < W <= P + T       new tail W - 1 (static), held tail S = P symbolic
#   full      P >= W               held and new tail W - 1 (static), P symbolic (the carrier [0, P])
#
# A fresh cache (P = 0) is filling, reaching or crossing by T. Each (regime x size class) that a call reaches
# is one program (a key); a decode that crosses the window meets filling (P <= W - 3), reaching (P = W - 2),
# crossing (P = W - 1) and full (P >= W): four decode programs, then none for the rest of the generation.
#
# StaticCache (``StaticSlidingWindowLayer``) holds a static [B, H_kv, W, D] and branches on its Python int P
# (``cumulative_length_int``): ``P >= W`` (full: one token rolls the window left, more are appended and the
# last W kept), ``P + T > W`` (crossing: P past tokens and the T new ones, the last W kept; P = 0 its own
# branch, told apart by P's size class) or neither (written in place at P .. P + T - 1, the mask W long:
# padded with an attention_mask shorter than W, so filling and reaching differ):
#
#   filling   P + T < W    reaching   P + T == W    crossing   P < W < P + T    full   P >= W
SLIDING_REGIMES = ("filling", "reaching", "crossing", "full")


def _regime_of(t_len: int, past: int, window: int, static: bool) -> str:
    if past >= window:
        return "full"
    n = past + t_len  # S + T, as S = P below the window
    if static:
        return "filling" if n < window else "reaching" if n == window else "crossing"
    return "filling" if n < window - 1 else "reaching" if n == window - 1 else "crossing"


def sliding_regime(t_len: int, past: int, windows: tuple[int, ...], static: bool = False) -> str:
    """``CallKey.regime``: the regime (``SLIDING_REGIMES``) of each distinct window, in increasing window
    order, comma-separated; "" when no layer slides. ``static``: the windows of a StaticCache's layers."""
    return ",".join(_regime_of(t_len, past, w, static) for w in sorted({w for w in windows if w}))


def key_regime(key: CallKey, t_len: int, past: int) -> str:
    """The regime a call of ``t_len`` tokens at past length ``past`` would have under ``key``'s cache."""
    return sliding_regime(t_len, past, key.windows, key.cache.static)


def size_classes(t_len: int, past: int, kind: CacheKind, windows: tuple[int, ...] = ()) -> tuple[int, int]:
    """``CallKey.sizes``: (min(T, 2), min(P, 2)); P is 2 where it is no tensor size (a StaticCache without
    sliding layers, no cache)."""
    sized_past = kind.dynamic or (kind.static and any(windows))
    return min(t_len, 2), min(past, 2) if sized_past else 2


@dataclass
class _Call:
    """The prologue's reading of one call."""

    key: CallKey
    tensors: list[torch.Tensor]  # the caller's input tensors, in key.inputs order
    cache: Any  # the caller's cache object (or one we created, as eager would)
    return_dict: bool
    past_len: int
    weights: tuple[int, ...]  # which tensors the model computes with (see _weights)
    cross_len: int = 0  # N_c: image tokens the cache's cross-attention layers hold (0: none)


def _held(key: CallKey) -> tuple[int, ...]:
    """Cache layers whose K/V the program takes, after the inputs."""
    return hfc.held_layers(key.cache, key.layers)


def _written(key: CallKey) -> tuple[int, ...]:
    """Cache layers whose K/V the program returns, after the logits."""
    return hfc.written_layers(key.cache, key.layers, "cross_attention_states" in key.inputs)


def _carries_past(key: CallKey) -> bool:
    """The program takes P as the size of a ``[0, P]`` tensor after the cache state: a filled DynamicCache with
    sliding-window layers, whose stored tail no longer tells P once P >= W (``hfc.build_dynamic``'s ``past``),
    and a StaticCache with sliding-window layers, whose code branches on P as a Python int
    (``hfc.build_static``'s ``past``)."""
    return (key.cache.filled or key.cache.static) and any(key.windows)


def read_call(jm: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
    """The prologue: a JittedModel ``jm``'s reading of one call (``CallKey``, tensors, cache), validated."""
    if "cache" in kwargs and "past_key_values" in kwargs:
        raise UsageError("pass the cache as `cache=` or `past_key_values=`, not both")
    kwargs = dict(kwargs)  # never modify the caller's dict
    alias = "past_key_values" if jm._cache_kw == "cache" else "cache"
    if alias in kwargs:  # accept both spellings (transformers 4.x and 5.x)
        kwargs[jm._cache_kw] = kwargs.pop(alias)
    try:
        bound = jm._signature.bind(*args, **kwargs).arguments
    except TypeError as e:
        raise UsageError(f"{type(jm.model).__name__}.forward does not take these arguments: {e}") from e
    extra = bound.pop("kwargs", {}) or {}
    bound.update(extra)
    supported = (*_SEQ_DIM, *jm._cross_inputs, *_FLAGS)
    unknown = sorted(k for k, v in bound.items() if v is not None and k not in (*supported, jm._cache_kw)
                     and not (k in ("output_attentions", "output_hidden_states") and v is False))
    if unknown:
        raise UnsupportedError(
            f"kvtrace.jit does not support the argument(s) {unknown}; supported: "
            f"{sorted((*supported, 'past_key_values'))}"
        )
    if (bound.get("input_ids") is None) == (bound.get("inputs_embeds") is None):
        raise UsageError("pass exactly one of input_ids or inputs_embeds")
    cfg = jm.model.config
    use_cache = bound.get("use_cache")
    use_cache = getattr(cfg, "use_cache", True) if use_cache is None else bool(use_cache)
    return_dict = bound.get("return_dict")
    return_dict = getattr(cfg, "use_return_dict", getattr(cfg, "return_dict", True)) if return_dict is None else return_dict
    cache = bound.get(jm._cache_kw)
    if cache is None and use_cache:
        cache = hfc.new_dynamic_cache(cfg)  # what eager does
    if cache is not None and not use_cache:
        raise UnsupportedError("a cache together with use_cache=False is not supported; drop one of them")
    kind = hfc.classify(cache, jm._cross)
    layers = hfc.layer_pattern(cache, jm._n_layers, jm._cross)
    windows = (hfc.windows(cache, jm._n_layers) if kind.dynamic else hfc.static_windows(cache) if kind.static
               else ())
    windows = windows if any(windows) else ()

    names = tuple(n for n in (*_SEQ_DIM, *jm._cross_inputs) if bound.get(n) is not None)
    tensors = [bound[n] for n in names]
    for n, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    main = tensors[0]  # input_ids [B, T] or inputs_embeds [B, T, H]
    batch, t_len = main.shape[0], main.shape[1]
    if t_len < 1:
        raise UsageError(f"{names[0]} has 0 tokens; expected at least 1")
    past = 0
    cross_len = 0
    static_len = None
    cache_dtype = ""
    if kind.dynamic:
        _check_dynamic_layers(jm, cache, kind)
        held = hfc.held_layers(kind, layers)
        for i in held:
            k = cache.layers[i].keys  # [B, H_kv, P, D] (self) or [B, H_kv, N_c, D] (cross)
            if k.shape[0] != batch:
                raise UsageError(f"cache holds batch {k.shape[0]} but the inputs have batch {batch}")
        if held:
            cache_dtype = str(cache.layers[held[0]].keys.dtype)
        past = next((hfc.past_length(cache.layers[i]) for i in held
                     if hfc.length_of(layers[i]) in (hfc.PAST, hfc.TAIL)), 0)
        cross_len = next((cache.layers[i].keys.shape[-2] for i in held if hfc.length_of(layers[i]) == hfc.IMAGE), 0)
    elif kind.static:
        static_len = hfc.static_max_len(cache)
        layer0 = cache.layers[0]
        cache_dtype = str(next(jm.model.parameters()).dtype)  # what HF's lazy init will allocate
        if layer0.is_initialized:
            past = hfc.static_past(cache)  # host-side reads, outside any trace
            cache_dtype = str(layer0.keys.dtype)
            if layer0.keys.shape[0] != batch:
                raise UsageError(f"cache holds batch {layer0.keys.shape[0]} but the inputs have batch {batch}")
            if not all(t.is_contiguous() for t in hfc.static_state(cache)):
                raise UnsupportedError("a StaticCache holding non-contiguous tensors is not supported")
        if static_len is not None and past + t_len > static_len:
            raise CacheOverflowError(
                f"StaticCache holds {static_len} positions; {past} are used and the call adds {t_len} "
                f"({past + t_len} > {static_len}). Create the cache with a larger max_cache_len."
            )
    mask = bound.get("attention_mask")
    if mask is not None and not kind.static and mask.shape[-1] != past + t_len:
        raise UsageError(
            f"attention_mask covers {mask.shape[-1]} positions, expected past + new = {past} + {t_len} = {past + t_len}"
        )
    keep = bound.get("logits_to_keep") or 0
    if not isinstance(keep, int):
        raise UnsupportedError("logits_to_keep must be an int for kvtrace.jit")
    given = dict(zip(names, tensors, strict=True))
    image = _image_tokens(given, cross_len)
    _check_cross_inputs(given, batch, t_len, _hidden_size(jm.model), image)
    model_dtype, weights = jm._weights()
    key = CallKey(
        cache=kind,
        inputs=names,
        dtypes=(*(str(t.dtype) for t in tensors), cache_dtype),
        batch=batch,
        device=str(main.device),
        model_dtype=model_dtype,
        static_len=static_len,
        logits_to_keep=keep,
        layers=layers,
        unmasked_cross=_unmasked_cross(given, image, t_len),
        sizes=size_classes(t_len, past, kind, windows),
        windows=windows,
        regime=sliding_regime(t_len, past, windows, kind.static),
    )
    return _Call(key=key, tensors=tensors, cache=cache, return_dict=bool(return_dict), past_len=past,
                 weights=weights, cross_len=cross_len)


def _check_dynamic_layers(jm: Any, cache: Any, kind: CacheKind) -> None:
    """A filled DynamicCache has a layer per model layer; only trailing cross layers may not exist yet
    (eager creates layers lazily and skips cross layers without image tokens)."""
    n = len(cache.layers)
    missing = [i for i in range(n, jm._n_layers) if i not in jm._cross]
    if kind.filled and (n > jm._n_layers or missing):
        raise UsageError(f"cache has {n} layers, the model has {jm._n_layers}")


def _hidden_size(model: torch.nn.Module) -> int:
    cfg = model.config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return int(cfg.hidden_size)


def arg_shapes(call: _Call, n_layers: int, n_kv: int, head_dim: int) -> list[torch.Size]:
    """The shapes of the program's arguments (``_program_args``' order), without touching the cache.

    An uninitialized StaticCache gets the shapes HF's lazy init will allocate: [B, H_kv, S_max, D] and 0-d.
    """
    shapes = [t.shape for t in call.tensors]
    if call.key.cache.dynamic:
        for i in _held(call.key):
            layer = call.cache.layers[i]
            shapes += [layer.keys.shape, layer.values.shape]
        if _carries_past(call.key):
            shapes.append(torch.Size((0, call.past_len)))
    elif call.key.cache.static:
        if call.cache.layers[0].is_initialized:
            shapes += [t.shape for t in hfc.static_state(call.cache)]
        else:
            for s in static_slots(call.key, n_layers):
                kv = torch.Size((call.key.batch, n_kv, s, head_dim))
                shapes += [kv, kv, torch.Size(())]
        if _carries_past(call.key):
            shapes.append(torch.Size((0, call.past_len)))
    return shapes


def static_slots(key: CallKey, n_layers: int) -> list[int]:
    """S of each layer of a StaticCache key: the window of a sliding layer, else max_cache_len."""
    windows = key.windows or (0,) * n_layers
    return [w or int(key.static_len or 0) for w in windows]


def arg_names(key: CallKey, n_layers: int) -> list[str]:
    """One description per program argument, for messages."""
    names = list(key.inputs)
    if key.cache.dynamic:
        names += [f"cache layer {i} {kv}" for i in _held(key) for kv in ("keys", "values")]
        if _carries_past(key):
            names.append("past length (cumulative_length of the sliding-window layers)")
    elif key.cache.static:
        names += [f"cache layer {i} {t}" for i in range(n_layers)
                  for t in ("keys", "values", "cumulative_length")]
        if _carries_past(key):
            names.append("past length (cumulative_length_int of the sliding-window layers)")
    return names


def cache_dtype(call: _Call) -> torch.dtype:
    """The dtype of the call's cache state, as the key holds it (``CallKey.dtypes[-1]``): an initialized
    StaticCache's own, else what HF's lazy init will allocate. Examples and lazy init both use it."""
    return getattr(torch, call.key.dtypes[-1].removeprefix("torch."))


def program_args(call: _Call) -> list[torch.Tensor]:
    """Inputs, then cache state, laid out as at capture: contiguous (a no-op when they already are).

    A sliced position_ids or a cropped DynamicCache is a strided view; compiled kernels would read it
    with the example's strides. StaticCache state is mutated in place, so it goes as is (the
    prologue checked it is contiguous).
    """
    args = [t.contiguous() for t in call.tensors]
    if call.key.cache.dynamic:
        args += [t.contiguous() for t in hfc.dynamic_state(call.cache, _held(call.key))]
        if _carries_past(call.key):
            args.append(past_carrier(call.past_len, call.tensors[0].device))
    elif call.key.cache.static:
        args += hfc.static_state(call.cache)
        if _carries_past(call.key):
            args.append(past_carrier(call.past_len, call.tensors[0].device))
    return args


def past_carrier(past: int, device: torch.device | str) -> torch.Tensor:
    """P as a tensor size: ``[0, P]`` int8, no elements (see ``_carries_past``)."""
    return torch.empty((0, past), dtype=torch.int8, device=device)
