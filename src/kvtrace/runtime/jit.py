"""kvtrace.jit: compile HF decoder calls that carry a KV cache, in three small stages.

1. prologue  — read the call (which kwargs, which cache, which cache layers are filled, dtypes,
               batch) into a frozen ``CallKey``; validate it; pick a captured program by that key.
               Lengths and positions are never part of the key.
2. computation — the captured program: a pure function of tensors
               ``(inputs..., held cache state...) -> (logits, written cache state...)`` exported with
               torch.export on *synthetic* example tensors (the caller's objects are never traced)
               with symbolic lengths (new tokens T, past P, image tokens N and N_c), run uncompiled
               (``backend="eager"``) or compiled ahead of time by AOTInductor (``backend="inductor"``,
               whose programs check no guards themselves). Before a program runs, the prologue checks its
               ``Contract`` (``_contract``: the guards, baked sizes and equal sizes the trace recorded)
               against the call's shapes, for both backends; a call it does not admit gets its own capture.
3. epilogue  — write the new cache tensors back into the caller's own cache object and build the
               HF-style output (same object returned as ``out.past_key_values``).

Models with cross-attention layers (Mllama's text decoder, ``MllamaForCausalLM``) also take
``cross_attention_states`` [B, N, hidden] (image features), ``cross_attention_mask`` [B, 1, T, X] (the
prepared additive mask over the X image tokens the cross layers attend) and
``full_text_row_masked_out_mask`` [B, 1, T, 1]. Their cache layers are not all alike: the key holds the
layer pattern (see ``_hf_cache``), and a program only takes and returns the layers it reads and writes.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace._errors import CacheOverflowError, CaptureError, KvtraceError, UnsupportedError, UsageError
from kvtrace.cache import hf as hfc
from kvtrace.cache.hf import CacheKind
from kvtrace.capture.contract import Contract, model_line
from kvtrace.capture.preserve import preserved

__all__ = ["CallKey", "JitStats", "JittedModel", "jit"]

log = logging.getLogger("kvtrace")

BACKENDS = ("inductor", "eager")
# Tensor inputs a call may carry, in program-signature order, with their sequence dimension.
_SEQ_DIM = {"input_ids": 1, "inputs_embeds": 1, "attention_mask": 1, "position_ids": -1, "cache_position": 0}
_FLAGS = ("use_cache", "return_dict", "logits_to_keep")
# Cross-attention inputs (models that take them), after the _SEQ_DIM ones in program order: their shapes.
# T = new tokens, N = new image tokens, X = image tokens the cross layers attend (N_c cached + N new).
_CROSS = {
    "cross_attention_states": "[B, N, hidden]",
    "cross_attention_mask": "[B, 1, T, X]",
    "full_text_row_masked_out_mask": "[B, 1, T, 1]",
}
# Example sizes used for capture: >= 2 and pairwise distinct (also the sums P + T and N_c + N), so no
# length is specialised or unified: T new tokens, P past tokens, N new and N_c cached image tokens.
_T_EX, _P_EX, _N_EX, _NC_EX = 3, 5, 7, 11
# T of an unmasked causal cross-attention program: above N_c + N. HF's sdpa path slices the image keys to
# key[:, :, :T] when there are more of them than tokens; under its top-left causal mask that changes nothing,
# but a compiled slice assumes the example's side of N > T. Captured with T > N, the graph has no slice.
_T_CAUSAL_EX = 19
# Programs one key may hold (one per region of lengths the model's code tells apart, see _capture); past
# that the model's graph depends on the lengths themselves, and each new length would need a new capture.
_MAX_PROGRAMS = 8


@dataclass
class JitStats:
    """Counters of one jitted model. ``captures`` counts programs captured (exported+compiled)."""

    calls: int = 0
    captures: int = 0
    fallbacks: int = 0
    capture_seconds: list[float] = field(default_factory=list)
    # Why a capture beyond one per key happened: the trace assumed something of the lengths (a guard, a size
    # baked in) that a call broke, so it got a program of its own. Empty for the supported HF models.
    specializations: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CallKey:
    """What changes a captured graph. Sequence length, past length and positions are *not* here."""

    cache: CacheKind
    inputs: tuple[str, ...]  # names of the tensor inputs present, in signature order
    dtypes: tuple[str, ...]  # their dtypes, then the cache dtype
    batch: int
    device: str
    model_dtype: str
    static_len: int | None  # StaticCache max_cache_len (a static shape), else None
    logits_to_keep: int
    layers: tuple[str, ...] = ()  # per model layer: "self", "cross-filled" or "cross-empty" (_hf_cache)
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


def size_classes(t_len: int, past: int, kind: CacheKind) -> tuple[int, int]:
    """``CallKey.sizes``: (min(T, 2), min(P, 2)); P is 2 where it is no tensor size (StaticCache, no cache)."""
    dynamic_past = kind in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH)
    return min(t_len, 2), min(past, 2) if dynamic_past else 2


@dataclass(frozen=True)
class _Program:
    """A captured program and what it assumes of its argument shapes (checked before every run)."""

    run: Callable[..., Any]
    contract: Contract


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


class _Step(torch.nn.Module):
    """The pure computation the program captures: tensors in, logits (+ new cache state) out."""

    def __init__(self, model: torch.nn.Module, key: CallKey, n_layers: int, cache_kw: str, template: Any):
        super().__init__()
        self.model = model
        self.key = key
        self.n_layers = n_layers
        self.cache_kw = cache_kw
        self.template = template

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n_in = len(self.key.inputs)
        kwargs: dict[str, Any] = dict(zip(self.key.inputs, flat[:n_in], strict=True))
        state = list(flat[n_in:])
        kind = self.key.cache
        if kind is CacheKind.NONE:
            cache = None
        elif kind is CacheKind.STATIC:
            cache = hfc.build_static(self.template, state)
        else:
            cache = hfc.build_dynamic(state, self.n_layers, _held(self.key))
        if self.key.logits_to_keep:
            kwargs["logits_to_keep"] = self.key.logits_to_keep
        out = self.model(**kwargs, **{self.cache_kw: cache}, use_cache=kind is not CacheKind.NONE, return_dict=True)
        if kind in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH):
            # written state: self layers [B, H_kv, P + T, D]; cross layers [B, H_kv, N_c + N, D] when given images
            return (out.logits, *hfc.dynamic_state(cache, _written(self.key)))
        return (out.logits,)  # static state was mutated in place (declared input mutation)


class JittedModel:
    """A compiled stand-in for an HF causal LM's ``forward``. Call it exactly like the model."""

    def __init__(self, model: torch.nn.Module, *, backend: str = "inductor", fallback: str | None = None):
        if backend not in BACKENDS:
            raise UsageError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if fallback not in (None, "eager"):
            raise UsageError(f"fallback must be None or 'eager', got {fallback!r}")
        if not hasattr(model, "config"):
            raise UnsupportedError(
                f"kvtrace.jit expects a HuggingFace causal LM (a model with .config), got {type(model).__name__}"
            )
        self.model = model
        self.backend = backend
        self.fallback = fallback
        self.stats = JitStats()
        # Per key, the programs captured for it; a call runs the first whose contract admits its shapes.
        self._programs: dict[CallKey, list[_Program]] = {}
        self._cache_kw = hfc.cache_kwarg_name(model)
        self._signature = inspect.signature(model.forward)
        self._n_layers, self._n_kv, self._head_dim = hfc.kv_geometry(model.config)
        self._cross = hfc.cross_layers(model.config)  # cross-attention layer indices; () for decoder-only models
        self._cross_inputs = tuple(n for n in _CROSS if n in self._signature.parameters)
        self._warned = False
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._watched = list(model.modules())  # whose parameters, buffers and children _weights_token reads
        self._weights_seen: tuple[int, ...] = ()  # the token every program in _programs was captured with

    def __repr__(self) -> str:
        return f"kvtrace.jit({type(self.model).__name__}, backend={self.backend!r}, stats={self.stats})"

    def __getattr__(self, name: str) -> Any:  # drop-in: jm.config, jm.device, ...
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.stats.calls += 1
        try:
            call = self._prologue(args, kwargs)
        except UnsupportedError as e:
            if self.fallback != "eager":
                raise
            if not self._warned:
                warnings.warn(f"kvtrace.jit falls back to eager: {e}", stacklevel=2)
                self._warned = True
            self.stats.fallbacks += 1
            return self.model(*args, **kwargs)
        self._drop_stale_programs(call.weights)
        shapes = self._arg_shapes(call)
        program = self._lookup(call.key, shapes) or self._capture(call, shapes)
        if call.key.cache is CacheKind.STATIC:  # HF's own lazy init, as eager does on first use
            hfc.ensure_static_initialized(
                call.cache, call.key.batch, self._n_kv, self._head_dim, self._cache_dtype(call), call.tensors[0].device
            )
        outs = program.run(*self._program_args(call))
        return self._epilogue(call, outs)

    # --- stage 1: prologue --------------------------------------------------------------------
    def _prologue(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        if "cache" in kwargs and "past_key_values" in kwargs:
            raise UsageError("pass the cache as `cache=` or `past_key_values=`, not both")
        kwargs = dict(kwargs)  # never modify the caller's dict
        alias = "past_key_values" if self._cache_kw == "cache" else "cache"
        if alias in kwargs:  # accept both spellings (transformers 4.x and 5.x)
            kwargs[self._cache_kw] = kwargs.pop(alias)
        try:
            bound = self._signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise UsageError(f"{type(self.model).__name__}.forward does not take these arguments: {e}") from e
        extra = bound.pop("kwargs", {}) or {}
        bound.update(extra)
        supported = (*_SEQ_DIM, *self._cross_inputs, *_FLAGS)
        unknown = sorted(k for k, v in bound.items() if v is not None and k not in (*supported, self._cache_kw)
                         and not (k in ("output_attentions", "output_hidden_states") and v is False))
        if unknown:
            raise UnsupportedError(
                f"kvtrace.jit does not support the argument(s) {unknown}; supported: "
                f"{sorted((*supported, 'past_key_values'))}"
            )
        if (bound.get("input_ids") is None) == (bound.get("inputs_embeds") is None):
            raise UsageError("pass exactly one of input_ids or inputs_embeds")
        cfg = self.model.config
        use_cache = bound.get("use_cache")
        use_cache = getattr(cfg, "use_cache", True) if use_cache is None else bool(use_cache)
        return_dict = bound.get("return_dict")
        return_dict = getattr(cfg, "use_return_dict", getattr(cfg, "return_dict", True)) if return_dict is None else return_dict
        cache = bound.get(self._cache_kw)
        if cache is None and use_cache:
            cache = hfc.new_dynamic_cache(cfg)  # what eager does
        if cache is not None and not use_cache:
            raise UnsupportedError("a cache together with use_cache=False is not supported; drop one of them")
        kind = hfc.classify(cache, self._cross)
        layers = hfc.layer_pattern(cache, self._n_layers, self._cross)

        names = tuple(n for n in (*_SEQ_DIM, *self._cross_inputs) if bound.get(n) is not None)
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
        if kind in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH):
            self._check_dynamic_layers(cache, kind)
            held = hfc.held_layers(kind, layers)
            for i in held:
                k = cache.layers[i].keys  # [B, H_kv, P, D] (self) or [B, H_kv, N_c, D] (cross)
                if k.shape[0] != batch:
                    raise UsageError(f"cache holds batch {k.shape[0]} but the inputs have batch {batch}")
            if held:
                cache_dtype = str(cache.layers[held[0]].keys.dtype)
            past = next((cache.layers[i].keys.shape[-2] for i in held if layers[i] == hfc.SELF), 0)
            cross_len = next((cache.layers[i].keys.shape[-2] for i in held if layers[i] == hfc.CROSS_FILLED), 0)
        elif kind is CacheKind.STATIC:
            static_len = hfc.static_max_len(cache)
            layer0 = cache.layers[0]
            cache_dtype = str(next(self.model.parameters()).dtype)  # what HF's lazy init will allocate
            if layer0.is_initialized:
                past = int(layer0.cumulative_length)  # host-side read, outside any trace
                cache_dtype = str(layer0.keys.dtype)
                if layer0.keys.shape[0] != batch:
                    raise UsageError(f"cache holds batch {layer0.keys.shape[0]} but the inputs have batch {batch}")
                if not all(t.is_contiguous() for t in hfc.static_state(cache)):
                    raise UnsupportedError("a StaticCache holding non-contiguous tensors is not supported")
            if past + t_len > static_len:
                raise CacheOverflowError(
                    f"StaticCache holds {static_len} positions; {past} are used and the call adds {t_len} "
                    f"({past + t_len} > {static_len}). Create the cache with a larger max_cache_len."
                )
        mask = bound.get("attention_mask")
        if mask is not None and kind is not CacheKind.STATIC and mask.shape[-1] != past + t_len:
            raise UsageError(
                f"attention_mask covers {mask.shape[-1]} positions, expected past + new = {past} + {t_len} = {past + t_len}"
            )
        keep = bound.get("logits_to_keep") or 0
        if not isinstance(keep, int):
            raise UnsupportedError("logits_to_keep must be an int for kvtrace.jit")
        given = dict(zip(names, tensors, strict=True))
        image = _image_tokens(given, cross_len)
        _check_cross_inputs(given, batch, t_len, self._hidden_size(), image)
        model_dtype, weights = self._weights()
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
            sizes=size_classes(t_len, past, kind),
        )
        return _Call(key=key, tensors=tensors, cache=cache, return_dict=bool(return_dict), past_len=past,
                     weights=weights, cross_len=cross_len)

    def _check_dynamic_layers(self, cache: Any, kind: CacheKind) -> None:
        """A filled DynamicCache has a layer per model layer; only trailing cross layers may not exist yet
        (eager creates layers lazily and skips cross layers without image tokens)."""
        n = len(cache.layers)
        missing = [i for i in range(n, self._n_layers) if i not in self._cross]
        if kind is CacheKind.DYNAMIC and (n > self._n_layers or missing):
            raise UsageError(f"cache has {n} layers, the model has {self._n_layers}")

    def _hidden_size(self) -> int:
        cfg = self.model.config
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        return int(cfg.hidden_size)

    def _weights(self) -> tuple[str, tuple[int, ...]]:
        """(the parameters' dtypes, a token of which tensors the model computes with).

        The dtypes change the graph, so they are part of the key. The token does not: a captured program
        holds the tensors it was captured with, so when ``model.to(...)``, ``load_state_dict(assign=True)``
        or module surgery replaces one, the programs would silently run on stale weights.
        In-place updates (``param.copy_(...)``) keep the token and are seen by every program.
        """
        dtypes, token = _weights_token(self._watched)
        if token != self._weights_seen:  # changed (or first call): the tree may hold new modules, walk it again
            self._watched = list(self.model.modules())
            dtypes, token = _weights_token(self._watched)
        return dtypes, token

    def _drop_stale_programs(self, weights: tuple[int, ...]) -> None:
        """Forget programs captured with other weight tensors than the model's current ones."""
        if weights == self._weights_seen:
            return
        if self._programs:
            log.info("model weights were replaced since the last call; dropping %d captured program(s)",
                     len(self._programs))
            self._programs.clear()
        self._weights_seen = weights

    def _lookup(self, key: CallKey, shapes: list[torch.Size]) -> _Program | None:
        """The first program of ``key`` traced for these argument shapes (its contract admits them)."""
        return next((p for p in self._programs.get(key, ()) if p.contract.admits(shapes)), None)

    def _arg_shapes(self, call: _Call) -> list[torch.Size]:
        """The shapes of the program's arguments (``_program_args``' order), without touching the cache.

        An uninitialized StaticCache gets the shapes HF's lazy init will allocate: [B, H_kv, S_max, D] and 0-d.
        """
        shapes = [t.shape for t in call.tensors]
        if call.key.cache in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH):
            for i in _held(call.key):
                layer = call.cache.layers[i]
                shapes += [layer.keys.shape, layer.values.shape]
        elif call.key.cache is CacheKind.STATIC:
            if call.cache.layers[0].is_initialized:
                shapes += [t.shape for t in hfc.static_state(call.cache)]
            else:
                kv = torch.Size((call.key.batch, self._n_kv, call.key.static_len, self._head_dim))
                shapes += [kv, kv, torch.Size(())] * self._n_layers
        return shapes

    def _arg_names(self, key: CallKey) -> list[str]:
        """One description per program argument, for messages."""
        names = list(key.inputs)
        if key.cache in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH):
            names += [f"cache layer {i} {kv}" for i in _held(key) for kv in ("keys", "values")]
        elif key.cache is CacheKind.STATIC:
            names += [f"cache layer {i} {t}" for i in range(self._n_layers)
                      for t in ("keys", "values", "cumulative_length")]
        return names

    def _cache_dtype(self, call: _Call) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _program_args(self, call: _Call) -> list[torch.Tensor]:
        """Inputs, then cache state, laid out as at capture: contiguous (a no-op when they already are).

        A sliced position_ids or a cropped DynamicCache is a strided view; compiled kernels would read it
        with the example's strides. StaticCache state is mutated in place, so it goes as is (the
        prologue checked it is contiguous).
        """
        args = [t.contiguous() for t in call.tensors]
        if call.key.cache in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH):
            args += [t.contiguous() for t in hfc.dynamic_state(call.cache, _held(call.key))]
        elif call.key.cache is CacheKind.STATIC:
            args += hfc.static_state(call.cache)
        return args

    # --- stage 2: capture the computation -------------------------------------------------------
    def _examples(self, call: _Call, exact: bool) -> tuple[list[torch.Tensor], list[Any]]:
        """Synthetic example inputs (never the caller's tensors) and their dynamic-shape spec."""
        from torch.export import Dim

        key = call.key
        t_ex = call.tensors[0].shape[1] if exact else _T_EX
        if key.sizes[0] < 2:  # T = 1 is this program's graph, not a length: keep it static (see CallKey.sizes)
            t_ex = key.sizes[0]
        elif key.unmasked_cross == "causal" and not exact:
            t_ex = _T_CAUSAL_EX
        p_ex = call.past_len if exact else (0 if key.cache is CacheKind.DYNAMIC_FRESH else _P_EX)
        if key.cache is CacheKind.DYNAMIC and key.sizes[1] < 2:  # P = 0 or 1: likewise static
            p_ex = key.sizes[1]
        nc_ex = call.cross_len if exact else (_NC_EX if hfc.CROSS_FILLED in key.layers else 0)
        if key.static_len is not None:
            p_ex = min(p_ex, max(key.static_len - t_ex, 0))
        n_ex, x_ex = _image_examples(call, exact, nc_ex)
        examples: list[torch.Tensor] = []
        shapes: list[Any] = []
        for name, t in zip(key.inputs, call.tensors, strict=True):
            if name in _CROSS:
                ex, spec = _cross_example(name, t, t_ex, n_ex, x_ex)
                examples.append(ex)
                shapes.append({d: dim for d, dim in spec.items() if ex.shape[d] != 1})  # 1: as below
                continue
            dim = _SEQ_DIM[name] % t.dim()
            size = list(t.shape)
            size[dim] = p_ex + t_ex if name == "attention_mask" else t_ex
            if name in ("position_ids", "cache_position"):
                ex = (torch.arange(t_ex, device=t.device, dtype=t.dtype) + p_ex).expand(size).clone()  # not a view
            elif name == "attention_mask":
                ex = torch.ones(size, dtype=t.dtype, device=t.device)
            else:
                ex = torch.zeros(size, dtype=t.dtype, device=t.device)
            examples.append(ex)
            # 1: a one-token program's T, or an exact capture's size 1 (torch.export specialises it anyway;
            # the program's Contract then admits only that size)
            shapes.append({dim: Dim.AUTO} if size[dim] != 1 else {})
        if key.cache in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH):
            for i in _held(key):
                k = call.cache.layers[i].keys  # [B, H_kv, P, D] (self) or [B, H_kv, N_c, D] (cross)
                shape = (key.batch, k.shape[1], nc_ex if key.layers[i] == hfc.CROSS_FILLED else p_ex, k.shape[3])
                examples += [torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in range(2)]
                shapes += [{2: Dim.AUTO} if shape[2] != 1 else {}] * 2
        elif key.cache is CacheKind.STATIC:
            dtype = self._cache_dtype(call)
            shape = (key.batch, self._n_kv, key.static_len, self._head_dim)  # [B, H_kv, S_max, D]
            for _ in range(self._n_layers):
                examples += [torch.zeros(shape, dtype=dtype, device=key.device),
                             torch.zeros(shape, dtype=dtype, device=key.device),
                             torch.tensor(p_ex, dtype=torch.int64, device=key.device)]
                shapes += [None, None, None]
        return examples, shapes

    def _export(self, call: _Call, exact: bool) -> tuple[torch.export.ExportedProgram, list[tuple[int, int]]]:
        template = None
        if call.key.cache is CacheKind.STATIC:  # a structural copy; the caller's cache stays as it is
            template = hfc.static_template(call.cache)
            hfc.ensure_static_initialized(template, call.key.batch, self._n_kv, self._head_dim,
                                          self._cache_dtype(call), torch.device(call.key.device))
        step = _Step(self.model, call.key, self._n_layers, self._cache_kw, template)
        examples, shapes = self._examples(call, exact)
        # outer: the caller's state is put back whatever happens; inner: state the forward keeps is refused
        # (it must see that state before the outer one restores it)
        with preserved(self.model, what=f"the model ({type(self.model).__name__})"), \
                _forward_keeps_no_state(self.model):
            ep = torch.export.export(step, tuple(examples), dynamic_shapes=(tuple(shapes),), strict=False)
        # Which intended-symbolic dims did the trace bake in as constants (a plain int, or a SymInt whose
        # expression a guard such as Eq(s0, 5) replaced by a number)?
        placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"][-len(examples):]
        baked = []
        for a, (node, spec) in enumerate(zip(placeholders, shapes, strict=True)):
            for d in spec or {}:
                size = node.meta["val"].shape[d]
                if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                    baked.append((a, d))
        return ep, baked

    def _capture(self, call: _Call, shapes: list[torch.Size]) -> _Program:
        """Capture a program for ``call``'s key that admits its argument shapes, and keep it.

        The first program of a key is traced with the synthetic example sizes; when its contract does not admit
        the call (the trace baked a size in, or a guard of the model's code fails here), or when the key's
        earlier programs do not, it is traced again with the call's own sizes: one program per region of
        lengths the model's code tells apart, counted in ``stats.specializations``. Refused (CaptureError):
        a program that holds the past length P as a constant (it would need a capture per decode step), and
        a key needing more than ``_MAX_PROGRAMS`` programs.
        """
        t0 = time.perf_counter()
        name = type(self.model).__name__
        kind = call.key.cache.value
        programs = self._programs.get(call.key, [])
        if programs:
            why = programs[-1].contract.violation(shapes)
            if len(programs) >= _MAX_PROGRAMS:
                raise CaptureError(
                    f"kvtrace.jit captured {len(programs)} {kind} programs of {name} and none admits this call "
                    f"({why}): the model's graph depends on the lengths; make them symbolic (no Python branch, "
                    "int() or .item() on a length) or run the model without kvtrace.jit"
                )
            self.stats.specializations.append(f"{name}: no {kind} program admits this call ({why}); captured another")
        stage = "export"
        try:
            ep, contract = self._export_checked(call, exact=bool(programs))
            if not contract.admits(shapes):  # the example sizes were the wrong side of a guard: trace this call's
                self.stats.specializations.append(
                    f"{name}: the {kind} program traced with example sizes does not admit this call "
                    f"({contract.violation(shapes)}); captured with the call's sizes"
                )
                ep, contract = self._export_checked(call, exact=True)
            if not contract.admits(shapes):
                raise CaptureError(f"kvtrace.jit captured {name}'s {kind} program with this call's own sizes and it "
                                   f"still does not admit them ({contract.violation(shapes)})")
            stage = "compile"
            run = self._compile(ep, call.key)
        except KvtraceError:
            raise
        except Exception as e:
            from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

            where = model_line(e)
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            hint = ("; the model reads a value of a tensor into Python (int(), .item()) and decides on it: compute "
                    "with tensors instead (torch.where) or run the model without kvtrace.jit"
                    if isinstance(e, GuardOnDataDependentSymNode) else "")
            raise CaptureError(
                f"kvtrace.jit could not capture {name} at stage '{stage}' "
                f"(cache={kind}, inputs={list(call.key.inputs)}): {type(e).__name__}: {lines[0] if lines else ''}"
                + (f" (at {where})" if where else "") + hint
            ) from e
        entry = _Program(run, contract)
        self._programs[call.key] = [*programs, entry]
        self.stats.captures += 1
        self.stats.capture_seconds.append(time.perf_counter() - t0)
        log.info("captured %s program for %s in %.1fs", kind, name, self.stats.capture_seconds[-1])
        return entry

    def _export_checked(self, call: _Call, exact: bool) -> tuple[torch.export.ExportedProgram, Contract]:
        """``_export`` and the program's contract; refuses a program that holds the past length as a constant."""
        ep, baked = self._export(call, exact)
        names = self._arg_names(call.key)
        past = {len(call.key.inputs) + 2 * k + kv for k, i in enumerate(_held(call.key))
                if call.key.layers[i] == hfc.SELF for kv in (0, 1)}  # self layers' keys and values: P
        contract = Contract(ep, names, waive=_causal_slice_waiver(call.key, past))
        if call.key.cache is CacheKind.DYNAMIC:
            placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"][-len(names):]
            for a, d in baked:
                size = int(placeholders[a].meta["val"].shape[d])
                if a in past and size >= 2:  # not a 0/1 specialisation of an exact capture: the model fixed it
                    origin = contract.origin(a, d)
                    raise CaptureError(
                        f"kvtrace.jit cannot capture {type(self.model).__name__}: its {call.key.cache.value} program "
                        f"holds the past length P ({names[a]}, dim {d}) as the constant {size}, so it would be wrong "
                        f"at every other cache length" + (f"; fixed at {origin}" if origin else "")
                        + "; read cache lengths as symbolic sizes (no int(), .item() or Python branch needing the "
                        "value), or run the model without kvtrace.jit"
                    )
        return ep, contract

    def _compile(self, ep: torch.export.ExportedProgram, key: CallKey) -> Callable[..., Any]:
        if self.backend == "eager":
            # Capture uses example sizes >= 2 (torch.export specialises 0 and 1), so the exported range
            # of a *derived* size such as the mask length P + T reads ">= 4". That bound is an artifact
            # of the examples, not of the graph: the prologue checks the real invariants (mask = P + T,
            # T >= 1), and tests run T = 1, P = 1 and P = 0 against eager. So call the graph itself,
            # without the example-derived input-range hooks (AOTInductor has none either). Everything else
            # the trace assumed (guards, baked sizes, equal sizes, range upper bounds) is the program's
            # Contract, which __call__ checks for both backends before running it.
            return ep.module(check_guards=False).forward
        from kvtrace.backends.aoti import aoti_compile

        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="kvtrace-jit-")
        return aoti_compile(ep, f"{self._workdir.name}/program{self.stats.captures}.pt2")  # never reuse a path

    # --- stage 3: epilogue --------------------------------------------------------------------
    def _epilogue(self, call: _Call, outs: Any) -> Any:
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        logits = outs[0]
        if call.key.cache in (CacheKind.DYNAMIC, CacheKind.DYNAMIC_FRESH):
            written = _written(call.key)
            hfc.write_back_dynamic(call.cache, {i: (outs[1 + 2 * j], outs[2 + 2 * j]) for j, i in enumerate(written)})
        return hfc.make_output(self.model, logits, call.cache, call.return_dict)


