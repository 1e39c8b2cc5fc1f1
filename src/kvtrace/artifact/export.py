"""kvtrace.export: source -> Decoder + CacheSpec -> captured programs -> backend files -> one artifact.

The orchestration only: capture lives in ``capture.export``, compilation in the backend the registry
names (``backends.registry``), the file format in ``artifact.archive`` / ``artifact.write``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import CaptureError, KvtraceError, UnsupportedError, UsageError, one_line
from kvtrace.artifact.write import dedupe_weights, program_signature, write_artifact
from kvtrace.backends import registry
from kvtrace.backends.cpu_isa import compiled_features
from kvtrace.capture.export import capture_programs, with_prefill_logits
from kvtrace.models.step import slot_programs
from kvtrace.spec.device import check_available, concrete
from kvtrace.spec.device import resolve as resolve_device
from kvtrace.spec.manifest import Manifest, ModelInfo
from kvtrace.spec.program import ProgramSpec, program_specs
from kvtrace.spec.quant import QuantSpec, parse_quant

__all__ = ["backend_quant", "export", "from_source", "make_manifest"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _weights(eps: dict[str, torch.export.ExportedProgram]) -> dict[str, torch.Tensor]:
    from kvtrace.backends.aoti import weights_of

    out: dict[str, torch.Tensor] = {}
    for ep in eps.values():
        for name, t in weights_of(ep).items():
            if name in out and out[name].data_ptr() != t.data_ptr():
                prev = out[name]
                if prev.shape == t.shape and prev.dtype == t.dtype and torch.equal(prev, t):
                    continue  # e.g. a constant lifted by each capture: same value, store it once
                raise CaptureError(f"programs disagree about weight {name}; they must share one weight set")
            out[name] = t
    return out


def _from_source(source: Any, *, dtype: torch.dtype, max_seq_len: int, batch_size: int,
                 image_tokens: int | None = None, kv_dtype: str | None = None, device: torch.device | None = None,
                 quant: QuantSpec | None = None
                 ) -> tuple[torch.nn.Module, torch.nn.Module | None, ModelInfo, str | None, QuantSpec | None]:
    """(decoder, eager HF model or None, model info, tokenizer JSON or None, the quantization applied) for a
    source string/path, an HF model or a Decoder, on ``device`` (default CPU). A caller's model or Decoder on
    another device or in another dtype is converted on a copy: theirs is left where and as it was."""
    from kvtrace.capture.export import device_of
    from kvtrace.models.registry import make_decoder

    device = device or torch.device("cpu")
    if isinstance(source, torch.nn.Module) and hasattr(source, "cache_spec"):
        if kv_dtype is not None and source.cache_spec.kv_dtype != kv_dtype:
            raise UsageError(f"kv_dtype={kv_dtype!r} asks for another cache than this Decoder declares "
                             f"(cache_spec.kv_dtype={source.cache_spec.kv_dtype!r}); a Decoder's cache_spec decides, "
                             "so leave kv_dtype unset or build the Decoder with it")
        # moved or quantized on a copy: the caller's decoder keeps its device and weights
        keep = device_of(source) == device and quant is None
        decoder = source if keep else copy.deepcopy(source).to(device)
        if quant is not None:
            decoder, quant = _quantized(decoder, quant, None, type(source).__name__)
        return decoder, None, ModelInfo(model_name=type(source).__name__), None, quant
    if isinstance(source, torch.nn.Module):
        model = source
        if any(t.dtype != dtype for t in model.parameters() if t.is_floating_point()) or device_of(model) != device:
            # nn.Module.to() converts in place; convert a copy so the caller's model is left untouched.
            model = copy.deepcopy(source).to(device=device, dtype=dtype)
        info = ModelInfo(model_name=type(model).__name__, model_type=model.config.model_type,
                         eos_ids=_eos(model.config), bos_id=getattr(model.config, "bos_token_id", None))
        _check_quant_family(model, quant)
        decoder = make_decoder(model, max_seq_len=max_seq_len, batch_size=batch_size, image_tokens=image_tokens,
                               kv_dtype=kv_dtype)
        decoder, quant = _quantized(decoder, quant, None, info.model_name)
        return decoder.to(device), model, info, None, quant
    from kvtrace.sources.load import load_model

    loaded = load_model(source, dtype=dtype)
    info = ModelInfo(
        model_name=loaded.source.name,
        model_type=loaded.model.config.model_type,
        source_digest=loaded.source.digest,
        bos_id=loaded.bos_id,
        eos_ids=tuple(loaded.eos_ids),
        chat_template=loaded.chat_template,
    )
    tokenizer_json = loaded.tokenizer.to_str() if loaded.tokenizer is not None else None
    model = loaded.model.to(device)  # our own copy: the decoder reads its RoPE tables where eager computes them
    _check_quant_family(model, quant)
    decoder = make_decoder(model, max_seq_len=max_seq_len, batch_size=batch_size, image_tokens=image_tokens,
                           kv_dtype=kv_dtype)
    blocks = None
    if quant is not None and quant.scheme == "gguf":
        if loaded.source.kind not in ("gguf", "default"):
            raise UsageError(f"quant='gguf' keeps a GGUF file's own blocks, but {loaded.source.name} is a "
                             f"{loaded.source.kind} source; pass a .gguf file, or use quant='int8' / 'int4'")
        from kvtrace.sources.gguf_blocks import GGUFBlocks

        blocks = GGUFBlocks(loaded.source.path)
    decoder, quant = _quantized(decoder, quant, blocks, info.model_name)
    return decoder.to(device), model, info, tokenizer_json, quant


def _check_quant_family(model: torch.nn.Module, quant: QuantSpec | None) -> None:
    """Quantization rewrites a decoder's modules, so only families whose decoder owns its weights take it."""
    if quant is None:
        return
    from kvtrace.models.registry import families, family_for

    family = family_for(model.config)
    if not family.quant:
        takes = sorted(f.name for f in families() if f.quant)
        raise UnsupportedError(f"the {family.name} decoder ({model.config.model_type!r}) does not take quantized "
                               f"weights; quant={quant.scheme!r} is offered by the {', '.join(takes)} decoder(s). "
                               "Export without quant")


