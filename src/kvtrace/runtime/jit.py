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
               ``Contract`` (``capture.contract``: the guards, baked sizes and equal sizes the trace recorded)
               against the call's shapes, for both backends; a call it does not admit gets its own capture.
3. epilogue  — write the new cache tensors back into the caller's own cache object and build the
               HF-style output (same object returned as ``out.past_key_values``).

Models with cross-attention layers (Mllama's text decoder, ``MllamaForCausalLM``) also take
``cross_attention_states`` [B, N, hidden] (image features), ``cross_attention_mask`` [B, 1, T, X] (the
prepared additive mask over the X image tokens the cross layers attend) and
``full_text_row_masked_out_mask`` [B, 1, T, 1]. Their cache layers are not all alike: the key holds the
layer pattern (see ``kvtrace.cache.hf``), and a program only takes and returns the layers it reads and
writes. Sliding-window cache layers (HF's ``DynamicSlidingWindowLayer``, as ``DynamicCache(config=...)``
builds them for Mistral or a hybrid Qwen2) go the same way: a program takes their stored tail and P, and
returns the new tail (``kvtrace.cache.sliding``). HF's sliding code branches on which side of the window a
call is (the stored tail shorter than, exactly or past W - 1; P >= W), so the key holds that regime
(``jit_call.sliding_regime``: filling, reaching, crossing, full) and each program is symbolic in every length
of its regime: a generation that crosses the window captures one program per (regime x size class) it
meets, and none after.

This module holds the three stages' driver (``JittedModel``, ``jit``) and the capture; the rest lives in
``jit_call`` (the prologue: ``CallKey``, size classes, the program's argument layout), ``jit_examples``
(synthetic capture examples), ``jit_cross`` (cross-attention input checks) and ``jit_state`` (Python
state a forward keeps, weight identity).
"""

from __future__ import annotations

import inspect
import logging
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace._errors import CaptureError, KvtraceError, UnsupportedError, UsageError
from kvtrace.cache import hf as hfc
from kvtrace.capture.contract import Contract, model_line
from kvtrace.capture.preserve import preserved
from kvtrace.runtime import jit_examples

# Also re-exported: kvtrace.tools.lint imports _SEQ_DIM, _P_EX and _T_EX from here; the other names are
# the ones this module held before the split, so imports of them keep working.
from kvtrace.runtime.jit_call import (  # noqa: F401
    _FLAGS,
    _SEQ_DIM,
    CallKey,
    _Call,
    _carries_past,
    _held,
    _written,
    arg_names,
    arg_shapes,
    cache_dtype,
    program_args,
    read_call,
    size_classes,
)
from kvtrace.runtime.jit_cross import _CROSS, _check_cross_inputs, _image_tokens, _unmasked_cross  # noqa: F401
from kvtrace.runtime.jit_examples import _N_EX, _NC_EX, _P_EX, _T_CAUSAL_EX, _T_EX  # noqa: F401
from kvtrace.runtime.jit_state import _forward_keeps_no_state, _put_back, _python_state, _weights_token  # noqa: F401

__all__ = ["CallKey", "JitStats", "JittedModel", "jit"]

log = logging.getLogger("kvtrace")

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
class _Program:
    """A captured program and what it assumes of its argument shapes (checked before every run)."""

    run: Callable[..., Any]
    contract: Contract


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
        past = state.pop().shape[1] if _carries_past(self.key) else 0  # P of the sliding layers: [0, P]
        kind = self.key.cache
        if not kind.stateful:
            cache = None
        elif kind.static:
            cache = hfc.build_static(self.template, state, past)
        else:
            cache = hfc.build_dynamic(state, self.n_layers, _held(self.key), self.key.windows, past)
        if self.key.logits_to_keep:
            kwargs["logits_to_keep"] = self.key.logits_to_keep
        out = self.model(**kwargs, **{self.cache_kw: cache}, use_cache=kind.stateful, return_dict=True)
        if kind.dynamic:
            # written state: self layers [B, H_kv, P + T, D]; cross layers [B, H_kv, N_c + N, D] when given images;
            # sliding layers their new tail [B, H_kv, min(P + T, W - 1), D]
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
        if call.key.cache.static:  # HF's own lazy init, as eager does on first use
            hfc.ensure_static_initialized(
                call.cache, call.key.batch, self._n_kv, self._head_dim, cache_dtype(call), call.tensors[0].device
            )
        outs = program.run(*program_args(call))
        return self._epilogue(call, outs)

    # --- stage 1: prologue (jit_call.read_call) --------------------------------------------------
    def _prologue(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        return read_call(self, args, kwargs)

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
        return arg_shapes(call, self._n_layers, self._n_kv, self._head_dim)

    def _arg_names(self, key: CallKey) -> list[str]:
        return arg_names(key, self._n_layers)

    # --- stage 2: capture the computation (examples: jit_examples) ------------------------------
    def _export(self, call: _Call, exact: bool) -> tuple[torch.export.ExportedProgram, list[tuple[int, int]]]:
        template = None
        if call.key.cache.static:  # a structural copy; the caller's cache stays as it is
            template = hfc.static_template(call.cache)
            hfc.ensure_static_initialized(template, call.key.batch, self._n_kv, self._head_dim,
                                          cache_dtype(call), torch.device(call.key.device))
        step = _Step(self.model, call.key, self._n_layers, self._cache_kw, template)
        examples, shapes = jit_examples.examples(call, exact, self._n_layers, self._n_kv, self._head_dim)
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
                if hfc.length_of(call.key.layers[i]) == hfc.PAST for kv in (0, 1)}  # self layers' keys and values: P
        if _carries_past(call.key):
            past.add(len(names) - 1)  # the sliding layers' P: [0, P], the last argument
        contract = Contract(ep, names, waive=_causal_slice_waiver(call.key, past))
        if call.key.cache.filled or _carries_past(call.key):
            placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"][-len(names):]
            for a, d in baked:
                size = int(placeholders[a].meta["val"].shape[d])
                # size >= 2: not a 0/1 specialisation of an exact capture, the model fixed it. Below a sliding
                # window a regime may hold one P (a decode reaching the window: P = W - 2; crossing it: P = W - 1,
                # see jit_call.sliding_regime), so that is allowed; past the window (full) P must be symbolic.
                if a in past and size >= max(2, *call.key.windows, 0):
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
        return _COMPILERS[self.backend](self, ep)

    def _run_graph(self, ep: torch.export.ExportedProgram) -> Callable[..., Any]:
        """backend="eager": the exported graph itself.

        Capture uses example sizes >= 2 (torch.export specialises 0 and 1), so the exported range of a
        *derived* size such as the mask length P + T reads ">= 4". That bound is an artifact of the
        examples, not of the graph: the prologue checks the real invariants (mask = P + T, T >= 1), and
        tests run T = 1, P = 1 and P = 0 against eager. So call the graph itself, without the
        example-derived input-range hooks (AOTInductor has none either). Everything else the trace assumed
        (guards, baked sizes, equal sizes, range upper bounds) is the program's Contract, which __call__
        checks for both backends before running it.
        """
        return ep.module(check_guards=False).forward

    def _aoti(self, ep: torch.export.ExportedProgram) -> Callable[..., Any]:
        """backend="inductor": the graph compiled with AOTInductor into a fresh file."""
        from kvtrace.backends.aoti import aoti_compile

        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="kvtrace-jit-")
        return aoti_compile(ep, f"{self._workdir.name}/program{self.stats.captures}.pt2")  # never reuse a path

    # --- stage 3: epilogue --------------------------------------------------------------------
    def _epilogue(self, call: _Call, outs: Any) -> Any:
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        logits = outs[0]
        if call.key.cache.dynamic:
            written = _written(call.key)
            hfc.write_back_dynamic(call.cache, {i: (outs[1 + 2 * j], outs[2 + 2 * j]) for j, i in enumerate(written)})
            if call.key.windows:
                hfc.advance_sliding(call.cache, written, call.tensors[0].shape[1])
        elif call.key.cache.static and call.key.windows:  # the tensors were written in place by the program
            hfc.advance_static_sliding(call.cache, call.tensors[0].shape[1])
        return hfc.make_output(self.model, logits, call.cache, call.return_dict)


# jit's own backends (in-process; artifact backends live in kvtrace.backends): name -> how a capture runs
_COMPILERS: dict[str, Callable[[JittedModel, torch.export.ExportedProgram], Callable[..., Any]]] = {
    "inductor": JittedModel._aoti,
    "eager": JittedModel._run_graph,
}
BACKENDS = tuple(_COMPILERS)


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


def jit(model: torch.nn.Module, *, backend: str = "inductor", fallback: str | None = None) -> JittedModel:
    """Compile ``model.forward`` for HF-style calls with a KV cache.

    Args:
        model: an HF decoder-only causal LM (Llama, Qwen2, Qwen3, Mistral, Phi-3, ..., also with a sliding
            window and its ``DynamicCache(config=model.config)``) or Mllama's text
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
