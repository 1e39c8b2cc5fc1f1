"""GGUF files: the header and tensor table walked and checked before transformers ever reads them.

``check_gguf(path)`` returns the file's architecture, metadata and tensor table (``GGUFInfo``) after
checking that the tensors fit the file, are of types the gguf package can dequantize, and are what
``general.architecture`` needs by name, count and shape (``SUPPORTED_GGUF_ARCHS`` only). Dequantizing
and caching the result is ``sources.load``'s job.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace._errors import SourceError, UnsupportedError, UsageError

__all__ = ["CHECKS_DIR", "SUPPORTED_GGUF_ARCHS", "GGUFInfo", "GGUFTensor", "check_gguf"]

# `general.architecture` values that transformers' GGUF loader turns into a plain decoder-only LM.
SUPPORTED_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3")

# GGUF value type -> struct code (STRING=8 and ARRAY=9 are handled separately).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: ne0 (the input features of a Linear weight) first
    ggml_type: int
    offset: int = 0  # bytes from GGUFInfo.data_start to the tensor's data


@dataclass(frozen=True)
class GGUFInfo:
    arch: str  # general.architecture
    meta: dict[str, Any]  # scalars and strings; arrays as their length
    tensors: tuple[GGUFTensor, ...]
    data_start: int  # bytes before the tensor data: magic, metadata and tensor table


def check_gguf(path: Path) -> GGUFInfo:
    """Walk the GGUF header and tensor table; check the tensors fit the file and the architecture (see
    ``_check_gguf``). The walk of SmolLM2's 49152-string vocabulary and the gguf package import it needs take
    ~0.25 s of a 2-core machine's warm start, so what it found is remembered, in this process and in the cache
    folder (``cache_dir()/gguf-checks/``, one small JSON file per GGUF path; ``kvtrace cache clear`` removes
    them), and reused while the file has the same size and its header bytes (everything the walk read: the first ``data_start`` bytes) hash the
    same — a few milliseconds — under the same kvtrace and gguf versions. Treat the returned ``GGUFInfo`` as
    read-only."""
    path = Path(path)
    size = path.stat().st_size
    seen = _CHECKED.get(path)
    if seen is not None and seen[0] == size and seen[1] == _header_digest(path, seen[2].data_start):
        return seen[2]
    found = _load_check(path, size)
    if found is None:
        info = _check_gguf(path)
        found = info, _header_digest(path, info.data_start)
        _save_check(path, size, *found)
    if len(_CHECKED) >= 8:
        _CHECKED.clear()
    _CHECKED[path] = (size, found[1], found[0])
    return found[0]


_CHECKED: dict[Path, tuple[int, str, GGUFInfo]] = {}  # path -> (size, header digest, what the walk found)
CHECKS_DIR = "gguf-checks"  # under cache_dir(): what earlier processes' walks found (``_save_check``)


def _header_digest(path: Path, n: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(n)).hexdigest()


def _check_file(path: Path) -> Path:
    from kvtrace.sources.store import cache_dir

    return cache_dir() / CHECKS_DIR / (hashlib.sha256(str(path.absolute()).encode()).hexdigest()[:32] + ".json")


def _versions() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    from kvtrace import __version__

    try:
        return [__version__, version("gguf")]
    except PackageNotFoundError:
        return [__version__, ""]


def _load_check(path: Path, size: int) -> tuple[GGUFInfo, str] | None:
    """What an earlier walk of ``path`` found and the header digest it was found for, if its record still
    describes the file (same path, size, header digest, kvtrace and gguf versions); None otherwise (no record, a
    stale or unreadable one, no cache folder)."""
    try:
        rec = json.loads(_check_file(path).read_text())
        if rec["path"] != str(path.absolute()) or rec["size"] != size or rec["versions"] != _versions():
            return None
        digest = _header_digest(path, rec["data_start"])
        if rec["header"] != digest:
            return None
        tensors = tuple(GGUFTensor(n, tuple(d), t, o) for n, d, t, o in rec["tensors"])
        return GGUFInfo(rec["arch"], rec["meta"], tensors, rec["data_start"]), digest
    except (OSError, ValueError, KeyError, TypeError, UsageError):
        return None


def _save_check(path: Path, size: int, info: GGUFInfo, digest: str) -> None:
    """Record a walk that passed (see ``check_gguf``); a cache folder that cannot be written only costs the next
    start its walk."""
    try:
        file = _check_file(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        rec = {"path": str(path.absolute()), "size": size, "versions": _versions(),
               "header": digest, "data_start": info.data_start, "arch": info.arch,
               "meta": info.meta, "tensors": [[t.name, list(t.dims), t.ggml_type, t.offset] for t in info.tensors]}
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, file)  # readers see the old record or the new one, never half of one
    except (OSError, UsageError, TypeError, ValueError):
        pass


def _check_gguf(path: Path) -> GGUFInfo:
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


def _walk_gguf(buf: Any, size: int) -> GGUFInfo:
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
    tensors = tuple(GGUFTensor(name, tuple(dims), t, off) for name, dims, t, off in raw)
    return GGUFInfo(arch, meta, tensors, data_start)


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


def _arch_mismatch(arch: str, info: GGUFInfo) -> tuple[list[str], list[str], list[str]]:
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


def _check_arch_tensors(path: Path, info: GGUFInfo) -> None:
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