def _quantized(decoder: torch.nn.Module, quant: QuantSpec | None, blocks: Any,
               name: str) -> tuple[torch.nn.Module, QuantSpec | None]:
    if quant is None:
        return decoder, None
    from kvtrace.models.quant import quantize_decoder

    done = quantize_decoder(decoder, quant, gguf=blocks)
    if not done.tensors:
        raise UnsupportedError(f"quant={quant.scheme!r} found nothing to quantize in {name}"
                               + (f" ({next(iter(done.dequantized.values()))})" if done.dequantized else "")
                               + "; export without quant")
    return decoder, done


def _eos(config: Any) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def export(
    source: Any,
    path: str | os.PathLike[str],
    *,
    max_seq_len: int = 512,
    dtype: str | torch.dtype = "float32",
    batch_size: int = 1,
    backend: str = "exported",
    image_tokens: int | None = None,
    prefill_logits: str = "all",
    kv_dtype: str | None = None,
    device: str | torch.device = "cpu",
    quant: str | QuantSpec | None = None,
    quant_group_size: int | None = None,
    quant_head: bool = True,
    slots: int | None = None,
    progress: Callable[[str], AbstractContextManager[Any]] | None = None,
) -> Path:
    """Export a decoder with its KV cache to one artifact file.

    Args:
        source: a model name (``"smollm2-135m-instruct"``), a local HF model directory, a Llama-family
            GGUF file, an HF causal LM object (left untouched; converted on a copy if its dtype differs), or a
            Decoder module (with a ``cache_spec``, which then decides max_seq_len, batch and dtype).
        path: the artifact file to write (written atomically: on any error nothing is left behind and an
            existing file at ``path`` is kept).
        max_seq_len: cache capacity; prompt + generated tokens must fit.
        dtype: ``"float32"`` or ``"bfloat16"``.
        batch_size: rows per call (static).
        backend: ``"exported"`` (portable torch.export programs), ``"aoti"`` (AOTInductor-compiled) or
            ``"aoti-packed"`` (AOTInductor with the weights frozen into the program and prepacked for the CPU
            matmul kernels — in bf16 also max-autotune over Inductor's GEMM templates (AMX): the fastest
            decode; one program serves prefill and decode and carries the weights, so the artifact holds no
            separate weights file; decoders with only prefill and decode programs; see ``inductor_options``).
        image_tokens: vision decoders only (Llama 3.2 Vision's ``MllamaForCausalLM``): N of the image
            features ``cross_attention_states [B, N, dim]`` the cross-attention cache holds
            (default 6404 = 4 tiles x 1601, as the HF processor pads every image).
        prefill_logits: ``"all"`` — prefill returns logits ``[B, T, V]`` for every prompt position (what
            the eager model returns); ``"last"`` — ``[B, 1, V]``, the last position only, which is all a
            generation samples from: the vocabulary projection runs on one row instead of T (on the
            default model ~20 % of a 37-token prefill's FLOPs). Recorded per program in the manifest.
        kv_dtype: None or ``"auto"`` — K/V held in ``dtype``; ``"int8"`` — int8 K/V with a float16 scale per
            token and KV head (``kvtrace.cache.int8``), about 0.27-0.28x the bytes of a float32 cache, quantized on
            write and dequantized on read inside the programs; declared in the CacheSpec (``kv_dtype``), so the
            manifest, the Session and ``kvtrace verify`` know it. Every text decoder (not the vision decoder).
        device: ``"cpu"`` (default) or ``"cuda"`` (``"cuda:N"``): the decoder, its weights and the example
            inputs are put there before capture, so the programs are captured and compiled for that device
            (AOTInductor: CUDA kernels); the manifest records the device type (``Manifest.device``) and loading
            checks it. The caller's model stays where it was (a copy is moved).
        quant: None / ``"none"`` — weights in ``dtype``; ``"int8"`` (per output channel), ``"int4"`` (groups of
            ``quant_group_size``, default 32, scale and zero each), ``"8da4w"`` (int4 weights, int8 dynamic
            activations), each computed by torch's CPU kernels with bf16 activations; ``"gguf"`` — a GGUF source's
            own Q4_0/Q4_1/Q8_0 blocks kept as stored and computed with exactly those numbers in float32 (other
            tensor types dequantized, recorded). ``quant_head``: int8/int4/8da4w also store the embedding and output
            head as int8. The module-by-module choice is recorded in the manifest (``Manifest.quant``), and
            ``kvtrace verify`` judges the artifact against the same quantized weights run eagerly
            (``kvtrace.spec.quant``, ``kvtrace.models.quant``). Llama-family decoders only.
        slots: N conversation slots (``kvtrace serve``): the cache holds N independent rows
            (``CacheSpec.batch_size = N``) and the programs are ``step.SLOT_PROGRAMS`` — prefill one slot,
            decode any set of slots, each row at its own position (``ProgramSpec.slots``); such an artifact
            runs under ``kvtrace.SlotEngine`` (``Artifact.slot_engine()``), not a Session. Text decoders
            (``llama``, ``gemma``, the general HF path) of full and sliding layers, model-dtype or int8 K/V
            (``models.step.slot_programs`` names what it refuses); None (default): an ordinary artifact of
            ``batch_size`` rows.
        progress: ``progress(what)`` returns a context manager around each phase (the CLI shows them);
            None for none.
    """
    chosen = registry.get(backend)
    tdtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if tdtype not in DTYPES.values():
        raise UsageError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    chosen.check_dtype(tdtype)
    kv_dtype = _kv_dtype(kv_dtype)
    dev = resolve_device(device, what="export device")
    if dev.type == "meta":
        raise UsageError("export device must be cpu or cuda; meta tensors hold no weights to export")
    qspec = parse_quant(quant, quant_group_size, quant_head)
    if qspec is not None and qspec.scheme == "gguf" and chosen.packs_weights:
        # one program serves prefill and decode, so every matmul takes the dequantize-then-multiply path, and
        # freezing folds that into float32 weights: the blocks would not survive into the program
        raise UnsupportedError(f"quant='gguf' with backend {backend!r}: its one program would fold the GGUF blocks "
                               "into float32 weights (prefill and decode share it); use backend 'aoti' (or 'exported')")
    if qspec is not None and dev.type != "cpu":
        # the quantized matmuls are torch's CPU weight-only kernels (int8 / int4 / 8da4w) or GGUF-block code
        # written and checked on CPU only
        raise UnsupportedError(f"quant={qspec.scheme!r} on device {dev}: quantized weights are computed by CPU kernels "
                               "only; export with device='cpu', or without quant for a GPU")
    qspec = backend_quant(backend, qspec)
    if chosen.standalone and (dev.type != "cpu" or slots is not None):
        raise UnsupportedError(f"backend {backend!r} writes a CPU program for one conversation; "
                               + (f"device {dev}" if dev.type != "cpu" else f"slots={slots}")
                               + " is not offered with it yet. Use backend 'aoti', or export without it")
    check_available(dev, f"export to device {dev}")
    dev = concrete(dev)
    if max_seq_len < 1 or batch_size < 1:
        raise UsageError(f"max_seq_len and batch_size must be >= 1, got {max_seq_len} and {batch_size}")
    if slots is not None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise UsageError(f"slots must be a whole number >= 1 (conversation slots), got {slots!r}")
        if batch_size not in (1, slots):
            raise UsageError(f"slots={slots} sets the cache's rows; leave batch_size unset (got {batch_size})")
        batch_size = slots
    path = Path(path)
    if path.is_dir():  # fail before minutes of capture and compilation, not after
        raise UsageError(f"output path {path} is a directory; expected a file name such as model.kvt")
    t0 = time.perf_counter()
    progress = progress or (lambda what: contextlib.nullcontext())
    with progress("loading model (GGUF is converted once, then cached)"):
        decoder, model, info, tokenizer_json, qspec = _from_source(
            source, dtype=tdtype, max_seq_len=max_seq_len, batch_size=batch_size, image_tokens=image_tokens,
            kv_dtype=kv_dtype, device=dev, quant=qspec)
    if qspec is not None and qspec.dequantized:  # said, not silent: which weights stay float and why
        (name, why), more = next(iter(qspec.dequantized.items())), len(qspec.dequantized) - 1
        with progress(f"weights {qspec.describe()}; kept in {str(tdtype).removeprefix('torch.')}: {name} ({why})"
                      + (f" and {more} more" if more else "")):
            pass
    if slots is not None and decoder.cache_spec.batch_size != slots:
        raise UsageError(f"slots={slots} asks for {slots} cache rows, but this Decoder's cache_spec has batch_size "
                         f"{decoder.cache_spec.batch_size}; build the Decoder with batch_size={slots}")
    declared = slot_programs(decoder) if slots is not None else program_specs(decoder)
    programs = chosen.program_specs(with_prefill_logits(declared, prefill_logits, decoder), decoder)
    chosen.check_programs([p.name for p in programs], info.model_name or type(decoder).__name__)

    def manifest(aliases: dict[str, str]) -> Manifest:
        vocab = model.config.get_text_config(decoder=True).vocab_size if model is not None else _vocab(eps["prefill"])
        return dataclasses.replace(
            make_manifest(backend, decoder, info, programs, vocab),
            weight_aliases=aliases,
            quant=qspec,
            device=dev.type,
            cpu_features=compiled_features() if chosen.native_code else None,
            export_seconds=round(time.perf_counter() - t0, 3),
            # what each compiled program takes, checked at load against the CacheSpec (aoti-packed: one "step")
            signatures={n: program_signature(ep) for n, ep in compiled.items()},
        )

    try:
        with progress("capturing programs (torch.export)"):
            # only what the backend compiles: aoti-packed's one program (and aoti's, where decode is served_by
            # prefill) is prefill's, T symbolic, serving decode too
            wanted = chosen.compiled({p.name: p for p in programs})  # compiled program name -> ProgramSpec
            eps = chosen.capture(decoder, tuple(wanted.values()))
            if eps is None:  # the standard capture: the cache as inputs updated in place
                eps = capture_programs(decoder, tuple(wanted.values()))
            weights = {} if chosen.packs_weights else _weights(eps)
        compiled = {n: eps[p.name] for n, p in wanted.items()}  # compiled program name -> captured program
        # a backend's variants captured on their own (aoti-packed's one-row slots decode): compiled and packaged
        # beside the programs, loaded where the package holds them, signed by the program they stand in for
        variants = {n: ep for n, ep in eps.items() if n in getattr(chosen, "captured_variants", {})}
        with progress(chosen.compile_label):
            if chosen.standalone:  # its own file (e.g. a .pte), the manifest inside; export_seconds: up to lowering
                return chosen.export_file(path, manifest({}), compiled, decoder.cache_spec.torch_dtype, tokenizer_json)
            files = chosen.compile({**compiled, **variants}, decoder.cache_spec.torch_dtype)
    except KvtraceError:
        raise
    except Exception as e:
        raise CaptureError(
            f"exporting {info.model_name or type(decoder).__name__} failed ({backend}): {one_line(e)}"
        ) from e
    unique, aliases = ({}, {}) if chosen.packs_weights else dedupe_weights(weights)  # packed: in the program
    return write_artifact(path, manifest(aliases), unique, files, tokenizer_json,
                          deflate_programs=not chosen.packs_weights)


