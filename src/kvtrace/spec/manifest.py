"""Manifest: the versioned, plain-JSON root of an artifact, and what it says each program takes.

``Manifest`` (``ModelInfo``'s fields inline) is written as ``manifest.json``; ``from_json`` checks every
field's type before any field is used (one ``ArtifactError`` per problem). ``expected_inputs`` derives
from the CacheSpec and a ProgramSpec the flat inputs a program must take; ``compare_inputs`` holds a
program's actual inputs against them. The backend name is a plain string here: the registry
(``kvtrace.backends``) and the artifact reader decide which names exist.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import ArtifactError
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.device import DEVICE_TYPES
from kvtrace.spec.program import ProgramSpec
from kvtrace.spec.quant import QuantSpec

__all__ = ["FORMAT", "MANIFEST", "TOKENIZER", "VERSION", "WEIGHTS", "Manifest", "ModelInfo", "clip", "compare_inputs",
           "describe", "expected_inputs", "short"]

FORMAT = "kvtrace.artifact"
VERSION = 2  # 2: member hashes and sizes, weight table, program signatures (all checked at load)
# the members every artifact may hold besides its backend's programs (``Backend.members``)
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class ModelInfo:
    """Where the decoder came from and how to talk to it (recorded in the manifest)."""

    model_name: str = ""
    model_type: str = ""
    source_digest: str = ""
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    chat_template: str | None = None


@dataclass(frozen=True, kw_only=True)
class Manifest(ModelInfo):
    """Everything a runtime needs to know about an artifact, as plain JSON (ModelInfo's fields inline)."""

    backend: str
    cache_spec: CacheSpec
    vocab_size: int
    programs: dict[str, ProgramSpec]  # name -> spec; always "prefill" and "decode", maybe more
    generation: dict[str, Any] = field(default_factory=dict)  # defaults: temperature, top_k, top_p, ...
    weight_aliases: dict[str, str] = field(default_factory=dict)  # tied weights: name -> stored name
    quant: QuantSpec | None = None  # quantized weights: scheme and each module's format; None: none (omitted)
    kvtrace_version: str = ""
    torch_version: str = ""
    export_seconds: float = 0.0
    # member name -> {"size": bytes, "sha256": hex} for every member but manifest.json (write_artifact fills it)
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    # stored weight name -> {"shape": [...], "dtype": "float32"} (write_artifact fills it)
    weights: dict[str, dict[str, Any]] = field(default_factory=dict)
    # compiled/serialized program name -> flat user inputs [{"shape": [ints / symbol names], "dtype"}], in
    # call order: tokens, input_pos, (key_pos), (slots), declared inputs, cache buffers (``program_signature``)
    signatures: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # the device type the programs were compiled for ("cpu" or "cuda", ``spec.device``); omitted when "cpu",
    # so a CPU artifact's manifest reads as before devices were recorded
    device: str = "cpu"
    # native code (aoti, aoti-packed): the x86 extensions its compiled libraries may execute, as /proc/cpuinfo names
    # them (``backends.cpu_isa``; load refuses a CPU without one); None (omitted): data programs, or not known
    cpu_features: tuple[str, ...] | None = None

    @property
    def max_seq_len(self) -> int:
        return self.cache_spec.max_seq_len

    def to_json(self) -> str:
        d = asdict(self)
        d["cache_spec"] = self.cache_spec.to_dict()
        d["programs"] = {name: p.to_dict() for name, p in self.programs.items()}
        if self.device == "cpu":
            del d["device"]
        if self.cpu_features is None:
            del d["cpu_features"]
        if self.quant is None:
            d.pop("quant")  # unquantized artifacts read as before
        else:
            d["quant"] = self.quant.to_dict()
        return json.dumps({"format": FORMAT, "version": VERSION, **d}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ArtifactError(f"manifest.json is not valid JSON ({clip(str(e))}); the file is corrupt") from e
        if not isinstance(d, dict):
            raise ArtifactError(f"manifest.json holds a JSON {type(d).__name__}, expected an object; the file is corrupt")
        if d.get("format") != FORMAT:
            raise ArtifactError(f"not a kvtrace artifact: manifest format is {short(d.get('format'))}, expected {FORMAT!r}")
        if d.get("version") != VERSION:
            raise ArtifactError(
                f"artifact manifest version {short(d.get('version'))} is not supported by this kvtrace "
                f"(reads version {VERSION}); re-export it with this kvtrace or install the matching version "
                "(artifacts in kvtrace's own cache: `kvtrace cache clear`)"
            )
        d.pop("format")
        d.pop("version")
        _check_fields(d)
        d["cache_spec"] = CacheSpec.from_dict(d["cache_spec"])
        programs = d["programs"]
        if not {"prefill", "decode"} <= set(programs):
            raise ArtifactError(f"manifest lists programs {sorted(programs)}; expected at least prefill and decode")
        try:
            d["programs"] = {name: ProgramSpec.from_dict(name, p) for name, p in programs.items()}
        except (AttributeError, TypeError, ValueError) as e:
            raise ArtifactError(f"manifest programs are malformed ({clip(str(e))}); re-export the artifact") from e
        d["eos_ids"] = tuple(d.get("eos_ids", ()))
        if "quant" in d:
            d["quant"] = QuantSpec.from_dict(d["quant"])
        if "cpu_features" in d:
            d["cpu_features"] = tuple(d["cpu_features"])
        return cls(**d)  # the backend name is checked against the registry by the reader


# --- manifest field types: checked before any field is used --------------------------------------
_DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def short(v: Any, n: int = 80) -> str:
    """``repr(v)``, at most ``n`` characters (a forged field can be huge)."""
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def clip(text: str, n: int = 200) -> str:
    """``text`` on one line, at most ``n`` characters (library messages can be long or multi-line)."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def describe(t: torch.Tensor | dict[str, Any]) -> str:
    """``dtype [shape]`` of a tensor or of a manifest's {shape, dtype} entry."""
    if isinstance(t, dict):
        return f"{t['dtype']} {list(t['shape'])}"
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_shape(v: Any, symbols: bool = False) -> bool:
    return isinstance(v, list) and len(v) <= 16 and all(
        _is_int(x) or (symbols and isinstance(x, str) and x.isidentifier()) for x in v)


def _is_tensor_meta(v: Any, symbols: bool = False) -> bool:
    return (isinstance(v, dict) and set(v) == {"shape", "dtype"} and _is_shape(v["shape"], symbols)
            and isinstance(v["dtype"], str) and v["dtype"] in _DTYPES)


def _dict_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and check(x) for k, x in v.items())


_OPTIONAL = (str, type(None))
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "backend": (lambda v: isinstance(v, str), "a string"),
    "cache_spec": (lambda v: isinstance(v, dict), "an object"),
    "vocab_size": (lambda v: _is_int(v, 1), "an int >= 1"),
    "programs": (_dict_of(lambda x: isinstance(x, dict) and all(
        isinstance(x.get(k, False), bool) for k in ("single_token", "once", "key_pos", "slots")) and all(
        isinstance(x.get(k, ""), str) for k in ("method", "logits", "signature", "served_by"))),
        "an object of program specs"),
    "members": (_dict_of(lambda x: isinstance(x, dict) and set(x) == {"size", "sha256"} and _is_int(x["size"])
                         and isinstance(x["sha256"], str) and re.fullmatch("[0-9a-f]{64}", x["sha256"]) is not None),
                "an object of {size, sha256}"),
    "weights": (_dict_of(_is_tensor_meta), "an object of {shape, dtype}"),
    "signatures": (_dict_of(lambda x: isinstance(x, list) and all(_is_tensor_meta(i, True) for i in x)),
                   "an object of lists of {shape, dtype}"),
    "model_name": (lambda v: isinstance(v, str), "a string"),
    "model_type": (lambda v: isinstance(v, str), "a string"),
    "source_digest": (lambda v: isinstance(v, str), "a string"),
    "bos_id": (lambda v: v is None or _is_int(v), "null or an int >= 0"),
    "eos_ids": (lambda v: isinstance(v, list) and all(_is_int(i) for i in v), "a list of ints >= 0"),
    "chat_template": (lambda v: isinstance(v, _OPTIONAL), "null or a string"),
    "generation": (lambda v: isinstance(v, dict) and all(
        x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)) for x in v.values()),
        "an object of numbers or nulls"),
    "weight_aliases": (_dict_of(lambda x: isinstance(x, str)), "an object of strings"),
    "quant": (lambda v: isinstance(v, dict), "an object"),
    "kvtrace_version": (lambda v: isinstance(v, str), "a string"),
    "torch_version": (lambda v: isinstance(v, str), "a string"),
    "export_seconds": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "device": (lambda v: isinstance(v, str) and v in DEVICE_TYPES, f"one of {list(DEVICE_TYPES)}"),
    "cpu_features": (lambda v: isinstance(v, list) and all(isinstance(x, str) and re.fullmatch("[a-z0-9_]{1,32}", x)
                                                             for x in v), "a list of CPU flag names"),
}
_REQUIRED = ("backend", "cache_spec", "vocab_size", "programs", "members", "weights", "signatures")


