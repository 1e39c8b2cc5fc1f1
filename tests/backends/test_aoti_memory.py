"""What a loaded AOTInductor artifact keeps resident. An aoti-packed library embeds every weight (prepacked) and the
CPU container copies them out when it is created, so a loaded program held the weights three times: the library's
bytes (kept for ``fresh()``), its mapped pages (read by that copy) and the copy (SmolLM2 int8 with its own decode
program: 1227 MiB resident after load, 590 MiB now). ``fresh()`` now reads the library again from the artifact,
checked, and the library's pages are handed back to the kernel once copied (``aoti._page_out``). Loading copies the
package from the artifact to disk chunk by chunk (``reader.Member.spill``) and the libraries out of it by the kernel,
so no step holds a package whole in memory (SmolLM2 fp32 packed: peak 2336 -> 1302 MiB), and a packed package is
stored, not deflated (its load 6.6 -> 2.2 s)."""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import zipfile

import pytest
import torch

import kvtrace
from conftest import tiny_model
from kvtrace._errors import ArtifactError
from kvtrace.artifact import reader
from kvtrace.backends import aoti

MIB = 1 << 20


def _resident(path: str) -> int:
    """Bytes of this process's mappings of ``path`` that are resident (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip("\n").endswith(" " + path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


# Linux only: resident pages per mapping are read from /proc/self/smaps, and _page_out is a no-op (returns 0)
# elsewhere by design; CI and every machine of this project run Linux, so it runs there.
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_page_out_hands_back_the_pages_of_a_mapped_file_once_read_and_keeps_its_contents(tmp_path):
    path = os.path.realpath(tmp_path / "lib.bin")
    data = os.urandom(32 * MIB)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fdatasync(f.fileno())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert hashlib.sha256(m).digest() == hashlib.sha256(data).digest()  # every page read
        before = _resident(path)
        assert before >= 30 * MIB
        asked = aoti._page_out(path)
        if asked == 0:  # madvise refused MADV_PAGEOUT (EINVAL before Linux 5.4): the documented best-effort no-op
            pytest.skip("madvise(MADV_PAGEOUT) is not available here (Linux < 5.4): pages stay resident")
        assert asked == 32 * MIB
        after = _resident(path)
        assert after < before // 4, f"{before / MIB:.1f} MiB resident before, {after / MIB:.1f} after"
        assert hashlib.sha256(m).digest() == hashlib.sha256(data).digest()  # read back from the file, unchanged
    finally:
        m.close()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    path = tmp_path_factory.mktemp("aoti-memory") / "packed.kvt"
    kvtrace.export(tiny_model("llama"), path, max_seq_len=16, backend="aoti-packed")
    return path


def _call(art, program) -> torch.Tensor:
    m = art.manifest
    with torch.inference_mode():
        return program(*aoti._probe_inputs(m, m.programs["decode"], m.cache_spec.allocate(torch.device("cpu"))))


@pytest.mark.compile
def test_a_fresh_program_is_read_again_from_the_artifact_and_refused_if_it_changed(packed, tmp_path):
    import shutil

    packed = shutil.copy(packed, tmp_path / "packed.kvt")  # changed below: the module's artifact stays whole
    art = kvtrace.load(packed)
    program = art._programs["decode"]
    first = _call(art, program)
    assert torch.equal(_call(art, program.fresh()), first)

    # the same bytes elsewhere in the package, changed after load: fresh() refuses, the loaded program runs on
    with zipfile.ZipFile(packed) as zf:
        info = zf.getinfo("programs/aoti.pt2")
        zf.fp.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(zf.fp.read(2), "little") for _ in range(2))
    at = info.header_offset + 30 + name_len + extra_len + info.compress_size // 2
    with open(packed, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ArtifactError, match="changed since it was loaded, load it again"):
        program.fresh()
    assert torch.equal(_call(art, program), first)


@pytest.mark.compile
def test_a_packed_package_is_stored_and_loading_never_holds_it_whole_in_memory(packed, monkeypatch):
    import tracemalloc

    with zipfile.ZipFile(packed) as zf:
        info = zf.getinfo(aoti.PACKAGE)
    assert info.compress_type == zipfile.ZIP_STORED  # embeds the weights: inflating them would cost every load
    kvtrace.load(packed)  # imports and one-time setup out of the measurement
    monkeypatch.setattr(reader, "_SPILL_CHUNK", 64 << 10)
    tracemalloc.start()
    try:
        art = kvtrace.load(packed)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < info.file_size // 4, f"loading held {peak} bytes at once of a {info.file_size}-byte package"
    m = art.manifest
    with torch.inference_mode():  # and it runs
        logits = art._programs["decode"](*aoti._probe_inputs(m, m.programs["decode"],
                                                                m.cache_spec.allocate(torch.device("cpu"))))
    assert logits.shape[-1] == m.vocab_size and torch.isfinite(logits).all()