def _causal_slice_waiver(key: CallKey, past: set[int]) -> Callable[[Any], bool] | None:
    """The one guard a causal cross-attention program may ignore: HF's sdpa slice of the image keys.

    ``if is_causal and attention_mask is None and q_length > 1 and kv_length > q_length`` slices the X image
    keys to the first T; under the top-left causal mask that changes nothing (query i < T attends keys
    j <= i either way), so the program captured on the T > X side (``_T_CAUSAL_EX``, no slice) is right on
    both. Only for guards over T and X (never over a past length P), only for those programs.
    """
    if key.unmasked_cross != "causal":
        return None

    def waived(c: Any) -> bool:
        return ("integrations/sdpa_attention.py" in c.where and "kv_length > q_length" in c.where
                and not any(a in past for a in c.args))

    return waived


def _image_tokens(given: dict[str, torch.Tensor], cross_len: int) -> int | None:
    """X: image tokens the cross-attention layers attend in this call (the N_c cached plus the N given);
    None when they do not run (no image features given, none cached): eager skips them."""
    states = given.get("cross_attention_states")  # [B, N, hidden]
    if states is None and not cross_len:
        return None
    return cross_len + (states.shape[1] if states is not None and states.dim() == 3 else 0)


def _unmasked_cross(given: dict[str, torch.Tensor], image: int | None, t_len: int) -> str:
    """CallKey.unmasked_cross: which graph cross layers attending without a mask take (see CallKey)."""
    if image is None or "cross_attention_mask" in given:
        return ""
    return "one-token" if t_len == 1 else "causal"


