"""The artifact: one file holding programs, weights (once), cache spec, manifest and tokenizer.

Layout (a zip archive; weights stored uncompressed, programs deflated: a serialized program is mostly
repetitive graph metadata and would otherwise outweigh a small model's weights)::

    manifest.json            versioned Manifest (below), plain JSON: the root every other member is checked against
    weights.safetensors      every weight once, shared by all programs
    tokenizer.json           the `tokenizers` tokenizer (optional)
    programs/prefill.json    backend "exported": torch.export program, serialized without weights
    programs/decode.json     (one file per program the manifest lists, e.g. also prefill_image.json)
    programs/aoti.pt2        backend "aoti": AOTInductor package with one model per program;
                             backend "aoti-packed": one model ("step", T symbolic) serving prefill and
                             decode, its weights frozen and prepacked inside (weights.safetensors is empty)

Trust model. ``exported`` programs are data: a graph of torch operators (torch's verifier refuses any
other call target) over JSON and safetensors. ``aoti``/``aoti-packed`` programs are native code: loading
one dlopens a shared library from the file, so load only artifacts you built or whose SHA-256 you trust
(``load(path, expected_sha256=...)``, checked before anything is parsed). Either way nothing is unpickled:
the .pt2's members are checked against what kvtrace writes (no pickled weights, constants, custom objects
or exported programs, which torch's package loader would unpickle) and the one library is loaded directly.

What ``load`` checks before the first program call, each failure one ``ArtifactError``:
  * the zip directory: only the members the manifest lists (unknown ones refused), each of the declared
    size, under a ceiling and a compression-ratio bound, read through a bounded stream (no zip bomb);
  * the SHA-256 of every member (recorded at export) before the member is used;
  * the manifest's fields and types; the weights against the manifest's weight table (names, shapes,
    dtypes) and its aliases;
  * every program against the CacheSpec and ProgramSpecs: exported graphs' placeholders (inputs, cache
    and weights) and logits; compiled libraries' constants (dtype and byte size, asked of the library
    itself) and one probe call with AOTInductor's runtime input checks on, which then stay on for every
    call (dtype, sizes and strides of every input), so an inconsistent artifact raises instead of
    reading or writing out of bounds.

Loading needs torch and kvtrace only: no transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import re
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import ArtifactError, UsageError
from kvtrace.runtime.session import Session
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.program import ProgramSpec

__all__ = ["FORMAT", "VERSION", "Artifact", "Manifest", "ModelInfo", "load", "program_signature", "write_artifact"]

FORMAT = "kvtrace.artifact"
VERSION = 2  # 2: member hashes and sizes, weight table, program signatures (all checked at load)
BACKENDS = ("exported", "aoti", "aoti-packed")
PACKED_MODEL = "step"  # the one model of an aoti-packed package
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer.json"
AOTI_PACKAGE = "programs/aoti.pt2"
MANIFEST_MAX_BYTES = 16 << 20  # chat templates and signatures are small; a bigger manifest is not ours
MEMBER_MAX_BYTES = 1 << 40  # no single member of a real artifact comes near 1 TiB
MAX_RATIO = 100  # uncompressed / compressed per member: programs deflate ~3-15x, weights are stored (1x)
MAX_MEMBERS = 1024  # an artifact has a handful; a directory of millions would cost GBs to parse
_CHUNK = 1 << 20


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
    kvtrace_version: str = ""
    torch_version: str = ""
    export_seconds: float = 0.0
    # member name -> {"size": bytes, "sha256": hex} for every member but manifest.json (write_artifact fills it)
    members: dict[str, dict[str, Any]] = field(default_factory=dict)
    # stored weight name -> {"shape": [...], "dtype": "float32"} (write_artifact fills it)
    weights: dict[str, dict[str, Any]] = field(default_factory=dict)
    # compiled/serialized program name -> flat user inputs [{"shape": [ints / symbol names], "dtype"}], in
    # call order: tokens, input_pos, (key_pos), declared inputs, cache buffers (``program_signature``)
    signatures: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int:
        return self.cache_spec.max_seq_len

    def to_json(self) -> str:
        d = asdict(self)
        d["cache_spec"] = self.cache_spec.to_dict()
        d["programs"] = {name: p.to_dict() for name, p in self.programs.items()}
        return json.dumps({"format": FORMAT, "version": VERSION, **d}, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ArtifactError(f"manifest.json is not valid JSON ({_clip(str(e))}); the file is corrupt") from e
        if not isinstance(d, dict):
            raise ArtifactError(f"manifest.json holds a JSON {type(d).__name__}, expected an object; the file is corrupt")
        if d.get("format") != FORMAT:
            raise ArtifactError(f"not a kvtrace artifact: manifest format is {_short(d.get('format'))}, expected {FORMAT!r}")
        if d.get("version") != VERSION:
            raise ArtifactError(
                f"artifact manifest version {_short(d.get('version'))} is not supported by this kvtrace "
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
            raise ArtifactError(f"manifest programs are malformed ({_clip(str(e))}); re-export the artifact") from e
        d["eos_ids"] = tuple(d.get("eos_ids", ()))
        m = cls(**d)
        if m.backend not in BACKENDS:
            raise ArtifactError(f"unknown backend {_short(m.backend)} in manifest; expected one of {BACKENDS}")
        return m


# --- manifest field types: checked before any field is used --------------------------------------
_DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def _short(v: Any, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _clip(text: str, n: int = 200) -> str:
    """``text`` on one line, at most ``n`` characters (library messages can be long or multi-line)."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


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
        isinstance(x.get(k, False), bool) for k in ("single_token", "once", "key_pos")) and all(
        isinstance(x.get(k, ""), str) for k in ("method", "logits", "signature"))), "an object of program specs"),
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
    "kvtrace_version": (lambda v: isinstance(v, str), "a string"),
    "torch_version": (lambda v: isinstance(v, str), "a string"),
    "export_seconds": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
}
_REQUIRED = ("backend", "cache_spec", "vocab_size", "programs", "members", "weights", "signatures")


