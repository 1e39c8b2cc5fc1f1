"""HF's own attention modules over kvtrace's declared cache: a per-call cache object and an attention function.

HFDecoder (``hf_generic``) runs the HF model's own modules (every family quirk stays theirs: q/k norms,
soft-capping, per-layer RoPE, partial rotary, multipliers) with two things of kvtrace's swapped in:

* ``KvCache``: the ``cache`` argument of one call. ``update(k, v, layer_idx)`` (what every HF attention
  layer calls) writes the state buffers and returns what the layer's attention reads, as every decoder does
  (``cache.attend.update``: per kind, and int8 caches quantized on write and dequantized on read), recording
  the matching mask (True = visible)::

      FULL     reads the whole cache [B, H_kv, S, D], mask [T, S]
               (or, with key_pos [L], the live prefix [B, H_kv, L, D], mask [T, L])
      SLIDING  reads ring + the call's keys [B, H_kv, W + T, D], mask [T, W + T]

  With ``slots [R]`` (a slots program, input_pos [R, T]) it reads and writes those cache rows only, each at
  its own positions (``cache.attend.update_rows``), and the masks are per row ([R, 1, T, K]).

* ``attention``: registered with transformers' ``AttentionInterface`` as ``"kvtrace"`` (``register``); the
  model's config copy names it as its ``_attn_implementation``, and since no mask function is registered
  under that name, HF builds no masks at all. It applies the mask ``update`` recorded for the layer,
  ``scaling``, ``softcap`` (Gemma 2), attention sinks (``s_aux``, GPT-OSS) and GQA, and returns what HF's
  eager/sdpa attention returns: ``(out [B, T, H, D], None)``.

The attention function finds its call's cache through a context variable set by ``active(cache)`` around
the model's forward; positions are tensors throughout, nothing is read from their values. ``KvCache.check``
raises UnsupportedError when a layer's attention did not go through both (a model whose attention bypasses
transformers' interface, or reads another layer's cache).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from kvtrace._errors import UnsupportedError
from kvtrace.cache import attend, full, sliding
from kvtrace.cache.kinds import kind_of
from kvtrace.spec.cache import CacheSpec

__all__ = ["IMPLEMENTATION", "KvCache", "active", "attention", "register"]

IMPLEMENTATION = "kvtrace"  # the config's _attn_implementation on HFDecoder's copy
_ACTIVE: contextvars.ContextVar[KvCache | None] = contextvars.ContextVar("kvtrace_hf_call", default=None)


class _Layer:
    """What HF code may read of one cache layer: its buffers (``keys``/``values``) and ``is_sliding``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, is_sliding: bool):
        self.keys, self.values, self.is_sliding = keys, values, is_sliding


