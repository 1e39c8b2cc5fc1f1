"""Runners: what verify compares, each behind one small protocol (``Runner``).

reset, prefill (token ids plus the named inputs of a prompt, e.g. a vision decoder's
``cross_attention_states``), decode, and ``cache()`` — the valid part of every layer's K and V:
``[B, H_kv, P, D]`` for self-attention layers (sliding-window layers: the last min(P, window - 1)
positions, as transformers' DynamicSlidingWindowLayer holds them), ``[B, H_kv, N, D]`` for cross-attention
layers holding N image tokens, None for a layer that holds nothing (a cross-attention layer in a text-only
run, as eager leaves it). An int8 cache's layers are compared dequantized (values times their scales, so a
wrong or stale scale shows). ``EagerRunner`` (the HF model, the reference), ``JitRunner`` (the same calls through
``kvtrace.jit``), ``SessionRunner`` (an artifact Session), ``DecoderRunner`` (a kvtrace Decoder run eagerly in a
Session over its own CacheSpec state: the reference of an int8-cache artifact, same decoder, same quantized
cache), ``Unavailable`` (a candidate that could not be built); ``Prompt`` (token ids and named prefill inputs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvtrace.cache.hf import cache_kwarg_name
from kvtrace.spec import config as hfconfig

__all__ = ["DecoderRunner", "EagerRunner", "JitRunner", "LayerKV", "Prompt", "Runner", "SessionRunner", "Unavailable"]

LayerKV = tuple[torch.Tensor, torch.Tensor] | None  # (K, V) of one layer; None: the layer holds nothing


@dataclass(frozen=True)
class Prompt:
    """Token ids ``[B, T]`` (or ``[T]``) and the named prefill inputs that go with them (e.g. an image)."""

    tokens: Any
    inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)


class Runner(Protocol):
    name: str

    def reset(self) -> None: ...
    def prefill(self, tokens: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor: ...  # [B, T] -> [B, T, V]
    def decode(self, token: torch.Tensor) -> torch.Tensor: ...  # [B, 1] -> [B, 1, V]
    def cache(self) -> list[LayerKV]: ...  # per layer ([B,H,P,D], [B,H,P,D]) or None


class EagerRunner:
    """The reference: the HF model called eagerly with a DynamicCache.

    For a vision decoder (MllamaForCausalLM) a prompt's ``cross_attention_states`` / 0-1
    ``cross_attention_mask [B, T, N]`` become HF's kwargs, and every later token passes the mask row of
    the prompt's last token again, as HF ``generate`` does.
    """

    def __init__(self, model: torch.nn.Module, name: str = "eager", call: Any = None):
        self.name = name
        self.model = model
        self._call = call or model
        self._n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._cache_kw = cache_kwarg_name(model)  # transformers 5 spells it cache=; past_key_values= is deprecated
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        # With a window, HF's own sliding layers (the last window - 1 tokens), as generate() builds them: what a
        # ring's valid slots are compared with. Without one, a plain DynamicCache, as before.
        sliding = hfconfig.sliding_window(self.model.config)
        self._cache = DynamicCache(config=self.model.config) if sliding else DynamicCache()
        self._mask: torch.Tensor | None = None
        self._cross_row: torch.Tensor | None = None  # [B, 1, N] 0/1: what tokens after the image see

    def _step(self, tokens: torch.Tensor, cross: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        from kvtrace.models.mllama import hf_cross_kwargs

        dev = next(self.model.parameters()).device  # a model on a GPU gets its inputs there
        tokens = tokens.to(dev)
        cross = {k: v.to(dev) for k, v in cross.items()} if cross else cross
        new = torch.ones_like(tokens)
        self._mask = new if self._mask is None else torch.cat([self._mask, new], dim=1)
        kwargs: dict[str, Any] = {}
        if cross:
            states = cross["cross_attention_states"]
            m = cross.get("cross_attention_mask")
            if m is None:
                m = torch.ones(tokens.shape[0], tokens.shape[1], states.shape[1], device=dev)
            kwargs = {"cross_attention_states": states, **hf_cross_kwargs(m, states.dtype)}
            self._cross_row = m[:, -1:]
        elif self._cross_row is not None:
            dtype = next(self.model.parameters()).dtype
            kwargs = hf_cross_kwargs(self._cross_row.expand(-1, tokens.shape[1], -1), dtype)
        with torch.inference_mode():
            out = self._call(input_ids=tokens, attention_mask=self._mask, **{self._cache_kw: self._cache},
                             use_cache=True, return_dict=True, **kwargs)
        return out.logits

    def prefill(self, tokens: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        return self._step(tokens, inputs)

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        return self._step(token)

    def cache(self) -> list[LayerKV]:
        layers = self._cache.layers
        return [(layers[i].keys, layers[i].values) if i < len(layers) and layers[i].is_initialized else None
                for i in range(self._n_layers)]


class JitRunner(EagerRunner):
    """The same HF-style calls through ``kvtrace.jit``."""

    def __init__(self, model: torch.nn.Module, backend: str = "inductor", name: str | None = None):
        from kvtrace.runtime.jit import jit

        self.jm = jit(model, backend=backend)
        super().__init__(model, name or ("jit" if backend == "inductor" else f"jit-{backend}"), call=self.jm)


class SessionRunner:
    """An artifact Session; its cache is read from the declared state buffers."""

    def __init__(self, session: Any, name: str):
        self.name = name
        self.session = session
        self.prefill_logits = getattr(session, "prefill_logits", "all")  # "last": prefill returns the last row only

    def reset(self) -> None:
        self.session.reset()

    def prefill(self, tokens: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        return self.session.prefill(tokens, **inputs)

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        return self.session.decode(token)

    def initial_state_error(self) -> str:
        """"" when every state buffer holds exactly its declared initial value (``BufferSpec.init``), else
        which one does not and where: a cache whose initial values were lost (an exporter that treats mutated
        buffers as uninitialized), or a reset that did not restore them."""
        spec = self.session.spec
        for b, t in zip(spec.buffers(), self.session.state, strict=True):
            off = t != b.init
            if bool(off.any()):
                at = [int(i) for i in off.nonzero()[0]]
                return (f"cache buffer {b.name} holds {t[tuple(at)].item():g} at {at} where the "
                        f"CacheSpec declares {b.init:g} everywhere (its initial value was lost, or reset() did "
                        "not restore it)")
        return ""

    def cache(self) -> list[LayerKV]:
        """Self-attention layers: the first P positions; cross-attention layers: all N slots once a
        program that fills them (e.g. prefill_image) ran, else None. int8 layers: those slots dequantized."""
        from kvtrace.cache import int8
        from kvtrace.cache.kinds import kind_of

        p, spec = self.session.position, self.session.spec
        filled = bool(self.session.filled)
        out: list[LayerKV] = []
        for i, layer in enumerate(spec.layers):
            kv = spec.layer_state(self.session.state, i)  # [B, H_kv, S or N, D] (+ int8 scales [B, H_kv, S, 1])
            kind = kind_of(layer)
            if kv.scales is None:
                out.append(kind.valid(kv.k, kv.v, p, filled))  # the slots holding data
            else:
                out.append(int8.valid(kind, kv.k, kv.v, kv.scales, p, filled, spec.torch_dtype))
        return out


class DecoderRunner(SessionRunner):
    """A kvtrace Decoder itself, run eagerly: a Session over its CacheSpec's own state whose programs are the
    decoder's methods (``program_specs``: e.g. ``forward_live`` with ``key_pos``), called without capture.

    The reference for an artifact whose cache is not the HF model's (an int8 cache): the same decoder with the
    same quantized cache, so only capture and compilation differ."""

    def __init__(self, decoder: torch.nn.Module, name: str = "decoder-eager"):
        from kvtrace.runtime.session import Session
        from kvtrace.spec.program import program_specs

        progs = {p.name: p for p in program_specs(decoder)}
        prefill, decode = (getattr(decoder, progs[n].method) for n in ("prefill", "decode"))
        if progs["prefill"].key_pos != progs["decode"].key_pos:
            raise ValueError(f"{type(decoder).__name__}: prefill and decode must agree on key_pos to run in a Session")
        self.decoder = decoder
        device = next(decoder.parameters()).device  # the state goes where the decoder's weights are
        super().__init__(Session(decoder.cache_spec, prefill, decode, device=device, key_pos=progs["prefill"].key_pos,
                                 identity=f"eager:{type(decoder).__name__}"), name)


class Unavailable:
    """A candidate that could not be built (its export or load raised): ``verify`` runs the others and
    reports this one as an error on every step, with ``reason``."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def reset(self) -> None:
        raise RuntimeError(self.reason)

    def prefill(self, tokens: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(self.reason)

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(self.reason)

    def cache(self) -> list[LayerKV]:
        return []
