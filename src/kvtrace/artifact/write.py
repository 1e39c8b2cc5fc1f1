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
from kvtrace.artifact.reader import _ALIGN, _ST_DTYPES
from kvtrace.spec.manifest import MANIFEST, TOKENIZER, WEIGHTS, Manifest

__all__ = ["dedupe_weights", "program_signature", "safetensors_layout", "write_artifact"]


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


_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}  # torch dtype -> safetensors name, as read


def safetensors_layout(weights: dict[str, torch.Tensor]) -> tuple[bytes, list[Any]]:
    """``weights`` as a safetensors file without building it in memory: (the 8-byte length and JSON header,
    the data as buffers over the tensors' own memory, in file order). safetensors' ``save`` copied every
    byte into one bytes object first (SmolLM2 fp32: 2.2 s of a cold export, and a second 540 MB).

    Data order: tensors whose size is a multiple of 64 bytes first (every one then starts 64-byte aligned, as
    the reader wants them: it copies one that does not), the rest by itemsize, largest first (each still on its
    own itemsize), by name within each group. No gaps, no overlap: the file is what safetensors' loader reads."""
    import json

    cpu = {n: t.detach().cpu().contiguous() for n, t in weights.items()}
    for name, t in cpu.items():
        if t.dtype not in _ST_NAMES:
            raise UsageError(f"weight {name} is {t.dtype}, which an artifact cannot store; expected one of "
                             f"{sorted(str(d).removeprefix('torch.') for d in _ST_NAMES)}")
    order = sorted(cpu, key=lambda n: (cpu[n].nbytes % _ALIGN != 0, -cpu[n].element_size(), n))
    table, data, offset = {}, [], 0
    for name in order:
        t = cpu[name]
        table[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
        data.append(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's bytes, not a copy
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes with spaces
    return len(text).to_bytes(8, "little") + text, data


def write_artifact(
    path: str | os.PathLike[str],
    manifest: Manifest,
    weights: dict[str, torch.Tensor],
    files: dict[str, bytes],
    tokenizer_json: str | None,
    *,
    deflate_programs: bool = True,
) -> Path:
    """Write atomically: a temp file in the same folder, renamed into place only when complete, with the
    permissions a new file gets under the caller's umask. The manifest written records the size and
    SHA-256 of every other member and the shape and dtype of every weight.

    ``deflate_programs``: program members deflated (level 1), for programs that are code (weights stored beside
    them: an aoti package deflates ~3-15x in a fraction of a second); False stores them as they are, for
    programs that embed the weights (aoti-packed). Those barely shrink (SmolLM2 int8: 340 -> 295 MB), a weight
    of a bf16 or GGUF origin at most ~2x, and inflating runs ~100 MB/s on a 2-core machine: loading SmolLM2's
    packed fp32 program took 5.9-6.3 s deflated, 1.8 s stored (int8: 4.4-4.5 vs 1.2 s; stop 41)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"output path {path} is a directory; expected a file name such as model.kvt")
    path.parent.mkdir(parents=True, exist_ok=True)
    header, data = safetensors_layout(weights)
    blobs: dict[str, bytes] = {}
    if tokenizer_json is not None:
        blobs[TOKENIZER] = tokenizer_json.encode()
    blobs.update(files)
    digest = hashlib.sha256(header)
    for buf in data:
        digest.update(buf)
    size = len(header) + sum(b.nbytes for b in data)
    manifest = dataclasses.replace(
        manifest,
        members={WEIGHTS: {"size": size, "sha256": digest.hexdigest()},
                 **{n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in blobs.items()}},
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
            with zf.open(WEIGHTS, "w", force_zip64=size > zipfile.ZIP64_LIMIT) as out:  # stored, streamed
                out.write(header)
                for buf in data:
                    out.write(buf)
            for name, blob in blobs.items():
                if name.startswith("programs/") and deflate_programs:
                    # level 1: level 6 (the default) took 55 s for a packed SmolLM2 fp32 program (517 MiB), level 1
                    # 9 s, for 255 vs 269 MiB
                    zf.writestr(name, blob, compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)
                else:
                    zf.writestr(name, blob)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