def _check_cross_inputs(given: dict[str, torch.Tensor], batch: int, t_len: int, hidden: int,
                        image: int | None) -> None:
    """Shapes of the cross-attention inputs against the call (before any tracing)."""
    states = given.get("cross_attention_states")
    if states is not None and (states.dim() != 3 or states.shape[0] != batch or states.shape[1] < 1
                               or states.shape[2] != hidden):
        raise UsageError(
            f"cross_attention_states has shape {list(states.shape)}; expected [B, N, hidden] = [{batch}, N >= 1, "
            f"{hidden}] (batch of the inputs, the text model's hidden_size {hidden})"
        )
    x = "X" if image is None else image
    for name, want in (("cross_attention_mask", [batch, 1, t_len, x]),
                       ("full_text_row_masked_out_mask", [batch, 1, t_len, 1])):
        t = given.get(name)
        if t is None:
            continue
        found = list(t.shape)
        if len(found) != 4 or any(w != "X" and f != w for f, w in zip(found, want, strict=True)):
            raise UsageError(
                f"{name} has shape {found}; expected {_CROSS[name]} = {want} (T = {t_len} new tokens"
                + ("" if image is None else f", X = {image} image tokens the cross-attention layers attend")
                + "): the prepared 4D mask, as MllamaForConditionalGeneration passes it"
            )


