"""The artifact: one file holding programs, weights (once), cache spec, manifest and tokenizer.

Layout (a zip archive; weights stored uncompressed, programs deflated: a serialized program is mostly
repetitive graph metadata and would otherwise outweigh a small model's weights)::

    manifest.json            versioned Manifest (below), plain JSON
    weights.safetensors      every weight once, shared by all programs
    tokenizer.json           the `tokenizers` tokenizer (optional)
    programs/prefill.json    backend "exported": torch.export program, serialized without weights
    programs/decode.json     (one file per program the manifest lists, e.g. also prefill_image.json)
    programs/aoti.pt2        backend "aoti": AOTInductor package with one model per program;
                             backend "aoti-packed": one model ("step", T symbolic) serving prefill and
                             decode, its weights frozen and prepacked inside (weights.safetensors is empty)

Loading needs torch and kvtrace only: no transformers, and nothing is unpickled (JSON, safetensors
and AOTInductor's own package format).
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrace._cache_spec import CacheSpec
from kvtrace._errors import ArtifactError, UsageError
from kvtrace._program_spec import ProgramSpec
from kvtrace._session import Session

__all__ = ["FORMAT", "VERSION", "Artifact", "Manifest", "ModelInfo", "load", "write_artifact"]

FORMAT = "kvtrace.artifact"
VERSION = 1
BACKENDS = ("exported", "aoti", "aoti-packed")
PACKED_MODEL = "step"  # the one model of an aoti-packed package


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
        except json.JSONDecodeError as e:
            raise ArtifactError(f"manifest.json is not valid JSON ({e}); the file is corrupt") from e
        if not isinstance(d, dict):
            raise ArtifactError(f"manifest.json holds a JSON {type(d).__name__}, expected an object; the file is corrupt")
        if d.get("format") != FORMAT:
            raise ArtifactError(f"not a kvtrace artifact: manifest format is {d.get('format')!r}, expected {FORMAT!r}")
        if d.get("version") != VERSION:
            raise ArtifactError(
                f"artifact manifest version {d.get('version')!r} is not supported by this kvtrace "
                f"(reads version {VERSION}); re-export it with this kvtrace or install the matching version"
            )
        d.pop("format")
        d.pop("version")
        if not isinstance(d.get("cache_spec"), dict):
            raise ArtifactError(f"manifest has no cache_spec object (found {d.get('cache_spec')!r}); re-export it")
        d["cache_spec"] = CacheSpec.from_dict(d["cache_spec"])
        programs = d.get("programs")
        if not isinstance(programs, dict) or not {"prefill", "decode"} <= set(programs):
            raise ArtifactError(f"manifest lists programs {programs!r}; expected at least prefill and decode")
        d["programs"] = {name: ProgramSpec.from_dict(name, p) for name, p in programs.items()}
        try:
            d["eos_ids"] = tuple(int(i) for i in d.get("eos_ids", ()))
            m = cls(**d)
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"manifest fields do not match version {VERSION}: {e}") from e
        if m.backend not in BACKENDS:
            raise ArtifactError(f"unknown backend {m.backend!r} in manifest; expected one of {BACKENDS}")
        return m


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
    """Write atomically: a temp file in the same folder, renamed into place only when complete."""
    from safetensors.torch import save

    path = Path(path)
    if path.is_dir():
        raise UsageError(f"output path {path} is a directory; expected a file name such as model.kvt")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            zf.writestr("manifest.json", manifest.to_json())
            zf.writestr("weights.safetensors", save({k: v.cpu() for k, v in weights.items()}))
            if tokenizer_json is not None:
                zf.writestr("tokenizer.json", tokenizer_json)
            for name, blob in files.items():
                # level 1: a packed SmolLM2 fp32 program (517 MiB) deflates to 269 MiB in 9 s; level 6 (the
                # default) gets 255 MiB in 55 s, most of a cold export's time budget
                zf.writestr(name, blob, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
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

        return Tokenizer.from_str(self.tokenizer_json)

    def __repr__(self) -> str:
        m = self.manifest
        return f"Artifact({self.path.name}, {m.model_name or m.model_type}, backend={m.backend}, {m.cache_spec.describe()})"


def _read_zip(path: Path) -> tuple[Manifest, dict[str, bytes]]:
    if not path.is_file():
        raise UsageError(f"artifact {path} does not exist; create one with `kvtrace export`")
    try:
        with zipfile.ZipFile(path) as zf:
            names = set(zf.namelist())
            if "manifest.json" not in names:
                raise ArtifactError(f"{path} has no manifest.json; it is not a kvtrace artifact")
            try:
                text = zf.read("manifest.json").decode()
            except UnicodeDecodeError as e:
                raise ArtifactError(f"{path}: manifest.json is not UTF-8 text ({e}); the file is corrupt") from e
            manifest = Manifest.from_json(text)
            needed = ["weights.safetensors", *(
                ["programs/aoti.pt2"] if manifest.backend != "exported" else [f"programs/{p}.json" for p in manifest.programs]
            )]
            missing = [n for n in needed if n not in names]
            if missing:
                raise ArtifactError(f"{path} lacks {missing}; the file is truncated or corrupt, re-export it")
            blobs = {n: zf.read(n) for n in names if n != "manifest.json"}  # CRC-checked by zipfile
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, zlib.error) as e:
        raise ArtifactError(f"{path} is not a readable kvtrace artifact ({e}); it is corrupt or truncated") from e
    return manifest, blobs


def _load_weights(blob: bytes, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load as st_load

    try:
        weights = st_load(blob)
    except Exception as e:  # safetensors raises its own error type
        raise ArtifactError(f"weights.safetensors is corrupt ({e}); re-export the artifact") from e
    for alias, name in aliases.items():
        weights[alias] = weights[name]
    return weights


def _exported_program(blob: bytes, weights: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    from torch._export.serde.serialize import SerializedArtifact, deserialize

    graph = json.loads(blob)
    names = _program_weight_names(graph)
    state_dict: dict[str, torch.Tensor] = {n: weights[n] for n in names["buffers"]}
    state_dict.update({n: torch.nn.Parameter(weights[n], requires_grad=False) for n in names["params"]})
    constants = {n: weights[n] for n in names["constants"]}
    ep = deserialize(SerializedArtifact(blob, state_dict, constants, b""))
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


def _logits_only(runner: Callable[..., list[torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """AOTInductor returns a list of outputs; a Decoder program has exactly one (logits)."""

    def run(*flat: torch.Tensor) -> torch.Tensor:
        return runner(*flat)[0]

    return run


def load(path: str | os.PathLike[str]) -> Artifact:
    """Load an artifact written by ``kvtrace.export``. Imports neither transformers nor pickle."""
    path = Path(path)
    manifest, blobs = _read_zip(path)
    weights = _load_weights(blobs["weights.safetensors"], manifest.weight_aliases)
    tok = blobs.get("tokenizer.json")
    tokenizer_json = tok.decode() if tok is not None else None
    keepalive: list[Any] = [weights]
    try:
        if manifest.backend == "exported":
            programs = {p: _exported_program(blobs[f"programs/{p}.json"], weights) for p in manifest.programs}
        else:
            from kvtrace._compile import aoti_load, aoti_load_packed

            tmpdir = tempfile.TemporaryDirectory(prefix="kvtrace-aoti-")
            pkg = Path(tmpdir.name) / "aoti.pt2"
            pkg.write_bytes(blobs["programs/aoti.pt2"])
            if manifest.backend == "aoti-packed":
                step = _logits_only(aoti_load_packed(pkg, PACKED_MODEL))
                programs = {p: step for p in manifest.programs}
            else:
                programs = {p: _logits_only(aoti_load(pkg, weights, model_name=p)) for p in manifest.programs}
            keepalive.append(tmpdir)
    except ArtifactError:
        raise
    except Exception as e:
        if manifest.torch_version != torch.__version__:
            hint = (f"The artifact was written by torch {manifest.torch_version}, this is torch {torch.__version__}; "
                    "re-export it with this torch")
        else:
            hint = f"It was written by this torch ({torch.__version__}), so the file is corrupt; re-export it"
        raise ArtifactError(
            f"{path}: could not load the {manifest.backend} programs ({type(e).__name__}: {e}). {hint}"
        ) from e
    return Artifact(path, manifest, programs, tokenizer_json, keepalive)
