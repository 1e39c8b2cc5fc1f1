"""Native code and the CPU it was compiled for (``backends.cpu_isa``): Inductor builds an artifact's libraries with
``-march=native``, so one exported on a CPU with AVX-512 or AMX died of SIGILL, with no message, at its first call
on a CPU without. The manifest records the extensions the compiler was allowed to use and load refuses a CPU that
lacks one, in one line; the artifact cache keys native entries on the CPU."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path

import pytest

import kvtrace
from conftest import tiny_model
from kvtrace._errors import ArtifactError
from kvtrace.artifact.store import artifact_key
from kvtrace.backends import cpu_isa

HERE = frozenset({"sse4_2", "avx", "avx2", "fma"})  # the CPU the tests pretend to run on


def manifest_dict(path: Path) -> dict:
    with zipfile.ZipFile(path) as zf:
        return json.loads(zf.read("manifest.json"))


def with_manifest(src: Path, dst: Path, d: dict) -> Path:
    """A copy of ``src`` whose manifest is ``d`` (the members, and so their recorded hashes, unchanged)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, json.dumps(d) if info.filename == "manifest.json" else zin.read(info))
    return dst


@pytest.fixture(scope="module")
def data_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("isa") / "tiny.kvt"
    kvtrace.export(tiny_model("llama"), path, max_seq_len=16, backend="exported")
    return path


def _fake_compiler(tmp_path, text: str, name: str = "g++") -> str:
    exe = tmp_path / name
    exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_the_extensions_are_read_from_what_the_compiler_enables(tmp_path, monkeypatch):
    gcc = _fake_compiler(tmp_path, "The following options are target specific:\n"
                                   "  -m64                        \t\t[enabled]\n"
                                   "  -mavx2                      \t\t[enabled]\n"
                                   "  -mavx512f                   \t\t[disabled]\n"
                                   "  -msse4.2                    \t\t[enabled]\n"
                                   "  -mamx-tile                  \t\t[enabled]\n"
                                   "  -mlzcnt                     \t\t[enabled]")
    assert cpu_isa._enabled_by(gcc, ["-march=native"]) == {"avx2", "sse4_2", "amx_tile", "abm"}
    assert cpu_isa._enabled_by(str(tmp_path / "no-such-compiler"), []) is None
    assert cpu_isa._enabled_by(_fake_compiler(tmp_path, "clang: error: unknown argument", "clang++"), []) is None

    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: HERE | {"sse", "ht", "avx512f"})
    monkeypatch.setattr(cpu_isa, "_inductor_flags", lambda: (gcc, ["-march=native"]))
    assert cpu_isa.compiled_features() == ("abm", "amx_tile", "avx2", "sse4_2")
    # a compiler that does not say (clang): every compute extension of this CPU, never too few
    monkeypatch.setattr(cpu_isa, "_inductor_flags", lambda: (str(tmp_path / "no-such-compiler"), []))
    assert cpu_isa.compiled_features() == ("avx", "avx2", "avx512f", "fma", "sse4_2")
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: None)  # not x86 Linux: nothing recorded, nothing checked
    assert cpu_isa.compiled_features() is None
    assert cpu_isa.missing_features(["avx512f"]) == []


def test_this_machine_reads_its_own_flags():
    flags = cpu_isa.cpu_flags()
    if flags is None:  # off x86 Linux the check is off by design (nothing recorded); the other tests fake the flags
        pytest.skip("not an x86 Linux machine: no /proc/cpuinfo flags to read (the check is off there)")
    assert "sse2" in flags  # every x86-64 CPU
    assert cpu_isa.missing_features(sorted(flags & set(cpu_isa.GCC_TO_CPUINFO.values()))) == []


def test_a_cpu_without_a_recorded_extension_is_refused_in_one_line(data_artifact, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: HERE)
    assert "cpu_features" not in manifest_dict(data_artifact)  # data programs: no native code
    assert kvtrace.load(data_artifact).manifest.cpu_features is None

    d = manifest_dict(data_artifact)
    d["cpu_features"] = ["avx2", "avx512f", "amx_tile"]
    newer = with_manifest(data_artifact, tmp_path / "newer.kvt", d)
    with pytest.raises(ArtifactError, match=r"compiled for a CPU with amx_tile, avx512f, which this CPU lacks: "
                                            r"their first call would die of an illegal instruction\. Re-export") as e:
        kvtrace.load(newer)
    assert "\n" not in str(e.value)

    d["cpu_features"] = ["avx2", "fma"]
    same = with_manifest(data_artifact, tmp_path / "same.kvt", d)
    assert kvtrace.load(same).manifest.cpu_features == ("avx2", "fma")

    d["cpu_features"] = ["avx2", "x" * 40]
    with pytest.raises(ArtifactError, match="cpu_features must be a list of CPU flag names"):
        kvtrace.load(with_manifest(data_artifact, tmp_path / "bad.kvt", d))


def test_the_artifact_cache_keys_native_entries_on_the_cpu(monkeypatch):
    opts = {"max_seq_len": 64, "dtype": "float32", "batch_size": 1}
    keys = {}
    for cpu in ("a", "b"):
        monkeypatch.setattr(cpu_isa, "fingerprint", lambda cpu=cpu: cpu)
        keys[cpu] = {b: artifact_key("d", backend=b, **opts) for b in ("exported", "aoti", "aoti-packed")}
    assert keys["a"]["exported"] == keys["b"]["exported"]  # data programs run anywhere
    assert keys["a"]["aoti"] != keys["b"]["aoti"]
    assert keys["a"]["aoti-packed"] != keys["b"]["aoti-packed"]


@pytest.mark.compile
def test_an_aoti_artifact_records_its_cpu_and_is_refused_before_its_library_is_loaded(tmp_path, monkeypatch):
    path = tmp_path / "tiny-aoti.kvt"
    kvtrace.export(tiny_model("llama"), path, max_seq_len=16, backend="aoti")
    recorded = kvtrace.load(path).manifest.cpu_features
    flags = cpu_isa.cpu_flags()
    if flags is None:
        assert recorded is None
        return
    assert recorded and set(recorded) <= flags
    assert {"sse4_2", "avx2"} & flags <= set(recorded)  # -march=native: what this CPU has, the compiler uses

    loaded = []
    from kvtrace.backends import aoti

    monkeypatch.setattr(aoti, "load_library", lambda *a, **k: loaded.append(a) or pytest.fail("library loaded"))
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags - {recorded[-1]}))
    with pytest.raises(ArtifactError, match=f"compiled for a CPU with {recorded[-1]}, which this CPU lacks"):
        kvtrace.load(path)
    assert loaded == []