def _image_examples(call: _Call, exact: bool, nc_ex: int) -> tuple[int, int]:
    """Example sizes (N, X): new image tokens, and image tokens the cross layers attend (N_c + N)."""
    given = dict(zip(call.key.inputs, call.tensors, strict=True))
    states = given.get("cross_attention_states")  # [B, N, hidden]
    n_ex = 0 if states is None else states.shape[1] if exact else _N_EX
    mask = given.get("cross_attention_mask")  # [B, 1, T, X]
    if exact and mask is not None:
        return n_ex, mask.shape[3]
    return n_ex, (nc_ex + n_ex) or _N_EX  # a mask no cross layer reads (text-only call) still needs a size


def _cross_example(name: str, t: torch.Tensor, t_ex: int, n_ex: int, x_ex: int) -> tuple[torch.Tensor, dict[int, Any]]:
    """A synthetic cross-attention input like ``t`` and its dynamic dims (see ``_CROSS``)."""
    from torch.export import Dim

    b, kw = t.shape[0], dict(dtype=t.dtype, device=t.device)
    if name == "cross_attention_states":  # [B, N, hidden]
        return torch.zeros(b, n_ex, t.shape[2], **kw), {1: Dim.AUTO}
    if name == "cross_attention_mask":  # [B, 1, T, X], additive: 0 = attend
        return torch.zeros(b, 1, t_ex, x_ex, **kw), {2: Dim.AUTO, 3: Dim.AUTO}
    return torch.ones(b, 1, t_ex, 1, **kw), {2: Dim.AUTO}  # full_text_row_masked_out_mask [B, 1, T, 1]


