"""artifact.reader's weights path: a stored member read straight into one aligned buffer and hashed while it is
read, its safetensors tensors as views of that buffer, every malformed header refused (the artifacts built by
export are covered end to end in test_artifact.py)."""

from __future__ import annotations

import hashlib
import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from kvtrace._errors import ArtifactError, UsageError
from kvtrace.artifact import reader

# odd sizes on purpose: views after them start unaligned and are copied; the others stay views of the buffer
TENSORS = {"small": torch.arange(12, dtype=torch.float32).reshape(3, 4), "odd": torch.tensor([1, -2, 3], dtype=torch.int8),
           "b": torch.linspace(0, 1, 32, dtype=torch.bfloat16), "flag": torch.tensor([True]),
           "empty": torch.zeros(0, 5, dtype=torch.float16), "big": torch.randn(64, 16)}


def _zip(path: Path, name: str, blob: bytes) -> zipfile.ZipInfo:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("first.txt", b"x" * 37)  # the member under test does not start the file
        zf.writestr(name, blob)
    with zipfile.ZipFile(path) as zf:
        return zf.getinfo(name)


def test_a_stored_member_is_read_aligned_and_hashed(tmp_path):
    blob = save(TENSORS)
    info = _zip(tmp_path / "w.zip", "weights.safetensors", blob)
    with open(tmp_path / "w.zip", "rb") as f:
        buf, digest = reader._read_stored(tmp_path / "w.zip", f, info, len(blob))
    assert digest == hashlib.sha256(blob).hexdigest()
    assert buf.dtype == torch.uint8 and buf.numpy().tobytes() == blob
    (head,) = struct.unpack("<Q", blob[:8])
    assert (buf.data_ptr() + 8 + head) % 64 == 0  # the data section lands 64-byte aligned
    views = reader._safetensors_views(buf)
    expected = load(blob)
    assert views.keys() == expected.keys()
    for name, t in views.items():
        assert t.dtype == expected[name].dtype and torch.equal(t, expected[name]), name
        assert t.data_ptr() % 64 == 0 or t.numel() == 0, name  # aligned as torch allocates, copied if need be
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert start <= views["big"].data_ptr() < end  # a view of the buffer, not a copy


def test_a_member_whose_local_header_disagrees_or_that_ends_early_is_refused(tmp_path):
    blob = save(TENSORS)
    path = tmp_path / "w.zip"
    info = _zip(path, "weights.safetensors", blob)
    raw = bytearray(path.read_bytes())
    at = info.header_offset + 30
    raw[at : at + 7] = b"WEIGHTS"  # the local header's name, not the directory's
    (tmp_path / "renamed.zip").write_bytes(raw)
    with open(tmp_path / "renamed.zip", "rb") as f, pytest.raises(ArtifactError, match="disagrees with the zip directory"):
        reader._read_stored(tmp_path / "renamed.zip", f, info, len(blob))
    with open(path, "rb") as f, pytest.raises(ArtifactError, match=r"ends after \d+ of its \d+ bytes; the file is truncated"):
        reader._read_stored(path, f, info, path.stat().st_size)  # more bytes than the file holds after the header


def _st(header: dict, data: bytes) -> torch.Tensor:
    text = json.dumps(header).encode()
    return torch.frombuffer(bytearray(struct.pack("<Q", len(text)) + text + data), dtype=torch.uint8)


@pytest.mark.parametrize(("header", "data", "match"), [
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "y": {"dtype": "F32", "shape": [1],
      "data_offsets": [4, 8]}}, bytes(8), "tensors overlap or leave a gap"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "starts at byte 4, expected 0"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8), "cover 4 of 8 data bytes"),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), r"bytes \[0, 16\) .* in 8 bytes"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), r"\(12 bytes\)"),
    ({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), "malformed entry"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "malformed entry"),
    ({"x": [1, 2]}, b"", "malformed entry"),
])
def test_malformed_safetensors_headers_are_refused(header, data, match):
    with pytest.raises(ValueError, match=match):
        reader._safetensors_views(_st(header, data))


