"""Capture: a Decoder + CacheSpec -> one torch.export program per declared ProgramSpec.

The torch.export glue, kept thin:
  prefill = export(decoder, (tokens[B, T], input_pos[T], *cache))   T symbolic in [1, max_seq_len]
  decode  = export(decoder, (tokens[B, 1], input_pos[1], *cache))
The cache tensors are program inputs that the programs update in place; a Session allocates them
from the CacheSpec with their declared initial values. Every example input is made on the decoder's own
device (its parameters'), so a decoder on a GPU is captured — and then compiled — for that GPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any

import torch

from kvtrace._errors import CaptureError, UsageError
from kvtrace.capture.preserve import preserved
from kvtrace.spec.program import LOGITS, InputSpec, ProgramSpec, program_specs

__all__ = ["capture_programs", "device_of", "method_module", "with_prefill_logits"]

def capture_programs(decoder: torch.nn.Module, programs: tuple[ProgramSpec, ...] | None = None,
                     one_row: bool = False) -> dict[str, torch.export.ExportedProgram]:
    """Export every program the decoder declares (``program_specs``), or those given: prefill (T
    symbolic), decode (T = 1) and any others (e.g. a vision decoder's image prefill), all over the same
    cache signature. Each capture leaves ``decoder`` (and the HF model it wraps) as it was (``preserved``).
    ``one_row``: slots programs captured for exactly one row (R = 1 static; ``aoti_packed.DECODE_ONE``)."""
    from torch.export import Dim

    spec = decoder.cache_spec
    dev = device_of(decoder)
    eps = {}
    for p in programs if programs is not None else program_specs(decoder):
        # example length >= 2 keeps T symbolic; a one-slot cache has nothing to be symbolic about
        # (and Dim refuses min == max), so its prefill is T = 1. Likewise R (a slots program's rows).
        t = 1 if p.single_token else min(3, spec.max_seq_len)
        r = 1 if one_row else min(2, spec.batch_size)
        if p.key_pos and spec.max_seq_len < t + 2:
            raise CaptureError(f"program {p.name} takes key_pos, which needs max_seq_len >= {t + 2}; "
                               f"this cache holds {spec.max_seq_len}")
        args = (*_example_spine(p, spec.batch_size, t, r, dev),
                *(_example_input(i, spec.batch_size, t, dev) for i in p.inputs), *spec.allocate(dev))
        method = method_module(decoder, p)
        shapes = None
        if t > 1 or p.key_pos or (p.slots and r > 1):
            shapes = _dynamic_shapes(method, args, p, Dim("T", min=1, max=spec.max_seq_len) if t > 1 else None,
                                     Dim("L", min=1, max=spec.max_seq_len),
                                     Dim("R", min=1, max=spec.batch_size) if p.slots and r > 1 else None)
        with torch.no_grad(), preserved(decoder, what=f"the model ({type(decoder).__name__})"), \
                _size_oblivious(p.key_pos and p.single_token and not p.slots
                                and getattr(decoder, "fused_attention", False)):
            eps[p.name] = torch.export.export(method, args, dynamic_shapes=shapes, strict=False)
    return eps


def _size_oblivious(on: bool) -> contextlib.AbstractContextManager[None]:
    """Decode programs of decoders whose full layers attend in ``llama.cached_attention`` (``fused_attention``)
    read the live prefix as a view (``cache.full.live``): L of S slots. Node metadata asks whether such a view
    is contiguous, true only at L == S, and with the symbol L backed that question becomes the guard L != S,
    outside L's declared range [1, S] (export refuses). Size-oblivious capture answers it for all sizes alike
    ("not contiguous") without a guard. Only there: with T symbolic (prefill) Phi-3 got a guard T != 1 of its
    own, and a matmul over such a view (Gemma-2's soft-capped attention) the guard L != 1; those gather."""
    if not on:
        return contextlib.nullcontext()
    from torch.fx.experimental import _config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


def _example_spine(p: ProgramSpec, batch: int, t: int, r: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """tokens, input_pos (, key_pos [t + 2]: an example L unequal to T and >= 2 keeps L its own symbol)
    (, slots: rows 0 .. r-1, each at positions 0 .. t-1), on ``device``."""
    out = []
    for name, shape, _ in p.spine(batch, t, rows=r, keys=t + 2):
        if name == "tokens":
            out.append(torch.zeros(shape, dtype=torch.int64, device=device))
        elif name == "input_pos":
            out.append(torch.arange(t, device=device).expand(shape).contiguous())
        else:  # key_pos [L], slots [R]
            out.append(torch.arange(shape[0], device=device))
    return tuple(out)


def _example_input(i: InputSpec, batch: int, t: int, device: torch.device) -> torch.Tensor:
    return torch.full(i.concrete(batch, t), i.default if i.default is not None else 0.0, dtype=i.torch_dtype,
                      device=device)


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of a module's parameters and buffers (CPU for one that has none); CaptureError when they
    are spread over several devices (a program is compiled for one)."""
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    if len(devices) > 1:
        raise CaptureError(f"{type(module).__name__} has parameters or buffers on {sorted(map(str, devices))}; "
                           "move it to one device (e.g. .to('cuda')) before exporting")
    return devices.pop() if devices else torch.device("cpu")


def method_module(decoder: torch.nn.Module, program: ProgramSpec) -> torch.nn.Module:
    """``decoder`` itself, or a shallow copy whose ``forward`` is another method and/or whose
    ``last_logits`` is set: the same parameter objects under the same names, so every program shares
    one weight set."""
    method, last = program.method, program.logits == "last"
    if method == "forward" and not last:
        return decoder
    fn = getattr(decoder, method, None)
    if not callable(fn):
        raise CaptureError(f"{type(decoder).__name__} declares a program of method {method!r}, which it lacks")
    alias = copy.copy(decoder)
    if last:
        alias.last_logits = True
    alias.forward = getattr(alias, method)  # bound to the copy, so it sees last_logits
    return alias


def with_prefill_logits(programs: tuple[ProgramSpec, ...], logits: str, decoder: torch.nn.Module
                        ) -> tuple[ProgramSpec, ...]:
    """The programs with ``logits`` applied to every T-symbolic one (decode returns one row either way)."""
    if logits not in LOGITS:
        raise UsageError(f"prefill_logits must be one of {LOGITS}, got {logits!r}")
    if logits == "last" and not hasattr(type(decoder), "last_logits"):
        raise UsageError(
            f"prefill_logits='last' needs a Decoder that can run its head on the last position only (a class "
            f"attribute last_logits, as LlamaDecoder, MllamaDecoder and HFDecoder have); {type(decoder).__name__} "
            "has none. Export with prefill_logits='all'"
        )
    return tuple(p if p.single_token else dataclasses.replace(p, logits=logits) for p in programs)


def _dynamic_shapes(fn: torch.nn.Module, args: tuple[Any, ...], program: ProgramSpec, t: Any,
                    n_keys: Any, rows: Any = None) -> tuple[Any, ...]:
    """``dynamic_shapes`` shaped like ``fn.forward``'s parameters: T symbolic (``t``; None for a
    one-token program) in tokens, input_pos and every declared input dim named "T"; L (``n_keys``) in
    key_pos; R (``rows``; None for a one-row cache) in a slots program's tokens, input_pos and slots;
    the cache is static.

    torch.export matches ``dynamic_shapes`` to the signature, so ``forward(tokens, input_pos, *state)``
    needs ``(tok, pos, (None, ...))`` while ``forward(tokens, input_pos, k0, v0, bias)`` needs a flat tuple.
    """
    inputs = program.inputs
    per_input = [{d: t for d, size in enumerate(i.shape) if size == "T"} or None if t is not None else None
                 for i in inputs]
    sizes = {"T": t, "L": n_keys, "R": rows}
    spine = [{d: sizes[s] for d, s in enumerate(shape) if sizes.get(s) is not None} or None
             for _, shape, _ in program.spine()]  # tokens, input_pos (, key_pos, slots)
    n_state = len(args) - len(spine) - len(inputs)
    flat = [*spine, *per_input, *[None] * n_state]
    sig = inspect.signature(fn.forward)
    try:
        bound = sig.bind(*args).arguments
    except TypeError as e:
        raise CaptureError(
            f"{type(fn).__name__}.forward{sig} cannot take ({', '.join(n for n, _, _ in program.spine())}, "
            f"{len(inputs)} input(s), *state) with {n_state} state tensors (its cache_spec's buffers): {e}"
        ) from e
    out: list[Any] = []
    i = 0
    for name, val in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            out.append(tuple(flat[i : i + len(val)]))
            i += len(val)
        else:
            out.append(flat[i])
            i += 1
    return tuple(out)


def _example_args(ep: torch.export.ExportedProgram) -> tuple[Any, ...]:
    args, _ = ep.example_inputs
    return args