_MODULE_INTERNALS = ("_modules", "_parameters", "_buffers")  # see _python_state


def _python_state(model: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """(module path, attribute) -> value for the plain attributes of the model's modules and of its config:
    what a forward could leave behind for the next call. Not parameters and buffers: torch.export swaps them
    for traced tensors while it runs, and replacing one is seen by ``_weights_token`` on the next call."""
    state: dict[tuple[str, str], Any] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        where = path or type(model).__name__
        for k, v in vars(mod).items():
            if k not in _MODULE_INTERNALS:
                state[(where, k)] = v
    cfg = getattr(model, "config", None)
    for k, v in (vars(cfg).items() if cfg is not None else ()):
        state[("config", k)] = v
    return state


def _plain(x: Any, depth: int = 0) -> bool:
    """Python data compared by value (no tensors, no traced sizes): scalars, strings and containers of them."""
    if x is None or type(x) in (int, float, str, bool):
        return True
    if depth < 3 and type(x) in (tuple, list, set, frozenset):
        return all(_plain(y, depth + 1) for y in x)
    if depth < 3 and type(x) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in x.items())
    return False


def _same(a: Any, b: Any) -> bool:
    """The trace left the value as it was (the same object, or equal plain data: HF re-creates some dicts)."""
    return a is b or (type(a) is type(b) and _plain(a) and _plain(b) and a == b)