def make_manifest(backend: str, decoder: torch.nn.Module, info: ModelInfo, programs: tuple[ProgramSpec, ...],
                  vocab: int) -> Manifest:
    """The manifest of ``decoder``'s ``programs`` (before the writer records members, weights and signatures)."""
    from kvtrace import __version__

    return Manifest(
        backend=backend,
        cache_spec=decoder.cache_spec,
        vocab_size=vocab,
        programs={p.name: p for p in programs},
        **asdict(info),
        generation={"temperature": 0.0, "top_k": None, "top_p": None, "max_new_tokens": 256},
        kvtrace_version=__version__,
        torch_version=torch.__version__,
    )


def backend_quant(backend: str, qspec: QuantSpec | None) -> QuantSpec | None:
    """``qspec`` as ``backend``'s kernels compute it (``QuantSpec.computed_with``: recorded where they compute the
    scheme their own way, e.g. ExecuTorch's 8da4w), or UnsupportedError naming the schemes it offers."""
    if qspec is None:
        return None
    chosen = registry.get(backend)
    act = chosen.quant_activations(qspec.scheme)
    if act is None:
        from kvtrace.spec.quant import SCHEMES

        offered = [s for s in SCHEMES if chosen.quant_activations(s) is not None]
        raise UnsupportedError(f"backend {backend!r} does not offer quant={qspec.scheme!r}; it takes "
                               f"{' / '.join(map(repr, offered)) or 'no quantized weights'}. Use one of those, or "
                               "backend 'aoti'")
    return qspec.computed_with(act)