def _check_fields(d: dict[str, Any]) -> None:
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise ArtifactError(f"manifest fields do not match version {VERSION}: unknown field(s) {short(unknown)} "
                            "(written by another kvtrace?); re-export it with this kvtrace")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ArtifactError(f"manifest fields do not match version {VERSION}: missing {missing}; re-export the artifact")
    for key, value in d.items():
        check, expected = _FIELDS[key]
        if not check(value):
            raise ArtifactError(f"manifest fields do not match version {VERSION}: {key} must be {expected}, "
                                f"found {short(value)}; the file is corrupt, re-export it")


# --- consistency: manifest (CacheSpec, ProgramSpecs) vs what each program takes -------------------
def expected_inputs(manifest: Manifest, program: ProgramSpec,
                    cache: bool = True) -> list[tuple[str, tuple[int | str, ...], str]]:
    """(label, shape, dtype) of each flat user input the manifest says ``program`` takes; "T"/"L" symbolic.
    ``cache`` False: a program holding its cache itself (``Backend.holds_state``) takes no cache inputs."""
    spec = manifest.cache_spec
    b = spec.batch_size
    t: int | str = 1 if program.single_token else ("T" if spec.max_seq_len > 1 else 1)
    out = program.spine(b, t, rows="R" if b > 1 else 1)  # tokens, input_pos (, key_pos, slots)
    for i in program.inputs:
        out.append((i.name, tuple(b if d == "B" else t if d == "T" else d for d in i.shape), i.dtype))
    if cache:
        out.extend((f"cache {buf.name}", buf.shape, buf.dtype) for buf in spec.buffers())
    return out