@contextlib.contextmanager
def _forward_keeps_no_state(model: torch.nn.Module) -> Any:
    """Refuse a capture whose trace set Python attributes on the model (e.g. ``self.seen = T``).

    A captured program cannot carry Python state from one call to the next: eager updates the attribute on
    every call, the program keeps what the trace saw. The state is read by a forward hook, as the model's
    forward leaves it (torch.export puts back attributes that existed, but not before the trace read them,
    and it leaves new ones holding traced sizes). Whatever still differs afterwards is put back as the caller
    had it, then ``CaptureError`` names what the forward set.
    """
    before = _python_state(model)
    left: list[dict[tuple[str, str], Any]] = []
    handle = model.register_forward_hook(lambda mod, args, out: left.append(_python_state(model)))
    try:
        yield
    finally:
        handle.remove()
        _put_back(model, before)
    # A tensor attribute the forward *adds* is a memo it recomputes from the config on every trace (HF longrope's
    # rotary_emb.long_inv_freq): each program holds its own copy, and the caller's model gets none (deleted
    # again). Anything else the forward sets, replaces or deletes is state carried from one call to the next.
    changed = [k for k in {**before, **left[0]} if k not in left[0]
               or (k not in before and not isinstance(left[0][k], torch.Tensor))
               or (k in before and not _same(before[k], left[0][k]))] if left else []
    if not changed:
        return
    path, attr = changed[0]
    value = left[0].get((path, attr))
    what = ("a traced size" if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))
            else "a traced tensor" if isinstance(value, torch.Tensor) else "deleted" if (path, attr) not in left[0]
            else repr(value)[:40])
    raise CaptureError(
        f"kvtrace.jit cannot capture {type(model).__name__}: its forward sets {len(changed)} attribute(s) of the "
        f"model (first: {path}.{attr} = {what}), Python state a captured program cannot carry from one call to "
        "the next; keep per-call values local (or in the cache), or run the model without kvtrace.jit "
        "(the attributes were restored)"
    )


