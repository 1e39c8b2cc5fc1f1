"""The artifact writer's weights member (``write.safetensors_layout``): streamed from the tensors' own memory, a
file safetensors' own loader reads to the same tensors, laid out so the reader's views start 64-byte aligned."""

from __future__ import annotations

import zipfile

import pytest
import torch
from safetensors.torch import load

import kvtrace
from conftest import tiny_model
from kvtrace._errors import UsageError
from kvtrace.artifact.reader import _safetensors_views
from kvtrace.artifact.write import safetensors_layout
from kvtrace.spec.manifest import WEIGHTS

WEIGHTS_OF_EVERY_KIND = {
    "w": torch.randn(64, 48),
    "odd": torch.arange(5, dtype=torch.float32),  # 20 bytes: not a multiple of 64
    "half": torch.randn(3, 7).to(torch.bfloat16),
    "fp16": torch.randn(33).half(),
    "ids": torch.arange(9, dtype=torch.int64),
    "q": torch.randint(-128, 127, (3, 5), dtype=torch.int8),
    "u": torch.randint(0, 255, (7,), dtype=torch.uint8),
    "mask": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
    "t": torch.randn(16, 8).t(),  # not contiguous: stored as its values
}


def _file(weights):
    header, data = safetensors_layout(weights)
    return header + b"".join(bytes(b) for b in data)


def test_safetensors_loads_the_streamed_file_to_the_same_tensors():
    back = load(_file(WEIGHTS_OF_EVERY_KIND))
    assert set(back) == set(WEIGHTS_OF_EVERY_KIND)
    for name, t in WEIGHTS_OF_EVERY_KIND.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_the_readers_views_are_the_tensors_and_the_whole_sized_ones_start_aligned():
    blob = _file(WEIGHTS_OF_EVERY_KIND)
    header_end = 8 + int.from_bytes(blob[:8], "little")
    buf = torch.empty(len(blob) + 64, dtype=torch.uint8)
    start = -(buf.data_ptr() + header_end) % 64  # where the reader puts the data section: 64-byte aligned
    buf = buf[start : start + len(blob)]
    buf.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    views = _safetensors_views(buf)
    for name, t in WEIGHTS_OF_EVERY_KIND.items():
        assert torch.equal(views[name], t), name
        if t.nbytes % 64 == 0:  # a view of the buffer, not a copy, and aligned as torch allocates
            assert views[name].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), name
            assert views[name].data_ptr() % 64 == 0, name


def test_a_weight_of_a_dtype_safetensors_cannot_hold_is_one_line():
    with pytest.raises(UsageError, match=r"weight c is torch.complex64, which an artifact cannot store; expected"):
        safetensors_layout({"c": torch.zeros(2, dtype=torch.complex64)})


def test_an_artifacts_weights_member_is_what_it_records(tmp_path):
    path = kvtrace.export(tiny_model("llama"), tmp_path / "t.kvt", max_seq_len=16, backend="exported")
    art = kvtrace.load(path)  # checks the member's size and SHA-256 against the manifest
    with zipfile.ZipFile(path) as zf:
        info, stored = zf.getinfo(WEIGHTS), load(zf.read(WEIGHTS))  # zipfile checks the CRC
    assert info.compress_type == zipfile.ZIP_STORED and info.file_size == art.manifest.members[WEIGHTS]["size"]
    assert set(stored) == set(art.manifest.weights)
