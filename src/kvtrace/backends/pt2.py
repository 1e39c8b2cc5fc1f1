"""What kvtrace reads of an AOTInductor ``.pt2`` package, and the temp dirs its libraries are loaded from.

Nothing in a package is unpickled, compiled or extracted but the compiled model libraries (and their
extern-kernel node files): torch's package loader would unpickle weights, constants, custom objects or
exported programs, so a package holding any of those is refused before torch sees it.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

from kvtrace._errors import ArtifactError

__all__ = ["TEMP_PREFIX", "libraries", "remove_stale_dirs"]

TEMP_PREFIX = "kvtrace-aoti-"  # + "<pid>-<random>": one load's libraries, removed once they are mapped

# The members torch's .pt2 packaging may hold, and what kvtrace accepts of them. Anything else is refused:
# models/*.json + data/weights|constants/* (exported programs with weights and constants, which torch's
# package loader unpickles when a payload says use_pickle, or when it is a custom or opaque object),
# extra/*, data/sample_inputs/*, and a model folder's weights_config.json / custom_objs_config.json.
_BOOKKEEPING = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
_MODEL_FILE = re.compile(r"data/aotinductor/([A-Za-z_][A-Za-z0-9_]*)/([A-Za-z0-9_.\-]+)")
_NEVER = ("weights_config.json", "custom_objs_config.json")


def libraries(what: str, blob: bytes, models: set[str], optional: frozenset[str] = frozenset()
              ) -> dict[str, dict[str, bytes]]:
    """Check the package's member list; model name -> {".so": library, ".json": extern kernel nodes (if
    any)} for every one of ``models`` and those of ``optional`` the package holds. ``what`` names the package
    in messages ("<artifact>: programs/aoti.pt2")."""
    from kvtrace.spec.manifest import clip, short

    try:
        zf = zipfile.ZipFile(io.BytesIO(blob))
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as e:
        raise ArtifactError(f"{what} is not a readable package ({clip(str(e))}); re-export the artifact") from e
    roots = {i.filename.split("/", 1)[0] for i in infos}
    if len(roots) != 1 or sum(i.file_size for i in infos) > len(blob):
        raise ArtifactError(f"{what} is not a package as torch writes it (one root folder, stored members); re-export it")
    files: dict[str, dict[str, bytes]] = {}
    for info in infos:
        rel = info.filename.split("/", 1)[1] if "/" in info.filename else ""
        if rel in _BOOKKEEPING:
            continue
        m = _MODEL_FILE.fullmatch(rel)
        ext = Path(rel).suffix
        if (m is None or m.group(2) in _NEVER or ext not in (".so", ".cpp", ".json")
                or info.compress_type != zipfile.ZIP_STORED):
            raise ArtifactError(
                f"{what} holds {short(info.filename)}, which kvtrace never writes (torch's loader could unpickle or "
                "build it); refusing to load it. Re-export the artifact with kvtrace")
        model, fname = m.group(1), m.group(2)
        if model not in models and model not in optional:
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


def remove_stale_dirs() -> None:
    """Temp dirs of loads killed before they cleaned up (kvtrace-aoti-<pid>-*, that pid gone, ours)."""
    for d in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*-*"):
        m = re.fullmatch(rf"{TEMP_PREFIX}(\d+)-.+", d.name)
        try:
            if m is None or not d.is_dir() or d.stat().st_uid != os.getuid() or int(m.group(1)) == os.getpid():
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (OSError, OverflowError):  # alive under another user, or vanished meanwhile
            continue