def _put_back(model: torch.nn.Module, before: dict[tuple[str, str], Any]) -> None:
    """Undo what a trace left set, replaced or deleted among ``_python_state``'s attributes."""
    now = _python_state(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    for path, attr in (k for k in {**before, **now} if k not in before or k not in now or not _same(before[k], now[k])):
        obj = model.config if path == "config" else modules.get("" if path == type(model).__name__ else path)
        if obj is None:
            continue
        if (path, attr) in before:
            setattr(obj, attr, before[(path, attr)])  # Module.__setattr__ puts parameters and buffers back too
        else:
            delattr(obj, attr)


def _weights_token(modules: list[torch.nn.Module]) -> tuple[str, tuple[int, ...]]:
    """Sorted parameter dtypes, and the children's ids and every parameter's and buffer's storage address.

    A flat walk over an already-listed module tree (~0.1 ms for 16 decoder layers, a third of
    ``model.parameters()``): it runs on every call.
    """
    token: list[int] = []
    dtypes: set[torch.dtype] = set()
    for mod in modules:
        token += map(id, mod._modules.values())
        for p in mod._parameters.values():
            if p is not None:
                dtypes.add(p.dtype)
                token.append(p.data_ptr())
        token += [b.data_ptr() for b in mod._buffers.values() if b is not None]
    return ",".join(sorted(map(str, dtypes))), tuple(token)


def jit(model: torch.nn.Module, *, backend: str = "inductor", fallback: str | None = None) -> JittedModel:
    """Compile ``model.forward`` for HF-style calls with a KV cache.

    Args:
        model: an HF decoder-only causal LM (Llama, Qwen2, Qwen3, Mistral, Phi-3, ...) or Mllama's text
            decoder (``MllamaForCausalLM``, with ``cross_attention_states`` / ``cross_attention_mask`` /
            ``full_text_row_masked_out_mask``), in eval mode.
        backend: ``"inductor"`` (AOTInductor-compiled programs) or ``"eager"`` (captured programs
            run uncompiled; fast to capture, useful for debugging).
        fallback: ``None`` (unsupported calls raise ``UnsupportedError``) or ``"eager"`` (they run
            the model uncompiled, with one warning).

    Returns:
        ``jm`` with the calling convention of ``model.forward``; ``jm.stats`` counts calls and captures.

    Never silently wrong: whatever a capture assumed of the lengths (the guards torch.export recorded, such as
    ``P <= 6`` from ``if past > 6:``, sizes it baked in, sizes it found equal, range upper bounds) is checked
    on the host before each call runs a program, on both backends. A call outside them gets a program captured
    with its own sizes (``stats.specializations`` says why; at most 8 per key). Refused with ``CaptureError``,
    naming the model's line: a program holding the past length as a constant (``int(cache.get_seq_length())``),
    a Python value read from a tensor (``int(cache_position[0])``, ``.item()``) that the code branches on,
    and a forward that sets attributes on the model (``self.seen = T``; they are put back).
    """
    return JittedModel(model, backend=backend, fallback=fallback)
