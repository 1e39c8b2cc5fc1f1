"""Loading a resolved source as an HF causal LM with its fast tokenizer, offline.

HF directories load directly. GGUF files are converted once (``sources.gguf_convert``: transformers'
conversion, bit for bit, in seconds), refused unless every weight came from the file whole and finite, and
the result is cached as plain safetensors under ``cache_dir()/models/<digest>/`` (``sources.store``); later
loads take about a second. transformers is imported lazily.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtrace._errors import SourceError, UnsupportedError
from kvtrace.sources.resolve import ModelSource, resolve_source
from kvtrace.sources.store import FORMAT, cache_dir

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedModel

__all__ = ["LoadedModel", "load_model"]


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference plus what is needed to tokenize without transformers."""

    model: PreTrainedModel  # eval(), requires_grad_(False), in the requested dtype
    tokenizer: tokenizers.Tokenizer  # the `tokenizers` object: save()/from_file() need no transformers
    chat_template: str | None  # jinja2 source
    bos_id: int | None
    eos_ids: tuple[int, ...]
    source: ModelSource
    load_seconds: float
    cache_hit: bool  # True if the dequantized weights came from the safetensors cache


def load_model(
    source: ModelSource | str | os.PathLike | None, *, dtype: torch.dtype = torch.float32
) -> LoadedModel:
    """Load `source` (resolving it first if needed) offline, in `dtype`, with its fast tokenizer."""
    src = source if isinstance(source, ModelSource) else resolve_source(source)
    t0 = time.perf_counter()
    if src.kind == "hf_dir":
        from transformers import AutoTokenizer

        model = _from_pretrained(src.path, dtype)
        try:
            hf_tok = AutoTokenizer.from_pretrained(src.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise SourceError(
                f"{src.path} has no loadable tokenizer ({e}); expected tokenizer.json next to config.json"
            ) from e
        if not hasattr(hf_tok, "backend_tokenizer"):
            raise UnsupportedError(
                f"{src.path} has a slow tokenizer ({type(hf_tok).__name__}); expected a tokenizer.json. Convert it with transformers first."
            )
        meta, tok, hit = _tok_meta(hf_tok, model.config, getattr(model, "generation_config", None)), hf_tok.backend_tokenizer, False
    else:
        import tokenizers

        entry = cache_dir() / "models" / src.digest
        hit = (entry / "kvtrace.json").is_file()  # entries appear by atomic rename: present == complete
        if hit:
            try:
                model = _from_pretrained(entry, dtype)
            except Exception:  # a damaged entry (disk full, hand edits): rebuild it
                shutil.rmtree(entry, ignore_errors=True)
                hit = False
        if not hit:
            _convert_gguf(src, entry)
            model = _from_pretrained(entry, dtype)  # same code path as a hit, so both loads are identical
        meta = json.loads((entry / "kvtrace.json").read_text())
        tok = tokenizers.Tokenizer.from_file(str(entry / "tokenizer.json"))
    return LoadedModel(
        model=model,
        tokenizer=tok,
        chat_template=meta["chat_template"],
        bos_id=meta["bos_id"],
        eos_ids=tuple(meta["eos_ids"]),
        source=src,
        load_seconds=time.perf_counter() - t0,
        cache_hit=hit,
    )


def _from_pretrained(path: Path, dtype: torch.dtype, **kw: Any) -> Any:
    """The model in eval mode without grads (and, with ``output_loading_info=True``, transformers'
    loading info: ``(model, info)``)."""
    from transformers import AutoModelForCausalLM

    cls: Any = AutoModelForCausalLM
    if _model_type(path) == "mllama_text_model":  # a saved MllamaForCausalLM: not in the auto mapping
        from transformers import MllamaForCausalLM

        cls = MllamaForCausalLM
    try:
        model = cls.from_pretrained(path, dtype=dtype, local_files_only=True, **kw)
    except (OSError, ValueError, KeyError) as e:
        raise SourceError(
            f"transformers could not load a causal LM from {path} ({type(e).__name__}: {e}); check the files are complete"
        ) from e
    if isinstance(model, tuple):
        return model[0].eval().requires_grad_(False), model[1]
    return model.eval().requires_grad_(False)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _dequantize_gguf(src: ModelSource) -> tuple[Any, Any, Any, dict[str, torch.Tensor]]:
    """(config, generation config, HF tokenizer, fp32 state dict) converted from the GGUF
    (``sources.gguf_convert``: what transformers' conversion gives, in seconds), refused unless every weight
    came from the file, whole and finite: a conversion that invents, drops or mis-sizes a tensor never
    reaches the cache."""
    from transformers import GenerationConfig

    from kvtrace.sources.gguf import check_gguf
    from kvtrace.sources.gguf_convert import convert_gguf

    where = f"{src.path}"
    try:
        conv = convert_gguf(src.path, check_gguf(src.path))
        generation = GenerationConfig.from_model_config(conv.config)
    except SourceError:
        raise
    except Exception as e:  # transformers' or gguf's converters on a file they cannot make sense of
        raise SourceError(
            f"transformers could not convert {where} ({_first_line(e)}); expected a GGUF whose metadata and "
            "tensors describe one model of its general.architecture. Re-convert it with llama.cpp's "
            "convert_hf_to_gguf.py"
        ) from e
    bad = {k: sorted(v) for k, v in (("missing_keys", conv.missing), ("mismatched_keys", conv.mismatched),
                                     ("unexpected_keys", conv.unexpected)) if v}
    if bad:
        found = "; ".join(f"{k.replace('_', ' ')} {', '.join(v[:3])}" + (f" (+{len(v) - 3} more)" if len(v) > 3 else "")
                          for k, v in bad.items())
        raise SourceError(f"{where} does not convert to a complete {conv.config.model_type!r} model ({found}); "
                          "nothing was cached. Re-convert it with llama.cpp's convert_hf_to_gguf.py")
    for name, t in conv.state.items():  # numpy: one thread, no OpenMP barriers on a busy machine (~30x faster here)
        if t.is_floating_point() and not bool(np.isfinite(t.numpy()).all()):
            raise SourceError(f"{where} holds non-finite values (NaN or inf) in tensor {name} after dequantizing; "
                              "nothing was cached. Re-download or re-convert the file")
    return conv.config, generation, conv.tokenizer, conv.state


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # no readable config.json (e.g. a GGUF): let transformers explain


def _tok_meta(hf_tok: Any, config: Any, generation: Any = None) -> dict:
    """Chat template and special ids, from the tokenizer, then generation config, then model config."""
    template = hf_tok.chat_template
    if isinstance(template, dict):  # named templates: the unnamed one is "default"
        template = template.get("default")
    eos: list[int] = []
    for ids in (getattr(generation, "eos_token_id", None), config.eos_token_id, hf_tok.eos_token_id):
        for i in [ids] if isinstance(ids, int) else ids or []:
            if i not in eos:
                eos.append(int(i))
    bos = hf_tok.bos_token_id if hf_tok.bos_token_id is not None else config.bos_token_id
    return {"chat_template": template, "bos_id": bos, "eos_ids": eos}


def _causal_lm_class(config: Any) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]


