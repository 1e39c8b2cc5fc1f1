"""kvtrace.export: source -> Decoder + CacheSpec -> captured programs -> backend files -> one artifact.

The orchestration only: capture lives in ``capture.export``, compilation in the backend the registry
names (``backends.registry``), the file format in ``artifact.archive`` / ``artifact.write``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import CaptureError, KvtraceError, UsageError, one_line
from kvtrace.artifact.write import dedupe_weights, program_signature, write_artifact
from kvtrace.backends import registry
from kvtrace.capture.export import capture_programs, with_prefill_logits
from kvtrace.models.step import slot_programs
from kvtrace.spec.manifest import Manifest, ModelInfo
from kvtrace.spec.program import program_specs

__all__ = ["export"]

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
                 image_tokens: int | None = None, kv_dtype: str | None = None
                 ) -> tuple[torch.nn.Module, torch.nn.Module | None, ModelInfo, str | None]:
    """(decoder, eager HF model or None, model info, tokenizer JSON or None) for a source string/path,
    an HF model or a Decoder."""
    from kvtrace.models.registry import make_decoder

    if isinstance(source, torch.nn.Module) and hasattr(source, "cache_spec"):
        if kv_dtype is not None and source.cache_spec.kv_dtype != kv_dtype:
            raise UsageError(f"kv_dtype={kv_dtype!r} asks for another cache than this Decoder declares "
                             f"(cache_spec.kv_dtype={source.cache_spec.kv_dtype!r}); a Decoder's cache_spec decides, "
                             "so leave kv_dtype unset or build the Decoder with it")
        return source, None, ModelInfo(model_name=type(source).__name__), None
    if isinstance(source, torch.nn.Module):
        model = source
        if any(t.dtype != dtype for t in model.parameters() if t.is_floating_point()):
            # nn.Module.to() converts in place; convert a copy so the caller's model is left untouched.
            model = copy.deepcopy(source).to(dtype)
        info = ModelInfo(model_name=type(model).__name__, model_type=model.config.model_type,
                         eos_ids=_eos(model.config), bos_id=getattr(model.config, "bos_token_id", None))
        return make_decoder(model, max_seq_len=max_seq_len, batch_size=batch_size, image_tokens=image_tokens,
                            kv_dtype=kv_dtype), model, info, None
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
    decoder = make_decoder(loaded.model, max_seq_len=max_seq_len, batch_size=batch_size, image_tokens=image_tokens,
                           kv_dtype=kv_dtype)
    return decoder, loaded.model, info, tokenizer_json


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
            manifest, the Session and ``kvtrace verify`` know it. Llama-family decoders (LlamaDecoder) only.
        slots: N conversation slots (``kvtrace serve``): the cache holds N independent rows
            (``CacheSpec.batch_size = N``) and the programs are ``step.SLOT_PROGRAMS`` — prefill one slot,
            decode any set of slots, each row at its own position (``ProgramSpec.slots``); such an artifact
            runs under ``kvtrace.SlotEngine`` (``Artifact.slot_engine()``), not a Session. Llama-family
            decoders with full-attention layers; None (default): an ordinary artifact of ``batch_size`` rows.
        progress: ``progress(what)`` returns a context manager around each phase (the CLI shows them);
            None for none.
    """
    chosen = registry.get(backend)
    tdtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if tdtype not in DTYPES.values():
        raise UsageError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    kv_dtype = _kv_dtype(kv_dtype)
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
        decoder, model, info, tokenizer_json = _from_source(source, dtype=tdtype, max_seq_len=max_seq_len,
                                                            batch_size=batch_size, image_tokens=image_tokens,
                                                            kv_dtype=kv_dtype)
    if slots is not None and decoder.cache_spec.batch_size != slots:
        raise UsageError(f"slots={slots} asks for {slots} cache rows, but this Decoder's cache_spec has batch_size "
                         f"{decoder.cache_spec.batch_size}; build the Decoder with batch_size={slots}")
    declared = slot_programs(decoder) if slots is not None else program_specs(decoder)
    programs = with_prefill_logits(declared, prefill_logits, decoder)
    chosen.check_programs([p.name for p in programs], info.model_name or type(decoder).__name__)
    try:
        with progress("capturing programs (torch.export)"):
            # only what the backend compiles: aoti-packed's one program is prefill's (T symbolic; it serves decode too)
            eps = capture_programs(decoder, tuple(chosen.compiled({p.name: p for p in programs}).values()))
            weights = _weights(eps)
        compiled = chosen.compiled(eps)  # compiled program name -> captured program
        with progress(chosen.compile_label):
            files = chosen.compile(compiled, decoder.cache_spec.torch_dtype)
    except KvtraceError:
        raise
    except Exception as e:
        raise CaptureError(
            f"exporting {info.model_name or type(decoder).__name__} failed ({backend}): {one_line(e)}"
        ) from e
    unique, aliases = ({}, {}) if chosen.packs_weights else dedupe_weights(weights)  # packed: in the program
    vocab = model.config.get_text_config(decoder=True).vocab_size if model is not None else _vocab(eps["prefill"])
    from kvtrace import __version__

    manifest = Manifest(
        backend=backend,
        cache_spec=decoder.cache_spec,
        vocab_size=vocab,
        programs={p.name: p for p in programs},
        **asdict(info),
        generation={"temperature": 0.0, "top_k": None, "top_p": None, "max_new_tokens": 256},
        weight_aliases=aliases,
        kvtrace_version=__version__,
        torch_version=torch.__version__,
        export_seconds=round(time.perf_counter() - t0, 3),
        # what each compiled program takes, checked at load against the CacheSpec (aoti-packed: one "step")
        signatures={n: program_signature(ep) for n, ep in compiled.items()},
    )
    return write_artifact(path, manifest, unique, files, tokenizer_json)


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
