"""Reading an artifact: the file's hash, the bounded zip directory and members, the weights, the
recorded signatures. What is checked, and in which order, is listed in ``artifact.archive``.

Nothing is read that the manifest does not list, nothing larger than it declares, nothing before its
size and compression ratio are bounded; every member's SHA-256 is checked before the member is used.

The weights member (stored, not deflated) is read straight from the file into one 64-byte aligned buffer,
hashed in a second thread while the next chunk is read, and its tensors are views of that buffer: one copy
of the weights, not three (zipfile's bytes, safetensors' tensors, and the page faults of each).

A member its backend reads as a file (``Backend.file_members``: a compiled program package, hundreds of MB
when it embeds packed weights) is not read by ``read_zip``, only bounded: it comes back as a ``Member``
whose ``spill`` copies it to a file of the backend's, inflated and hashed chunk by chunk, and refuses it
(the copy removed) unless its SHA-256 is the manifest's, before the backend opens it. It is never whole
in memory, so loading a packed program peaks at what the loaded program holds, not three times that.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from kvtrace._errors import ArtifactError, UsageError
from kvtrace.artifact import hugepages
from kvtrace.backends import registry
from kvtrace.spec.manifest import (
    MANIFEST,
    TOKENIZER,
    WEIGHTS,
    Manifest,
    clip,
    compare_inputs,
    describe,
    expected_inputs,
    short,
)

__all__ = ["Member", "check_file_hash", "check_signatures", "load_weights", "read_zip"]

MANIFEST_MAX_BYTES = 16 << 20  # chat templates and signatures are small; a bigger manifest is not ours
MEMBER_MAX_BYTES = 1 << 40  # no single member of a real artifact comes near 1 TiB
MAX_RATIO = 100  # uncompressed / compressed per member: programs deflate ~3-15x, weights are stored (1x)
MAX_MEMBERS = 1024  # an artifact has a handful; a directory of millions would cost GBs to parse
_CHUNK = 1 << 20
_WEIGHTS_CHUNK = 32 << 20  # read one while the previous one is hashed
_SPILL_CHUNK = 4 << 20  # a spilled member's copy: one chunk inflated and written while the previous one is hashed
_ALIGN = 64  # Inductor's ALIGN_BYTES: where torch's allocator puts every tensor, and so every weight here
# safetensors dtype names -> torch dtypes (what safetensors.torch.save writes)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def check_file_hash(path: Path, expected: str) -> None:
    if not isinstance(expected, str) or re.fullmatch("[0-9a-fA-F]{64}", expected) is None:
        raise UsageError(f"expected_sha256 must be 64 hex digits (a SHA-256 of the whole file), got {short(expected)}")
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != expected.lower():
        raise ArtifactError(f"{path} has SHA-256 {h.hexdigest()}, expected {expected.lower()}: it is not the file you "
                            "trust (corrupt, or replaced); nothing in it was read")


def _expected_members(manifest: Manifest) -> set[str]:
    return {WEIGHTS, *registry.get(manifest.backend).members(manifest.programs)}


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes:
    """A member's bytes, never more than ``limit`` (the zip stream itself stops at the declared size).

    One read of at most ``limit + 1`` bytes: zipfile reads a stored member in one piece (and stops a deflated
    one at its declared size), so the bytes are copied once. Reading in 1 MiB chunks into a growing buffer
    copied a 540 MB weights member three times: 1.7 s vs 0.6 s of every warm start on a 2-core machine."""
    with zf.open(info) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ArtifactError(f"{info.filename} is larger than its declared {limit} bytes; the file is corrupt")
    return data


def _check_size(path: Path, info: zipfile.ZipInfo, limit: int) -> None:
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise ArtifactError(f"{path}: member {info.filename} uses zip compression method {info.compress_type}; kvtrace "
                            "writes stored or deflated members only. The file is not a kvtrace artifact")
    if info.file_size > limit or info.file_size > max(info.compress_size, 1) * MAX_RATIO + (1 << 16):
        raise ArtifactError(
            f"{path}: member {info.filename} claims {info.file_size} bytes uncompressed from {info.compress_size} "
            f"(at most {limit} bytes and {MAX_RATIO}x compression allowed); refusing to decompress it (a zip bomb?)")


def _seek_data(path: Path, f: BinaryIO, info: zipfile.ZipInfo) -> None:
    """Position ``f`` at the first byte of ``info``'s data, its local header checked as zipfile checks it:
    signature, name, no encryption, the directory's compression method."""
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise ArtifactError(f"{path}: the local header of {info.filename} is missing or damaged; the file is corrupt")
    flags, method, name_len, extra_len = struct.unpack("<2xHH16xHH", head[4:])
    name = f.read(name_len)
    if (name.decode("utf-8" if flags & 0x800 else "cp437", "replace") != info.filename or flags & 1
            or method != info.compress_type):
        raise ArtifactError(f"{path}: the local header of {info.filename} disagrees with the zip directory (name "
                            f"{short(name.decode('utf-8', 'replace'))}, method {method}, flags {flags:#x}); the file is corrupt")
    f.seek(extra_len, 1)


