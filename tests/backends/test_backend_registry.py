"""The backend registry and the Backend protocol: names, lookups, registering a backend of one's own,
and each built-in backend's capabilities against what it does."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import kvtrace
from conftest import tiny_model
from kvtrace._errors import ArtifactError, UsageError
from kvtrace.backends import aoti, registry
from kvtrace.backends.aoti import PACKAGE
from kvtrace.backends.base import Backend
from kvtrace.backends.exported import ExportedBackend

BUILT_IN = ("exported", "aoti", "aoti-packed", "executorch")


def test_the_registry_lists_the_built_in_backends():
    assert registry.names() == BUILT_IN
    for name in BUILT_IN:
        b = registry.get(name)
        assert isinstance(b, Backend) and b.name == name and b.summary


def test_an_unknown_name_is_one_line_listing_the_names(tmp_path):
    with pytest.raises(UsageError) as e:
        registry.get("tflite")
    msg = str(e.value)
    assert "\n" not in msg and "'tflite'" in msg and all(repr(n) in msg for n in BUILT_IN)
    with pytest.raises(UsageError, match="backend must be one of"):
        registry.get(["aoti"])  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="backend must be one of"):
        kvtrace.export(tiny_model("llama"), tmp_path / "m.kvt", backend="tflite")
    assert list(tmp_path.iterdir()) == []


def test_registering_rejects_what_is_not_a_new_backend():
    with pytest.raises(UsageError, match="is empty or taken"):
        registry.register(ExportedBackend("aoti", "a second aoti"))
    with pytest.raises(UsageError, match=r"takes a kvtrace\.backends\.base\.Backend"):
        registry.register("aoti")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="built in"):
        registry.unregister("exported")
    assert registry.names() == BUILT_IN


def test_the_registry_imports_no_torch():
    code = "import sys; from kvtrace.backends import registry; registry.names(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]


class _Toy(ExportedBackend):
    """A backend of one's own: exported programs, under another name."""


@pytest.fixture
def toy():
    b = registry.register(_Toy("toy", "exported programs under another name"))
    try:
        yield b
    finally:
        registry.unregister("toy")


def test_a_registered_backend_serves_export_load_and_the_cli(toy, tmp_path):
    from kvtrace.cli.main import build_parser

    assert registry.names() == (*BUILT_IN, "toy") and registry.get("toy") is toy
    path = kvtrace.export(tiny_model("llama"), tmp_path / "toy.kvt", max_seq_len=16, backend="toy")
    art = kvtrace.load(path)
    assert art.manifest.backend == "toy"
    assert art.session().prefill(torch.tensor([[1, 2, 3]])).shape == (1, 3, 128)
    args = build_parser().parse_args(["export", "m", "-o", "x.kvt", "--backend", "toy"])
    assert args.backend == "toy"
    registry.unregister("toy")  # undone: the name is gone everywhere again
    assert registry.names() == BUILT_IN
    with pytest.raises(ArtifactError, match=r"unknown backend 'toy' in manifest; expected one of \('exported'"):
        kvtrace.load(path)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["export", "m", "-o", "x.kvt", "--backend", "toy"])


# --- capabilities against behaviour ------------------------------------------------------------------
def test_exported_capabilities_match_its_artifact(tmp_path):
    b = registry.get("exported")
    assert not (b.native_code or b.packs_weights or b.one_program or b.no_compile_cache)
    path = kvtrace.export(tiny_model("llama"), tmp_path / "e.kvt", max_seq_len=16, backend="exported")
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
    programs = kvtrace.load(path).manifest.programs
    assert b.members(programs) == {f"programs/{p}.json" for p in programs} <= names  # one data file per program
    assert b.compiled(programs) == dict(programs)
    assert kvtrace.load(path).manifest.weights  # weights stored outside the programs


@pytest.mark.parametrize("name", ["aoti", "aoti-packed"])
def test_aoti_capabilities_match_what_compile_does(name, monkeypatch, tmp_path):
    """Without compiling: aot_compile and the packager are stubbed, and what compile hands them recorded."""
    import torch._inductor.package

    b = registry.get(name)
    assert b.native_code and b.no_compile_cache and b.members(["prefill", "decode"]) == {PACKAGE}
    assert b.packs_weights == b.one_program == (name == "aoti-packed")
    calls = []

    def fake_compile(module, args, options):
        calls.append((options["aot_inductor.model_name_for_generated_files"], options,
                      torch.compiler.config.force_disable_caches))
        return [str(tmp_path / "x.so")]

    monkeypatch.setattr(torch._inductor, "aot_compile", fake_compile)
    monkeypatch.setattr(aoti, "PARALLEL_COMPILE", False)  # in this process, where the stub is
    monkeypatch.setattr(aoti, "probe_vec_isa", lambda: None)
    monkeypatch.setattr(torch._inductor.package, "package_aoti", lambda path, files: Path(path).write_bytes(b"pt2"))

    class One(torch.nn.Module):
        def forward(self, x):
            return x + 1

    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "GenuineIntel")
    ep = torch.export.export(One(), (torch.ones(1, 2),))  # tokens of one row
    specs = {"prefill": "prefill spec", "decode": "decode spec"}  # no served_by: aoti-packed compiles decode too
    compiled = b.compiled(specs)
    assert compiled == ({"step": "prefill spec", "decode": "decode spec"} if b.one_program else specs)
    assert b.compile({n: ep for n in compiled}, torch.float32) == {PACKAGE: b"pt2"}
    assert [c[0] for c in calls] == list(compiled)
    rows = torch.export.export(One(), (torch.ones(2, 2),))  # over two rows: packed fp32 on Intel adds step_one
    calls.clear()
    b.compile({n: rows for n in compiled}, torch.float32)
    assert [c[0] for c in calls] == list(compiled) + (["step_one"] if b.packs_weights else [])
    assert all(c[2] for c in calls)  # compiled with Inductor's caches off
    assert all(c[1]["aot_inductor.package_constants_in_so"] == b.packs_weights for c in calls)
    assert torch.compiler.config.force_disable_caches is False  # only while compiling


def test_one_program_backends_refuse_decoders_with_more_programs():
    registry.get("aoti").check_programs(["prefill", "decode", "prefill_image"], "Vision")
    with pytest.raises(UsageError, match=r"aoti-packed serves prefill and decode from one program.*--backend aoti"):
        registry.get("aoti-packed").check_programs(["prefill", "decode", "prefill_image"], "Vision")