def compare_inputs(path: Path, what: str, expected: list[tuple[str, tuple[int | str, ...], str]],
                   actual: list[tuple[tuple[int | str, ...], str]]) -> None:
    """``actual`` ((shape, dtype) per flat input, in call order) against ``expected``; symbolic sizes
    ("T", "L", "R") match any size. One ArtifactError naming the first input that differs."""
    def fmt(shape: tuple[int | str, ...] | list[Any], dtype: str) -> str:
        return f"{dtype} [{', '.join(map(str, shape))}]"

    if len(expected) != len(actual):
        n_cache = sum(label.startswith("cache ") for label, _, _ in expected)
        raise ArtifactError(f"{path}: {what} takes {len(actual)} inputs, but the manifest's CacheSpec and program "
                            f"spec declare {len(expected)} (tokens, positions, declared inputs, {n_cache} cache "
                            "buffers); the artifact is inconsistent, re-export it")
    for (label, shape, dtype), (ashape, adtype) in zip(expected, actual, strict=True):
        ok = dtype == adtype and len(shape) == len(ashape) and all(
            isinstance(e, str) or e == a for e, a in zip(shape, ashape, strict=True))
        if not ok:
            raise ArtifactError(f"{path}: {what} was built for {label} {fmt(ashape, adtype)}, but the manifest "
                                f"declares {fmt(shape, dtype)}; the artifact is inconsistent, re-export it")
