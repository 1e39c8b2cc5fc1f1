"""Writing an artifact: program signatures, tied weights stored once, the atomic zip write.

The layout the file gets is described in ``artifact.archive``; what ``load`` checks of it, there too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import UsageError
from kvtrace.spec.manifest import MANIFEST, TOKENIZER, WEIGHTS, Manifest

__all__ = ["dedupe_weights", "program_signature", "write_artifact"]


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