def _convert_gguf(src: ModelSource, entry: Path) -> None:
    """Dequantize the GGUF once and write a plain HF checkpoint to `entry`, atomically."""
    from safetensors.torch import save_file

    config, generation, hf_tok, state = _dequantize_gguf(src)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{src.digest}-", dir=entry.parent))
    except OSError as e:
        raise SourceError(f"could not write the weights cache entry {entry} ({e}); "
                          "set KVTRACE_CACHE to a writable folder") from e
    try:
        # Weights are fp32, HF layout: Linear weights are [out, in]; q/k_proj rows are already un-permuted from
        # llama.cpp's rope order. A tied lm_head.weight is stored once (as embed_tokens.weight); from_pretrained
        # re-ties it.
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config.name_or_path = str(src.path.parent)  # what from_pretrained(gguf_file=) recorded: config.json unchanged
        saved = config.to_dict()
        saved.pop("quantization_config", None)
        saved.update(architectures=[_causal_lm_class(config)], dtype="float32")
        (tmp / "config.json").write_text(json.dumps(saved, indent=2))
        generation.to_json_file(tmp / "generation_config.json")
        hf_tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        meta = {"format": FORMAT, "source": str(src.path), "name": src.name, **_tok_meta(hf_tok, config, generation)}
        (tmp / "kvtrace.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "kvtrace.json").is_file():  # not merely a concurrent writer that won the race
                raise
    except OSError as e:
        raise SourceError(
            f"could not write the weights cache entry {entry} ({e}); set KVTRACE_CACHE to a writable folder"
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