class KvCache:
    """The cache of one HFDecoder call over ``state`` (``spec.buffers()`` order, written in place)."""

    is_compileable = True

    def __init__(self, spec: CacheSpec, state: tuple[torch.Tensor, ...], input_pos: torch.Tensor,
                 key_pos: torch.Tensor | None = None, slots: torch.Tensor | None = None):
        self.spec, self.state, self.input_pos, self.key_pos = spec, state, input_pos, key_pos
        self.slots = slots  # a slots program's rows [R] (input_pos [R, T]): each row its own conversation
        self._rings = tuple(kind_of(layer) is sliding.OPS for layer in spec.layers)
        self._state = [spec.layer_state(state, i) for i in range(len(spec.layers))]  # k, v (+ int8 scales)
        self.layers = [_Layer(kv.k, kv.v, ring) for kv, ring in zip(self._state, self._rings, strict=True)]
        self.masks: dict[int, torch.Tensor] = {}  # layer -> mask [T, K] of what update returned
        self.attended: set[int] = set()
        self._full_mask: torch.Tensor | None = None
        self._last: int | None = None

    # --- what HF's modeling code calls -----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, H_kv, T, D] of layer ``layer_idx`` at input_pos -> the keys/values its attention reads."""
        if layer_idx in self.masks:
            raise UnsupportedError(f"layer {layer_idx} wrote the cache twice in one call; kvtrace's general HF "
                                   "decoder expects one cache update per attention layer")
        dtype = self.spec.torch_dtype  # the model's: what an int8 cache is read back as, too
        k, v = key_states.to(dtype), value_states.to(dtype)
        self._last = layer_idx
        if self.slots is None:
            keys, values, ring_mask = attend.update(self._state[layer_idx], self._rings[layer_idx], self.input_pos,
                                                    k, v, self.key_pos)  # [B, H_kv, S or L or W + T, D]
        else:
            keys, values, ring_mask = attend.update_rows(self._state[layer_idx], self._rings[layer_idx], self.slots,
                                                         self.input_pos, k, v, self.key_pos)  # [R, H_kv, L or W + T, D]
        self.masks[layer_idx] = self._full() if ring_mask is None else ring_mask  # [T, S or L], or [T, W + T]
        # (a slots program's masks are per row: [R, 1, T, L] or [R, 1, T, W + T])
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        # tokens before this call (HF asks only when it is given no position_ids); a slots program's first row's
        return self.input_pos.reshape(-1)[0]

    @property
    def is_sliding(self) -> list[bool]:
        return list(self._rings)

    def __len__(self) -> int:
        return len(self.layers)

    # --- what kvtrace's attention function asks ------------------------------------------------------
    def _full(self) -> torch.Tensor:
        if self._full_mask is None:
            keys = self.key_pos if self.key_pos is not None else torch.arange(
                self.spec.max_seq_len, device=self.input_pos.device)
            self._full_mask = full.position_mask(keys, self.input_pos)  # [T, S or L]; per row [R, 1, T, L]
        return self._full_mask

    def mask_for(self, module: Any, sliding_window: int | None) -> torch.Tensor:
        """The mask [T, K] of the keys ``update`` returned to ``module``'s layer (its ``layer_idx``)."""
        idx = getattr(module, "layer_idx", None)
        idx = self._last if idx is None else int(idx)
        if idx is None or idx not in self.masks:
            raise UnsupportedError(f"{type(module).__name__} attends without updating its cache layer first; "
                                   "kvtrace's general HF decoder cannot run a layer that reads another layer's cache")
        layer = self.spec.layers[idx]
        window = layer.window if self._rings[idx] else None
        if sliding_window is not None and sliding_window != window and not (
                window is None and sliding_window >= self.spec.max_seq_len):
            raise UnsupportedError(f"layer {idx} ({type(module).__name__}) attends over a sliding window of "
                                   f"{sliding_window}, but its declared cache layer is {layer.kind.value} "
                                   f"(window {window}); the config's layer_types disagree with the model")
        self.attended.add(idx)
        return self.masks[idx]

    def check(self) -> None:
        """UnsupportedError unless every layer was updated once and attended through ``attention``."""
        n = len(self.spec.layers)
        missing = sorted(set(range(n)) - set(self.masks))
        bypassed = sorted(set(self.masks) - self.attended)
        if missing:
            raise UnsupportedError(f"the model did not write cache layer(s) {missing} of {n} through cache.update; "
                                   "its layers are not all self-attention layers kvtrace can hold")
        if bypassed:
            raise UnsupportedError(f"layer(s) {bypassed} attended without transformers' attention interface; "
                                   "kvtrace's general HF decoder needs a model whose attention goes through it")


@contextlib.contextmanager
def active(cache: KvCache) -> Iterator[KvCache]:
    """``attention`` reads masks from ``cache`` for the duration of one model call."""
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, softcap: float | None = None, s_aux: torch.Tensor | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key/value [B, H_kv, K, D] (from ``KvCache.update``) -> (out [B, T, H, D], None)."""
    cache = _ACTIVE.get()
    if cache is None:
        raise UnsupportedError(f"attention implementation {IMPLEMENTATION!r} runs only inside an HFDecoder call")
    if attention_mask is not None:
        raise UnsupportedError(f"{type(module).__name__} was given an attention mask the model built itself; "
                               "kvtrace's general HF decoder masks by position and cannot honour it")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedError(f"{type(module).__name__} attends bidirectionally; kvtrace's caches are causal")
    mask = cache.mask_for(module, sliding_window)  # [T, K], True = visible
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is None and s_aux is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    else:
        out = _explicit(query, key, value, mask, scaling, softcap, s_aux)
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, D]


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
              softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """HF's eager attention with soft-capping and/or sinks: q [B, H, T, D], k/v [B, H_kv, K, D], mask [T, K]
    or per row [B, 1, T, K] -> [B, H, T, D].

    Query head h reads KV head h // G (G = H / H_kv, HF's repeat_kv), computed per group
    (q as [B, H_kv, G, T, D]) so K/V are never copied (reshaping their repeat would also make torch.export
    guard on T through the strides of the ring + new keys concatenation)."""
    b, h, t, d = q.shape
    h_kv = k.shape[1]
    qg = q.reshape(b, h_kv, h // h_kv, t, d)
    if mask.dim() == 4:  # per row (a slots program): [R, 1, T, K] -> [R, 1, 1, T, K] over the groups
        mask = mask[:, :, None]
    w = torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * scaling  # [B, H_kv, G, T, K]
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    w = w.float().masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(w, dim=-1)
    else:  # a per-head sink logit joins the softmax, then is dropped (GPT-OSS)
        sink = sinks.float().reshape(1, h_kv, h // h_kv, 1, 1).expand(b, -1, -1, t, 1)
        p = torch.softmax(torch.cat([w, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p.to(v.dtype), v[:, :, None]).reshape(b, h, t, d)  # [B, H, T, D]


def register() -> None:
    """Make ``"kvtrace"`` a transformers attention implementation (idempotent; no mask function on purpose)."""
    from transformers import AttentionInterface

    if AttentionInterface._global_mapping.get(IMPLEMENTATION) is not attention:
        AttentionInterface.register(IMPLEMENTATION, attention)