def _read_stored(path: Path, f: BinaryIO, info: zipfile.ZipInfo, size: int,
                 huge_pages: bool = False) -> tuple[torch.Tensor, str]:
    """A stored member's ``size`` bytes (its size in the directory, checked against the manifest) as a uint8
    tensor placed so that a safetensors data section (the bytes after its header) starts 64-byte aligned (in
    transparent huge pages with ``huge_pages``: ``hugepages.advise`` before the first byte is read), and
    their SHA-256 (which replaces zipfile's CRC check: the manifest's hash is the stronger one). The local
    header is checked as zipfile checks it: signature, name, no encryption, stored (``read_zip`` sends only
    stored weights here)."""
    _seek_data(path, f, info)
    available = os.fstat(f.fileno()).st_size - f.tell()
    if available < size:  # before allocating: a directory may claim any size for a short file
        raise ArtifactError(f"{path}: {info.filename} ends after {max(available, 0)} of its {size} bytes; the file is "
                            "truncated, re-export it")
    first = f.peek(8)[:8] if hasattr(f, "peek") else b""
    # a safetensors member's data section (after the u64 header length and the header) is what lands aligned
    skip = 8 + struct.unpack("<Q", first)[0] if len(first) == 8 else 0
    skip = skip if skip <= size else 0
    buf = torch.empty(size + _ALIGN, dtype=torch.uint8)
    if huge_pages:
        hugepages.advise(buf)
    start = -(buf.data_ptr() + skip) % _ALIGN
    out = buf[start : start + size]
    view = memoryview(out.numpy()) if size else memoryview(b"")
    h = hashlib.sha256()
    with ThreadPoolExecutor(1) as pool:  # hashlib releases the GIL: hash one chunk while the next is read
        pending = None
        for at in range(0, size, _WEIGHTS_CHUNK):
            part = view[at : at + _WEIGHTS_CHUNK]
            got = f.readinto(part)
            while got < len(part):
                more = f.readinto(part[got:])
                if not more:
                    raise ArtifactError(f"{path}: {info.filename} ends after {at + got} of its {size} bytes; the file "
                                        "is truncated, re-export it")
                got += more
            if pending is not None:
                pending.result()
            pending = pool.submit(h.update, part)
        if pending is not None:
            pending.result()
    return out, h.hexdigest()


