"""What kvtrace reads of an AOTInductor ``.pt2`` package, and the temp dirs its libraries are loaded from.

Nothing in a package is unpickled, compiled or extracted but the compiled model libraries (and their
extern-kernel node files): torch's package loader would unpickle weights, constants, custom objects or
exported programs, so a package holding any of those is refused before torch sees it.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import BinaryIO

from kvtrace._errors import ArtifactError
from kvtrace.backends.tempcopy import copy_range

__all__ = ["TEMP_PREFIX", "libraries"]

TEMP_PREFIX = "kvtrace-aoti-"  # + "<pid>-<random>" (tempcopy.new_dir): one load's libraries, removed once mapped

# The members torch's .pt2 packaging may hold, and what kvtrace accepts of them. Anything else is refused:
# models/*.json + data/weights|constants/* (exported programs with weights and constants, which torch's
# package loader unpickles when a payload says use_pickle, or when it is a custom or opaque object),
# extra/*, data/sample_inputs/*, and a model folder's weights_config.json / custom_objs_config.json.
_BOOKKEEPING = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
_MODEL_FILE = re.compile(r"data/aotinductor/([A-Za-z_][A-Za-z0-9_]*)/([A-Za-z0-9_.\-]+)")
_NEVER = ("weights_config.json", "custom_objs_config.json")


def libraries(what: str, package: Path, dest: Path, models: set[str], optional: frozenset[str] = frozenset(),
              wanted: Collection[str] | None = None) -> dict[str, dict[str, Path]]:
    """Check the package's member list and write the compiled libraries into ``dest`` under our own names; model
    name -> {".so": library, ".json": extern kernel nodes (if any)}, for every one of ``models`` and those of
    ``optional`` the package holds (only ``wanted`` of them, if given). ``package``: a hash-checked copy (no
    member is CRC-checked again); ``what`` names it in messages ("<artifact>: programs/aoti.pt2"). Each library
    is copied by the kernel, written back to disk (``fdatasync``) before it is mapped: reclaim then drops its
    clean pages (``aoti._page_out``)."""
    from kvtrace.spec.manifest import clip, short

    try:
        zf = zipfile.ZipFile(package)
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        raise ArtifactError(f"{what} is not a readable package ({clip(str(e))}); re-export the artifact") from e
    with zf:
        roots = {i.filename.split("/", 1)[0] for i in infos}
        if len(roots) != 1 or sum(i.file_size for i in infos) > package.stat().st_size:
            raise ArtifactError(f"{what} is not a package as torch writes it (one root folder, stored members); "
                                "re-export it")
        found: dict[str, dict[str, zipfile.ZipInfo]] = {}
        for info in infos:
            rel = info.filename.split("/", 1)[1] if "/" in info.filename else ""
            if rel in _BOOKKEEPING:
                continue
            m = _MODEL_FILE.fullmatch(rel)
            ext = Path(rel).suffix
            if (m is None or m.group(2) in _NEVER or ext not in (".so", ".cpp", ".json")
                    or info.compress_type != zipfile.ZIP_STORED):
                raise ArtifactError(
                    f"{what} holds {short(info.filename)}, which kvtrace never writes (torch's loader could unpickle "
                    "or build it); refusing to load it. Re-export the artifact with kvtrace")
            model, fname = m.group(1), m.group(2)
            if model not in models and model not in optional:
                raise ArtifactError(f"{what} holds a model {model!r}; the manifest's programs are {sorted(models)}")
            if ext == ".so" or (ext == ".json" and fname.endswith(".wrapper.json")):
                key = ".so" if ext == ".so" else ".json"
                if key in found.setdefault(model, {}):
                    raise ArtifactError(f"{what} holds two {key} files for model {model}; re-export the artifact")
                found[model][key] = info
        lacking = sorted(m for m in models if ".so" not in found.get(m, {}))
        if lacking:
            raise ArtifactError(f"{what} has no compiled library for {lacking}; re-export the artifact")
        files: dict[str, dict[str, Path]] = {}
        with package.open("rb") as src:
            for model, members in found.items():
                if wanted is not None and model not in wanted:
                    continue
                for key, info in members.items():
                    files.setdefault(model, {})[key] = _copy_out(what, src, info, dest / f"{model}{key}")
    return files


def _copy_out(what: str, src: BinaryIO, info: zipfile.ZipInfo, dest: Path) -> Path:
    """A stored member of the open package ``src`` copied to the new file ``dest`` (by the kernel where it can),
    written back before it is returned."""
    src.seek(info.header_offset)
    head = src.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise ArtifactError(f"{what}: the local header of {info.filename} is damaged; re-export the artifact")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    at, left = info.header_offset + 30 + name_len + extra_len, info.file_size
    if at + left > os.fstat(src.fileno()).st_size:
        raise ArtifactError(f"{what}: {info.filename} runs past the package's end; re-export the artifact")
    if copy_range(src, at, left, dest) != left:
        raise ArtifactError(f"{what}: {info.filename} ends early; re-export the artifact")
    return dest