def _check_fields(d: dict[str, Any]) -> None:
    unknown = sorted(set(d) - set(_FIELDS))
    if unknown:
        raise ArtifactError(f"manifest fields do not match version {VERSION}: unknown field(s) {_short(unknown)} "
                            "(written by another kvtrace?); re-export it with this kvtrace")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ArtifactError(f"manifest fields do not match version {VERSION}: missing {missing}; re-export the artifact")
    for key, value in d.items():
        check, expected = _FIELDS[key]
        if not check(value):
            raise ArtifactError(f"manifest fields do not match version {VERSION}: {key} must be {expected}, "
                                f"found {_short(value)}; the file is corrupt, re-export it")


def program_signature(ep: torch.export.ExportedProgram) -> list[dict[str, Any]]:
    """The flat user inputs of an exported program as the manifest records them: shape (ints, and symbol
    names for symbolic sizes) and dtype, in call order."""
    from torch.export.graph_signature import InputKind

    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    out = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            val = nodes[spec.arg.name].meta["val"]
            out.append({"shape": [d if isinstance(d, int) else str(d) for d in val.shape],
                        "dtype": str(val.dtype).removeprefix("torch.")})
    return out


def dedupe_weights(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store tied tensors once: (unique tensors, alias name -> stored name)."""
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in sorted(weights.items()):
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t.detach().contiguous()
    return unique, aliases


def write_artifact(
    path: str | os.PathLike[str],
    manifest: Manifest,
    weights: dict[str, torch.Tensor],
    files: dict[str, bytes],
    tokenizer_json: str | None,
) -> Path:
    """Write atomically: a temp file in the same folder, renamed into place only when complete, with the
    permissions a new file gets under the caller's umask. The manifest written records the size and
    SHA-256 of every other member and the shape and dtype of every weight."""
    from safetensors.torch import save

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"output path {path} is a directory; expected a file name such as model.kvt")
    path.parent.mkdir(parents=True, exist_ok=True)
    blobs: dict[str, bytes] = {WEIGHTS: save({k: v.cpu() for k, v in weights.items()})}
    if tokenizer_json is not None:
        blobs[TOKENIZER] = tokenizer_json.encode()
    blobs.update(files)
    manifest = dataclasses.replace(
        manifest,
        members={n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in blobs.items()},
        weights={n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in weights.items()},
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        umask = os.umask(0)  # mkstemp creates 0600; a written artifact gets what open() would give it
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            zf.writestr(MANIFEST, manifest.to_json())
            for name, blob in blobs.items():
                if name.startswith("programs/"):
                    # level 1: a packed SmolLM2 fp32 program (517 MiB) deflates to 269 MiB in 9 s; level 6 (the
                    # default) gets 255 MiB in 55 s, most of a cold export's time budget
                    zf.writestr(name, blob, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
                else:
                    zf.writestr(name, blob)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class Artifact:
    """A loaded artifact: manifest, weights, tokenizer and the two programs. Make sessions from it."""

    def __init__(self, path: Path, manifest: Manifest, programs: dict[str, Callable[..., torch.Tensor]],
                 tokenizer_json: str | None, keepalive: Any = None):
        self.path = path
        self.manifest = manifest
        self._programs = programs
        self.tokenizer_json = tokenizer_json
        self._keepalive = keepalive  # weights / temp dirs the programs reference

    @property
    def cache_spec(self) -> CacheSpec:
        return self.manifest.cache_spec

    def session(self) -> Session:
        """A new Session with its own cache, holding the declared initial values."""
        extra = {n: (spec, self._programs[n]) for n, spec in self.manifest.programs.items()
                 if n not in ("prefill", "decode")}
        return Session(self.cache_spec, self._programs["prefill"], self._programs["decode"],
                       vocab_size=self.manifest.vocab_size, extra=extra,
                       prefill_logits=self.manifest.programs["prefill"].logits,
                       key_pos=self.manifest.programs["prefill"].key_pos, identity=self.identity)

    @property
    def identity(self) -> str:
        """``artifact:<sha256 of the manifest>[:16]``: what a Session's snapshots are tied to (same file, same id)."""
        import hashlib

        return "artifact:" + hashlib.sha256(self.manifest.to_json().encode()).hexdigest()[:16]

    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` stored in the artifact (None if it has none)."""
        if self.tokenizer_json is None:
            return None
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_str(self.tokenizer_json)
        except Exception as e:  # tokenizers raises its own exception type
            raise ArtifactError(f"{self.path}: tokenizer.json is not a readable tokenizer ({_clip(str(e), 200)}); "
                                "re-export the artifact") from e

    def __repr__(self) -> str:
        m = self.manifest
        return f"Artifact({self.path.name}, {m.model_name or m.model_type}, backend={m.backend}, {m.cache_spec.describe()})"


# --- reading: the file, the zip directory, the members ------------------------------------------
def _check_file_hash(path: Path, expected: str) -> None:
    if not isinstance(expected, str) or re.fullmatch("[0-9a-fA-F]{64}", expected) is None:
        raise UsageError(f"expected_sha256 must be 64 hex digits (a SHA-256 of the whole file), got {_short(expected)}")
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != expected.lower():
        raise ArtifactError(f"{path} has SHA-256 {h.hexdigest()}, expected {expected.lower()}: it is not the file you "
                            "trust (corrupt, or replaced); nothing in it was read")


def _expected_members(manifest: Manifest) -> set[str]:
    programs = ({AOTI_PACKAGE} if manifest.backend != "exported" else {f"programs/{p}.json" for p in manifest.programs})
    return {WEIGHTS, *programs}


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes:
    """A member's bytes, never more than ``limit`` (the zip stream itself stops at the declared size)."""
    buf = bytearray()
    with zf.open(info) as f:
        while chunk := f.read(min(_CHUNK, limit + 1 - len(buf))):
            buf += chunk
            if len(buf) > limit:
                raise ArtifactError(f"{info.filename} is larger than its declared {limit} bytes; the file is corrupt")
    return bytes(buf)


def _check_size(path: Path, info: zipfile.ZipInfo, limit: int) -> None:
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise ArtifactError(f"{path}: member {info.filename} uses zip compression method {info.compress_type}; kvtrace "
                            "writes stored or deflated members only. The file is not a kvtrace artifact")
    if info.file_size > limit or info.file_size > max(info.compress_size, 1) * MAX_RATIO + (1 << 16):
        raise ArtifactError(
            f"{path}: member {info.filename} claims {info.file_size} bytes uncompressed from {info.compress_size} "
            f"(at most {limit} bytes and {MAX_RATIO}x compression allowed); refusing to decompress it (a zip bomb?)")


def _read_zip(path: Path) -> tuple[Manifest, dict[str, bytes]]:
    if path.is_dir():
        raise UsageError(f"artifact path {path} is a directory; expected an artifact file written by `kvtrace export`")
    if not path.is_file():
        raise UsageError(f"artifact {path} does not exist; create one with `kvtrace export`")
    try:
        with path.open("rb") as f:
            end = zipfile._EndRecData(f)  # the directory's entry count, read before zipfile parses the directory
        if end is not None and end[zipfile._ECD_ENTRIES_TOTAL] > MAX_MEMBERS:
            raise ArtifactError(f"{path}: its zip directory lists {end[zipfile._ECD_ENTRIES_TOTAL]} members (a kvtrace "
                                f"artifact has a handful; at most {MAX_MEMBERS} are read); it is not a kvtrace artifact")
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            names = [i.filename for i in infos]
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise ArtifactError(f"{path} lists member(s) {_short(dup)} twice; it is not a kvtrace artifact")
            by_name = {i.filename: i for i in infos}
            if MANIFEST not in by_name:
                raise ArtifactError(f"{path} has no manifest.json; it is not a kvtrace artifact")
            _check_size(path, by_name[MANIFEST], MANIFEST_MAX_BYTES)
            try:
                text = _read_member(zf, by_name[MANIFEST], MANIFEST_MAX_BYTES).decode()
            except UnicodeDecodeError as e:
                raise ArtifactError(f"{path}: manifest.json is not UTF-8 text ({e}); the file is corrupt") from e
            manifest = Manifest.from_json(text)
            declared = manifest.members
            present = set(by_name) - {MANIFEST}
            unknown = sorted(present - set(declared))
            if unknown:
                raise ArtifactError(f"{path} holds member(s) {_short(unknown)} that its manifest does not list; "
                                    "kvtrace refuses unknown members. Re-export the artifact")
            missing = sorted((_expected_members(manifest) | set(declared)) - present)
            if missing:
                raise ArtifactError(f"{path} lacks {missing}; the file is truncated or corrupt, re-export it")
            extra = sorted(present - _expected_members(manifest) - {TOKENIZER})
            if extra:
                raise ArtifactError(f"{path}: member(s) {_short(extra)} do not belong to a {manifest.backend} artifact "
                                    f"of programs {sorted(manifest.programs)}; re-export it")
            for name in sorted(present):  # every size is checked against the directory before anything is read
                info, size = by_name[name], declared[name]["size"]
                if info.file_size != size:
                    raise ArtifactError(f"{path}: member {name} is {info.file_size} bytes, its manifest says {size}; "
                                        "the file is corrupt, re-export it")
                _check_size(path, info, MEMBER_MAX_BYTES)
            blobs = {}
            for name in sorted(present):
                blob = _read_member(zf, by_name[name], declared[name]["size"])  # CRC-checked by zipfile
                if hashlib.sha256(blob).hexdigest() != declared[name]["sha256"]:
                    raise ArtifactError(f"{path}: member {name} does not match the SHA-256 its manifest records; "
                                        "the file is corrupt or was altered, re-export it")
                blobs[name] = blob
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, zlib.error, ValueError,
            NotImplementedError, OverflowError) as e:
        raise ArtifactError(f"{path} is not a readable kvtrace artifact ({_clip(str(e), 200)}); it is corrupt or "
                            "truncated") from e
    return manifest, blobs


def _load_weights(path: Path, blob: bytes, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The stored weights, checked against the manifest's weight table, plus the tied aliases."""
    from safetensors.torch import load as st_load

    try:
        weights = st_load(blob)
    except Exception as e:  # safetensors raises its own error type
        raise ArtifactError(f"{path}: weights.safetensors is corrupt ({_clip(str(e), 200)}); re-export the artifact") from e
    table = manifest.weights
    if set(weights) != set(table):
        diff = sorted(set(weights) ^ set(table))
        raise ArtifactError(f"{path}: weights.safetensors holds other weights than the manifest lists (differ: "
                            f"{_short(diff)}); the artifact is inconsistent, re-export it")
    for name, t in weights.items():
        meta = table[name]
        if list(t.shape) != meta["shape"] or str(t.dtype).removeprefix("torch.") != meta["dtype"]:
            raise ArtifactError(f"{path}: weight {name} is {_describe(t)}, the manifest says {_describe(meta)}; "
                                "the artifact is inconsistent, re-export it")
    for alias, name in manifest.weight_aliases.items():
        if name not in weights or alias in weights:
            raise ArtifactError(f"{path}: weight alias {alias!r} -> {name!r} names "
                                f"{'a weight that is not stored' if name not in weights else 'a stored weight'}; "
                                "the artifact is inconsistent, re-export it")
        weights[alias] = weights[name]
    return weights


def _describe(t: torch.Tensor | dict[str, Any]) -> str:
    if isinstance(t, dict):
        return f"{t['dtype']} {list(t['shape'])}"
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


# --- consistency: manifest (CacheSpec, ProgramSpecs) vs what each program takes --------------------
def _expected_inputs(manifest: Manifest, program: ProgramSpec) -> list[tuple[str, tuple[int | str, ...], str]]:
    """(label, shape, dtype) of each flat user input the manifest says ``program`` takes; "T"/"L" symbolic."""
    spec = manifest.cache_spec
    b = spec.batch_size
    t: int | str = 1 if program.single_token else ("T" if spec.max_seq_len > 1 else 1)
    out: list[tuple[str, tuple[int | str, ...], str]] = [("tokens", (b, t), "int64"), ("input_pos", (t,), "int64")]
    if program.key_pos:
        out.append(("key_pos", ("L",), "int64"))
    for i in program.inputs:
        out.append((i.name, tuple(b if d == "B" else t if d == "T" else d for d in i.shape), i.dtype))
    out.extend((f"cache {buf.name}", buf.shape, buf.dtype) for buf in spec.buffers())
    return out


def _compare_inputs(path: Path, what: str, expected: list[tuple[str, tuple[int | str, ...], str]],
                    actual: list[tuple[tuple[int | str, ...], str]]) -> None:
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


def _compiled_programs(manifest: Manifest) -> dict[str, ProgramSpec]:
    """Compiled/serialized program name -> the spec it serves (aoti-packed: "step" serves prefill and decode)."""
    if manifest.backend == "aoti-packed":
        return {PACKED_MODEL: manifest.programs["prefill"]}
    return dict(manifest.programs)


def _check_signatures(path: Path, manifest: Manifest) -> None:
    """The signatures recorded at export against what the CacheSpec and ProgramSpecs declare."""
    compiled = _compiled_programs(manifest)
    if set(manifest.signatures) != set(compiled):
        raise ArtifactError(f"{path}: the manifest records signatures of {sorted(manifest.signatures)}, expected "
                            f"{sorted(compiled)}; the artifact is inconsistent, re-export it")
    if manifest.backend == "aoti-packed":
        pre, dec = manifest.programs["prefill"], manifest.programs["decode"]
        if (pre.inputs, pre.key_pos, pre.single_token, dec.single_token) != (dec.inputs, dec.key_pos, False, True):
            raise ArtifactError(f"{path}: an aoti-packed artifact serves a T-symbolic prefill and a one-token decode "
                                "with one program, but its manifest's program specs differ; re-export it")
    for name, program in compiled.items():
        actual = [(tuple(i["shape"]), i["dtype"]) for i in manifest.signatures[name]]
        _compare_inputs(path, f"program {name} (as recorded at export)", _expected_inputs(manifest, program), actual)


# --- programs ----------------------------------------------------------------------------------
def _exported_program(path: Path, name: str, blob: bytes, weights: dict[str, torch.Tensor],
                      manifest: Manifest) -> Callable[..., torch.Tensor]:
    from torch._export.serde.serialize import SerializedArtifact, deserialize
    from torch.export.graph_signature import InputKind

    try:
        graph = json.loads(blob)
        names = _program_weight_names(graph)
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration, RecursionError) as e:
        raise ArtifactError(f"{path}: programs/{name}.json is not a serialized program ({_clip(str(e), 120)}); "
                            "the file is corrupt, re-export it") from e
    lacking = sorted(n for kind in names.values() for n in kind if n not in weights)
    if lacking:
        raise ArtifactError(f"{path}: program {name} reads weight(s) {_short(lacking)} that weights.safetensors "
                            "does not hold; the artifact is inconsistent, re-export it")
    state_dict: dict[str, torch.Tensor] = {n: weights[n] for n in names["buffers"]}
    state_dict.update({n: torch.nn.Parameter(weights[n], requires_grad=False) for n in names["params"]})
    constants = {n: weights[n] for n in names["constants"]}
    ep = deserialize(SerializedArtifact(blob, state_dict, constants, b""))
    # the graph's own placeholders are the truth: weights, then inputs and cache, then the logits
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user: list[tuple[tuple[int | str, ...], str]] = []
    for spec in ep.graph_signature.input_specs:
        val = nodes[spec.arg.name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ArtifactError(f"{path}: program {name} takes a non-tensor input {spec.arg.name}; re-export it")
        shape = tuple(d if isinstance(d, int) else str(d) for d in val.shape)
        if spec.kind == InputKind.USER_INPUT:
            user.append((shape, str(val.dtype).removeprefix("torch.")))
        elif spec.target in weights:
            w = weights[spec.target]
            if tuple(w.shape) != shape or w.dtype != val.dtype:
                raise ArtifactError(f"{path}: program {name} reads weight {spec.target} as "
                                    f"{str(val.dtype).removeprefix('torch.')} {list(shape)}, but weights.safetensors "
                                    f"holds {_describe(w)}; the artifact is inconsistent, re-export it")
    _compare_inputs(path, f"program {name}", _expected_inputs(manifest, manifest.programs[name]), user)
    (logits,) = ep.graph_signature.user_outputs
    out = next(n for n in ep.graph.nodes if n.name == logits).meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[-1] != manifest.vocab_size:
        raise ArtifactError(f"{path}: program {name} returns {tuple(getattr(out, 'shape', ()))} logits, the manifest "
                            f"declares vocab_size {manifest.vocab_size}; the artifact is inconsistent, re-export it")
    return ep.module()


def _program_weight_names(graph: dict[str, Any]) -> dict[str, list[str]]:
    """Which weights a serialized program's signature expects (parameters/buffers vs constants)."""
    out: dict[str, list[str]] = {"params": [], "buffers": [], "constants": []}
    for spec in graph["graph_module"]["signature"]["input_specs"]:
        kind, body = next(iter(spec.items()))
        if kind == "parameter":
            out["params"].append(body["parameter_name"])
        elif kind == "buffer":  # non-persistent buffers travel with the constants
            out["buffers" if body.get("persistent", True) else "constants"].append(body["buffer_name"])
        elif kind == "tensor_constant":
            out["constants"].append(body["tensor_constant_name"])
    return out


# The members torch's .pt2 packaging may hold, and what kvtrace accepts of them. Anything else is refused:
# models/*.json + data/weights|constants/* (exported programs with weights and constants, which torch's
# package loader unpickles when a payload says use_pickle, or when it is a custom or opaque object),
# extra/*, data/sample_inputs/*, and a model folder's weights_config.json / custom_objs_config.json.
_PT2_BOOKKEEPING = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
_PT2_MODEL_FILE = re.compile(r"data/aotinductor/([A-Za-z_][A-Za-z0-9_]*)/([A-Za-z0-9_.\-]+)")
_PT2_NEVER = ("weights_config.json", "custom_objs_config.json")


def _pt2_libraries(path: Path, blob: bytes, models: set[str]) -> dict[str, dict[str, bytes]]:
    """Check the AOTInductor package's member list; model name -> {".so": library, ".json": extern kernel
    nodes (if any)}. Nothing in it is unpickled, compiled or extracted besides these."""
    what = f"{path}: {AOTI_PACKAGE}"
    try:
        zf = zipfile.ZipFile(io.BytesIO(blob))
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        raise ArtifactError(f"{what} is not a readable package ({_clip(str(e))}); re-export the artifact") from e
    roots = {i.filename.split("/", 1)[0] for i in infos}
    if len(roots) != 1 or sum(i.file_size for i in infos) > len(blob):
        raise ArtifactError(f"{what} is not a package as torch writes it (one root folder, stored members); re-export it")
    files: dict[str, dict[str, bytes]] = {}
    for info in infos:
        rel = info.filename.split("/", 1)[1] if "/" in info.filename else ""
        if rel in _PT2_BOOKKEEPING:
            continue
        m = _PT2_MODEL_FILE.fullmatch(rel)
        ext = Path(rel).suffix
        if (m is None or m.group(2) in _PT2_NEVER or ext not in (".so", ".cpp", ".json")
                or info.compress_type != zipfile.ZIP_STORED):
            raise ArtifactError(
                f"{what} holds {_short(info.filename)}, which kvtrace never writes (torch's loader could unpickle or "
                "build it); refusing to load it. Re-export the artifact with kvtrace")
        model, fname = m.group(1), m.group(2)
        if model not in models:
            raise ArtifactError(f"{what} holds a model {model!r}; the manifest's programs are {sorted(models)}")
        if ext == ".so" or (ext == ".json" and fname.endswith(".wrapper.json")):
            key = ".so" if ext == ".so" else ".json"
            if key in files.setdefault(model, {}):
                raise ArtifactError(f"{what} holds two {key} files for model {model}; re-export the artifact")
            files[model][key] = zf.read(info)
    lacking = sorted(m for m in models if ".so" not in files.get(m, {}))
    if lacking:
        raise ArtifactError(f"{what} has no compiled library for {lacking}; re-export the artifact")
    return files


def _probe_inputs(manifest: Manifest, program: ProgramSpec, cache: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call's inputs at position 0 with T = L = 1, over ``cache`` (allocated from the CacheSpec)."""
    spec = manifest.cache_spec
    flat = [torch.zeros(spec.batch_size, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]
    if program.key_pos:
        flat.append(torch.zeros(1, dtype=torch.int64))
    for i in program.inputs:
        flat.append(torch.full(i.concrete(spec.batch_size, 1), i.default or 0.0, dtype=i.torch_dtype))
    return [*flat, *cache]


def _aoti_programs(path: Path, manifest: Manifest, blob: bytes, weights: dict[str, torch.Tensor]
                   ) -> dict[str, Callable[..., torch.Tensor]]:
    from kvtrace.backends.aoti import compiled_constants, load_library

    compiled = _compiled_programs(manifest)
    libraries = _pt2_libraries(path, blob, set(compiled))
    _remove_stale_dirs()
    tmp = Path(tempfile.mkdtemp(prefix=f"kvtrace-aoti-{os.getpid()}-"))
    cache = manifest.cache_spec.allocate()  # one scratch cache for every probe
    try:
        loaded = {}
        for name, program in compiled.items():
            so = tmp / f"{name}.so"  # our own names: nothing from the package picks a path
            so.write_bytes(libraries[name][".so"])
            if ".json" in libraries[name]:  # extern kernel nodes, read by the library's proxy executor
                (tmp / f"{name}.json").write_bytes(libraries[name][".json"])
            packed = manifest.backend == "aoti-packed"
            if not packed:
                _check_constants(path, name, compiled_constants(so), weights)
            try:
                run, out = load_library(so, None if packed else weights, _probe_inputs(manifest, program, cache))
            except RuntimeError as e:
                raise ArtifactError(
                    f"{path}: program {name} refuses the inputs its manifest declares ({_clip(str(e), 200)}): "
                    "the CacheSpec or program specs do not match the compiled program; the artifact is "
                    "inconsistent, re-export it") from e
            if len(out) != 1 or out[0].dim() != 3 or out[0].shape[-1] != manifest.vocab_size:
                raise ArtifactError(f"{path}: program {name} returns {[tuple(o.shape) for o in out]}, the manifest "
                                    f"declares logits [B, T, {manifest.vocab_size}]; the artifact is inconsistent, "
                                    "re-export it")
            loaded[name] = _logits_only(run)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the libraries stay mapped; their files are not needed
    if manifest.backend == "aoti-packed":
        return {p: loaded[PACKED_MODEL] for p in manifest.programs}
    return loaded


def _check_constants(path: Path, name: str, table: dict[str, tuple[torch.dtype | None, int]],
                     weights: dict[str, torch.Tensor]) -> None:
    """Every weight a compiled library reads, against what the artifact hands it (dtype, bytes).

    The library records each constant's storage size at compile time rounded up to 64 bytes (Inductor's
    ALIGN_BYTES), not its shape; kvtrace's weights own their storage, so a weight that fits is one whose
    rounded size is exactly that: fewer bytes would be read past their end, more would be misread.
    """
    for fqn, (dtype, nbytes) in table.items():
        w = weights.get(fqn)
        if w is None:
            raise ArtifactError(f"{path}: program {name} reads weight {fqn}, which weights.safetensors does not "
                                "hold; the artifact is inconsistent, re-export it")
        if w.dtype != dtype or (w.nbytes + 63) // 64 * 64 != nbytes or not w.is_contiguous():
            raise ArtifactError(
                f"{path}: program {name} was compiled for weight {fqn} as {str(dtype).removeprefix('torch.')} of "
                f"{nbytes} bytes (64-byte aligned), but weights.safetensors holds {_describe(w)} ({w.nbytes} bytes); the artifact "
                "is inconsistent, re-export it")


def _remove_stale_dirs() -> None:
    """Temp dirs of loads killed before they cleaned up (kvtrace-aoti-<pid>-*, that pid gone, ours)."""
    for d in Path(tempfile.gettempdir()).glob("kvtrace-aoti-*-*"):
        m = re.fullmatch(r"kvtrace-aoti-(\d+)-.+", d.name)
        try:
            if m is None or not d.is_dir() or d.stat().st_uid != os.getuid() or int(m.group(1)) == os.getpid():
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (OSError, OverflowError):  # alive under another user, or vanished meanwhile
            continue


def _logits_only(runner: Callable[..., list[torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """AOTInductor returns a list of outputs; a Decoder program has exactly one (logits [B, T, V])."""

    def run(*flat: torch.Tensor) -> torch.Tensor:
        return runner(*flat)[0]

    return run


def load(path: str | os.PathLike[str], *, expected_sha256: str | None = None) -> Artifact:
    """Load an artifact written by ``kvtrace.export``. Imports neither transformers nor pickle.

    ``expected_sha256``: the SHA-256 (hex) of the whole file you trust; checked before anything in the
    file is parsed. Use it for every ``aoti``/``aoti-packed`` artifact you did not build yourself: those
    contain native code, which loading runs. Every check ``load`` makes is listed in this module's
    docstring; each failure raises ``ArtifactError`` (``UsageError`` for a missing path or a directory).
    """
    path = Path(path)
    if expected_sha256 is not None and path.is_file():
        _check_file_hash(path, expected_sha256)
    manifest, blobs = _read_zip(path)
    weights = _load_weights(path, blobs[WEIGHTS], manifest)
    tokenizer_json = None
    if TOKENIZER in blobs:
        try:
            tokenizer_json = blobs[TOKENIZER].decode()
        except UnicodeDecodeError as e:
            raise ArtifactError(f"{path}: tokenizer.json is not UTF-8 text ({e}); re-export the artifact") from e
    _check_signatures(path, manifest)
    keepalive: list[Any] = [weights]
    try:
        if manifest.backend == "exported":
            programs = {p: _exported_program(path, p, blobs[f"programs/{p}.json"], weights, manifest)
                        for p in manifest.programs}
        else:
            programs = _aoti_programs(path, manifest, blobs[AOTI_PACKAGE], weights)
    except ArtifactError:
        raise
    except Exception as e:
        if manifest.torch_version != torch.__version__:
            hint = (f"The artifact was written by torch {manifest.torch_version[:40]}, this is torch "
                    f"{torch.__version__}; re-export it with this torch")
        else:
            hint = f"It was written by this torch ({torch.__version__}), so the file is corrupt; re-export it"
        raise ArtifactError(
            f"{path}: could not load the {manifest.backend} programs ({type(e).__name__}: {_clip(str(e), 300)}). {hint}"
        ) from e
    return Artifact(path, manifest, programs, tokenizer_json, keepalive)