def _copy_hashed(path: Path, f: BinaryIO, info: zipfile.ZipInfo, out: BinaryIO) -> str:
    """Write ``info``'s data (inflated if deflated) to ``out`` in chunks, each hashed in a second thread while
    the next is read and inflated (zlib and hashlib release the GIL); its SHA-256. Never more than the
    directory's ``file_size`` (a longer stream is refused as it comes), never fewer."""
    _seek_data(path, f, info)
    inflate = zlib.decompressobj(-zlib.MAX_WBITS) if info.compress_type == zipfile.ZIP_DEFLATED else None
    h, left, written = hashlib.sha256(), info.compress_size, 0
    pending: Future[Any] | None = None

    def emit(chunk: bytes) -> None:
        nonlocal pending, written
        if not chunk:
            return
        written += len(chunk)
        if written > info.file_size:
            raise ArtifactError(f"{path}: {info.filename} inflates past its declared {info.file_size} bytes; the "
                                "file is corrupt")
        out.write(chunk)
        if pending is not None:
            pending.result()
        pending = pool.submit(h.update, chunk)

    with ThreadPoolExecutor(1) as pool:
        while left:
            raw = f.read(min(_SPILL_CHUNK, left))
            if not raw:
                break
            left -= len(raw)
            if inflate is None:
                emit(raw)
                continue
            while raw:  # at most one chunk out per call: a small input cannot balloon in memory
                emit(inflate.decompress(raw, _SPILL_CHUNK))
                raw = inflate.unconsumed_tail
        if inflate is not None and not inflate.eof:
            emit(inflate.flush())
        if pending is not None:
            pending.result()
    if written != info.file_size or (inflate is not None and not inflate.eof):
        raise ArtifactError(f"{path}: {info.filename} ends after {written} of its {info.file_size} bytes; the file is "
                            "truncated or corrupt, re-export it")
    return h.hexdigest()


@dataclass(frozen=True)
class Member:
    """A member ``read_zip`` left in the artifact for its backend to copy out as a file (``file_members``),
    its size already checked against the manifest and the zip directory; ``sha256``: the manifest's."""

    path: Path  # the artifact
    name: str
    size: int
    sha256: str

    def spill(self, dest: Path, *, again: bool = False) -> Path:
        """Copy the member to ``dest`` (a new file), inflated and hashed as it goes (``_copy_hashed``); ``dest``
        once its SHA-256 is the manifest's. Otherwise ArtifactError, ``dest`` removed. ``again``: this is a
        copy made after the artifact was loaded (``fresh()``), so a difference means the file changed since."""
        fix = ("the file changed since it was loaded, load it again" if again
               else "the file is corrupt or was altered, re-export it")
        created = False  # only a copy this call made is removed on failure
        if dest.exists():
            raise UsageError(f"{dest} already exists; Member.spill writes a new file, it never replaces one")
        try:
            with zipfile.ZipFile(self.path) as zf:
                info = zf.getinfo(self.name)
                if info.file_size != self.size:
                    raise ArtifactError(f"{self.path}: member {self.name} is {info.file_size} bytes, its manifest says "
                                        f"{self.size}; {fix}")
                _check_size(self.path, info, MEMBER_MAX_BYTES)
                with self.path.open("rb") as f, dest.open("xb") as out:
                    created = True
                    digest = _copy_hashed(self.path, f, info, out)
            if digest != self.sha256:
                raise ArtifactError(f"{self.path}: member {self.name} does not match the SHA-256 its manifest records; "
                                    f"{fix}")
        except BaseException as e:
            if created:
                dest.unlink(missing_ok=True)
            if isinstance(e, (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, EOFError, OSError, zlib.error,
                              ValueError)):
                raise ArtifactError(f"{self.path} is not a readable kvtrace artifact ({clip(str(e), 200)}); {fix}") from e
            raise
        return dest