def from_source(source: Any, *, dtype: str | torch.dtype, max_seq_len: int, batch_size: int = 1,
                kv_dtype: str | None = None, quant: str | QuantSpec | None = None,
                quant_group_size: int | None = None, quant_head: bool = True,
                ) -> tuple[torch.nn.Module, int, ModelInfo, str | None, QuantSpec | None]:
    """(decoder, vocab_size, model info, tokenizer JSON or None, quantization applied or None) of a model source,
    as ``export`` builds them (with ``quant``: its quantized weights, as the artifact of that quantization
    computes them). CPU only."""
    tdtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if tdtype not in DTYPES.values():
        raise UsageError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    decoder, model, info, tokenizer_json, qspec = _from_source(
        source, dtype=tdtype, max_seq_len=max_seq_len, batch_size=batch_size, kv_dtype=_kv_dtype(kv_dtype),
        quant=parse_quant(quant, quant_group_size, quant_head))
    if model is None:
        raise UsageError("from_source takes a model source or an HF model, not a Decoder")
    return decoder, model.config.get_text_config(decoder=True).vocab_size, info, tokenizer_json, qspec


def _kv_dtype(kv_dtype: Any) -> str | None:
    """None / "auto" -> None (K/V in the model's dtype); a quantized name as CacheSpec declares it."""
    from kvtrace.spec.cache import KV_DTYPES

    if kv_dtype is None or kv_dtype == "auto":
        return None
    if kv_dtype not in KV_DTYPES:
        raise UsageError(f"kv_dtype must be 'auto' (K/V in the model's dtype) or one of {list(KV_DTYPES)}, "
                         f"got {kv_dtype!r}")
    return kv_dtype


def _vocab(ep: torch.export.ExportedProgram) -> int:
    """V of the logits output (the one user output; mutated state may be listed among the graph outputs)."""
    (logits,) = ep.graph_signature.user_outputs
    node = next(n for n in ep.graph.nodes if n.name == logits)
    return int(node.meta["val"].shape[-1])