def test_headers_that_do_not_parse_are_refused():
    with pytest.raises(ValueError, match="fewer than the 8-byte header length"):
        reader._safetensors_views(torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"header length .* does not fit"):
        reader._safetensors_views(torch.frombuffer(bytearray(struct.pack("<Q", 100) + b"{}"), dtype=torch.uint8))
    with pytest.raises(ValueError, match="not JSON"):
        reader._safetensors_views(torch.frombuffer(bytearray(struct.pack("<Q", 2) + b"{]"), dtype=torch.uint8))
    with pytest.raises(ValueError, match="not a JSON object"):
        reader._safetensors_views(torch.frombuffer(bytearray(struct.pack("<Q", 2) + b"[]"), dtype=torch.uint8))


# --- a member its backend reads as a file: copied out in chunks, hashed as it goes ----------------------------
def _member(path: Path, blob: bytes, method: int, level: int = 1) -> reader.Member:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("first.txt", b"x" * 37)
        zf.writestr("programs/p.pt2", blob, compress_type=method, compresslevel=level)
    return reader.Member(path, "programs/p.pt2", len(blob), hashlib.sha256(blob).hexdigest())


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_member_spills_to_a_file_chunk_by_chunk_never_whole_in_memory(tmp_path, monkeypatch, method):
    import tracemalloc

    monkeypatch.setattr(reader, "_SPILL_CHUNK", 64 << 10)
    blob = torch.randint(0, 4, (8 << 20,), dtype=torch.uint8).numpy().tobytes()  # 8 MiB, deflates ~3x
    member = _member(tmp_path / "a.zip", blob, method)
    tracemalloc.start()
    try:
        out = member.spill(tmp_path / "copy")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out == tmp_path / "copy" and out.read_bytes() == blob
    assert peak < len(blob) // 8, f"spilling held {peak} bytes at once of an {len(blob)}-byte member"


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_spilled_member_that_is_not_the_manifests_is_refused_and_its_copy_removed(tmp_path, method):
    blob = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).numpy().tobytes()
    member = _member(tmp_path / "a.zip", blob, method)
    assert member.spill(tmp_path / "copy").read_bytes() == blob
    (tmp_path / "copy").unlink()
    other = reader.Member(member.path, member.name, member.size, hashlib.sha256(b"another").hexdigest())
    with pytest.raises(ArtifactError, match="does not match the SHA-256 its manifest records; the file is corrupt"):
        other.spill(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    with pytest.raises(ArtifactError, match="the file changed since it was loaded, load it again"):
        other.spill(tmp_path / "copy", again=True)  # fresh(): a copy made after load
    (tmp_path / "copy").write_bytes(b"theirs")  # never overwritten, nor removed
    with pytest.raises(UsageError, match=r"already exists; Member\.spill writes a new file"):
        member.spill(tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == b"theirs"
    (tmp_path / "copy").unlink()
    shorter = reader.Member(member.path, member.name, member.size - 1, member.sha256)
    with pytest.raises(ArtifactError, match=rf"is {len(blob)} bytes, its manifest says {len(blob) - 1}"):
        shorter.spill(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_a_deflated_member_that_inflates_past_or_short_of_its_size_is_refused(tmp_path):
    import zlib

    def data(n: int) -> bytes:
        return torch.randint(0, 4, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)).numpy().tobytes()

    blob = data(200_000)
    member = _member(tmp_path / "a.zip", blob, zipfile.ZIP_DEFLATED, level=0)  # deflate's stored blocks: room to spare
    with zipfile.ZipFile(member.path) as zf:
        info = zf.getinfo(member.name)
    start = info.header_offset + 30 + len(member.name) + len(info.extra)
    raw = member.path.read_bytes()
    for payload, match in [(data(210_000), "inflates past its declared 200000 bytes"),  # longer than the directory
                           (data(190_000), r"ends after \d+ of its 200000 bytes; the file is truncated or corrupt")]:
        deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
        stream = deflate.compress(payload) + deflate.flush()
        assert len(stream) <= info.compress_size  # fits the member's bytes: only the directory's size disagrees
        bad = bytearray(raw)
        bad[start : start + len(stream)] = stream
        (tmp_path / "bad.zip").write_bytes(bad)
        with pytest.raises(ArtifactError, match=match):
            reader.Member(tmp_path / "bad.zip", member.name, member.size, member.sha256).spill(tmp_path / "copy")
        assert not (tmp_path / "copy").exists()