def read_zip(path: Path, huge_pages: bool = False) -> tuple[Manifest, dict[str, bytes | torch.Tensor | Member]]:
    """The manifest and every member, checked (see the module docstring): the weights member as a uint8
    tensor (``_read_stored``; ``huge_pages``: in transparent huge pages), a member the backend reads as a file (``Backend.file_members``) as a ``Member``
    (bounded here, hashed when it is copied out), every other one as bytes."""
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
                raise ArtifactError(f"{path} lists member(s) {short(dup)} twice; it is not a kvtrace artifact")
            by_name = {i.filename: i for i in infos}
            if MANIFEST not in by_name:
                raise ArtifactError(f"{path} has no manifest.json; it is not a kvtrace artifact")
            _check_size(path, by_name[MANIFEST], MANIFEST_MAX_BYTES)
            try:
                text = _read_member(zf, by_name[MANIFEST], MANIFEST_MAX_BYTES).decode()
            except UnicodeDecodeError as e:
                raise ArtifactError(f"{path}: manifest.json is not UTF-8 text ({e}); the file is corrupt") from e
            manifest = Manifest.from_json(text)
            if manifest.backend not in registry.names():
                raise ArtifactError(f"unknown backend {short(manifest.backend)} in manifest; "
                                    f"expected one of {registry.names()}")
            declared = manifest.members
            present = set(by_name) - {MANIFEST}
            unknown = sorted(present - set(declared))
            if unknown:
                raise ArtifactError(f"{path} holds member(s) {short(unknown)} that its manifest does not list; "
                                    "kvtrace refuses unknown members. Re-export the artifact")
            missing = sorted((_expected_members(manifest) | set(declared)) - present)
            if missing:
                raise ArtifactError(f"{path} lacks {missing}; the file is truncated or corrupt, re-export it")
            extra = sorted(present - _expected_members(manifest) - {TOKENIZER})
            if extra:
                raise ArtifactError(f"{path}: member(s) {short(extra)} do not belong to a {manifest.backend} artifact "
                                    f"of programs {sorted(manifest.programs)}; re-export it")
            for name in sorted(present):  # every size is checked against the directory before anything is read
                info, size = by_name[name], declared[name]["size"]
                if info.file_size != size:
                    raise ArtifactError(f"{path}: member {name} is {info.file_size} bytes, its manifest says {size}; "
                                        "the file is corrupt, re-export it")
                _check_size(path, info, MEMBER_MAX_BYTES)
            blobs: dict[str, bytes | torch.Tensor | Member] = {}
            as_files = registry.get(manifest.backend).file_members(manifest.programs)
            for name in sorted(present):
                info, size = by_name[name], declared[name]["size"]
                if name in as_files:
                    blobs[name] = Member(path, name, size, declared[name]["sha256"])
                    continue
                if name == WEIGHTS and info.compress_type == zipfile.ZIP_STORED:
                    with path.open("rb") as f:
                        blob, digest = _read_stored(path, f, info, size, huge_pages)
                else:
                    blob = _read_member(zf, info, size)  # CRC-checked by zipfile
                    digest = hashlib.sha256(blob).hexdigest()
                if digest != declared[name]["sha256"]:
                    raise ArtifactError(f"{path}: member {name} does not match the SHA-256 its manifest records; "
                                        "the file is corrupt or was altered, re-export it")
                blobs[name] = blob
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, zlib.error, ValueError,
            NotImplementedError, OverflowError) as e:
        raise ArtifactError(f"{path} is not a readable kvtrace artifact ({clip(str(e), 200)}); it is corrupt or "
                            "truncated") from e
    return manifest, blobs


def load_weights(path: Path, blob: bytes | torch.Tensor, manifest: Manifest,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The stored weights, checked against the manifest's weight table, plus the tied aliases (the same
    tensor under two names); moved to ``device`` once (None: kept on the CPU). ``blob``: the safetensors
    bytes, or ``read_zip``'s aligned buffer of them, whose tensors are then views (no copy)."""
    try:
        weights = _safetensors_views(blob if isinstance(blob, torch.Tensor) else torch.frombuffer(bytearray(blob),
                                                                                                   dtype=torch.uint8))
    except ValueError as e:
        raise ArtifactError(f"{path}: weights.safetensors is corrupt ({clip(str(e), 200)}); re-export the artifact") from e
    table = manifest.weights
    if set(weights) != set(table):
        diff = sorted(set(weights) ^ set(table))
        raise ArtifactError(f"{path}: weights.safetensors holds other weights than the manifest lists (differ: "
                            f"{short(diff)}); the artifact is inconsistent, re-export it")
    for name, t in weights.items():
        meta = table[name]
        if list(t.shape) != meta["shape"] or str(t.dtype).removeprefix("torch.") != meta["dtype"]:
            raise ArtifactError(f"{path}: weight {name} is {describe(t)}, the manifest says {describe(meta)}; "
                                "the artifact is inconsistent, re-export it")
    if device is not None and device.type != "cpu":
        weights = {name: t.to(device) for name, t in weights.items()}  # before the aliases: tied stay one tensor
    for alias, name in manifest.weight_aliases.items():
        if name not in weights or alias in weights:
            raise ArtifactError(f"{path}: weight alias {alias!r} -> {name!r} names "
                                f"{'a weight that is not stored' if name not in weights else 'a stored weight'}; "
                                "the artifact is inconsistent, re-export it")
        weights[alias] = weights[name]
    return weights


def _safetensors_views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``buf`` (uint8 [n]) as views of it; ValueError if it is not
    one. The format: u64 little-endian header length N, N bytes of JSON ({name: {dtype, shape, data_offsets
    [begin, end)}} and an optional "__metadata__"), then the data, every byte of it in exactly one tensor
    (safetensors' own rule, checked here as its loader checks it). A view whose start is not 64-byte aligned
    (a small tensor after an odd-sized one) is copied, so every weight is aligned as torch allocates it."""
    n = buf.numel()
    if n < 8:
        raise ValueError(f"{n} bytes, fewer than the 8-byte header length")
    (head,) = struct.unpack("<Q", buf[:8].numpy().tobytes())
    if head > n - 8 or head > MANIFEST_MAX_BYTES:  # a header of names and shapes is far smaller than a manifest
        raise ValueError(f"header length {head} does not fit {n} bytes")
    try:
        table = json.loads(buf[8 : 8 + head].numpy().tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not JSON: {e}") from e
    if not isinstance(table, dict):
        raise ValueError("its header is not a JSON object")
    table.pop("__metadata__", None)
    data, spans, out = buf[8 + head :], [], {}
    for name, entry in table.items():
        ok = isinstance(entry, dict) and entry.get("dtype") in _ST_DTYPES and isinstance(entry.get("shape"), list) \
            and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2 \
            and all(type(v) is int and v >= 0 for v in (*entry["shape"], *entry["data_offsets"]))
        if not ok:
            raise ValueError(f"tensor {short(name)} has a malformed entry {clip(str(entry), 120)}")
        dtype, shape, (begin, end) = _ST_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or end > data.numel():
            raise ValueError(f"tensor {short(name)}: bytes [{begin}, {end}) for {entry['dtype']} {shape} "
                             f"({numel * dtype.itemsize} bytes) in {data.numel()} bytes of data")
        spans.append((begin, end, name))
        t = data[begin:end]
        if t.data_ptr() % _ALIGN:
            t = t.clone()  # torch.empty aligns; the dtype view below needs the itemsize's alignment too
        out[name] = t.view(dtype).reshape(shape)
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise ValueError(f"tensor {short(name)} starts at byte {begin}, expected {covered}: tensors overlap or "
                             "leave a gap")
        covered = end
    if covered != data.numel():
        raise ValueError(f"its tensors cover {covered} of {data.numel()} data bytes")
    return out


def check_signatures(path: Path, manifest: Manifest) -> None:
    """The signatures recorded at export against what the CacheSpec and ProgramSpecs declare."""
    backend = registry.get(manifest.backend)
    compiled = backend.compiled(manifest.programs, set(manifest.signatures))
    if set(manifest.signatures) != set(compiled):
        raise ArtifactError(f"{path}: the manifest records signatures of {sorted(manifest.signatures)}, expected "
                            f"{sorted(compiled)}; the artifact is inconsistent, re-export it")
    backend.check_manifest(path, manifest)
    for name, program in compiled.items():
        actual = [(tuple(i["shape"]), i["dtype"]) for i in manifest.signatures[name]]
        compare_inputs(path, f"program {name} (as recorded at export)", expected_inputs(manifest, program), actual)
