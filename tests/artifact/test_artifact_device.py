"""Where an artifact's programs run: the device recorded at export, checked at load, and CUDA on a GPU."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

import kvtrace
from conftest import tiny_model
from kvtrace._errors import ArtifactError, UsageError
from kvtrace.cli.main import main


@pytest.fixture(scope="module")
def cpu_art(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("device") / "tiny.kvt"
    kvtrace.export(tiny_model("llama"), path, max_seq_len=16, backend="exported")
    return path


def with_device(src: Path, dst: Path, device: object) -> Path:
    """A copy of ``src`` whose manifest records ``device`` (the manifest is not among the hashed members)."""
    with zipfile.ZipFile(src) as zin:
        entries = {i.filename: zin.read(i.filename) for i in zin.infolist()}
    d = json.loads(entries["manifest.json"])
    d["device"] = device
    entries["manifest.json"] = json.dumps(d).encode()
    with zipfile.ZipFile(dst, "w") as zout:
        for name, blob in entries.items():
            zout.writestr(name, blob)
    return dst


def test_a_cpu_artifact_records_no_device_and_loads_on_the_cpu(cpu_art):
    with zipfile.ZipFile(cpu_art) as zf:
        assert "device" not in json.loads(zf.read("manifest.json"))  # a CPU manifest reads as before devices
    art = kvtrace.load(cpu_art)
    assert art.manifest.device == "cpu" and art.device == torch.device("cpu")
    s = art.session(device="cpu")
    assert s.device == torch.device("cpu") and all(t.device.type == "cpu" for t in s.state)


def test_a_cuda_artifact_on_a_machine_without_cuda_is_one_clear_line(cpu_art, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = with_device(cpu_art, tmp_path / "cuda.kvt", "cuda")
    with pytest.raises(UsageError, match=r"compiled for cuda\) needs a CUDA GPU, but this machine has none") as e:
        kvtrace.load(path)
    assert "\n" not in str(e.value)


def test_a_program_runs_only_on_the_device_type_it_was_compiled_for(cpu_art, tmp_path):
    with pytest.raises(UsageError, match="compiled for cpu, so they cannot run on cuda"):
        kvtrace.load(cpu_art, device="cuda")
    with pytest.raises(UsageError, match="compiled for cuda, so they cannot run on cpu"):
        kvtrace.load(with_device(cpu_art, tmp_path / "cuda.kvt", "cuda"), device="cpu")


@pytest.mark.parametrize("bad", ["tpu", 3, None])
def test_a_manifest_naming_an_unknown_device_is_refused(cpu_art, tmp_path, bad):
    with pytest.raises(ArtifactError, match="device must be one of"):
        kvtrace.load(with_device(cpu_art, tmp_path / "bad.kvt", bad))


def test_a_session_on_another_device_than_the_artifact_is_refused(cpu_art):
    art = kvtrace.load(cpu_art)
    with pytest.raises(UsageError, match="was loaded on cpu"):
        art.session(device="meta")


def test_export_for_cuda_without_a_gpu_fails_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = tiny_model("llama")
    before = {n: p.device for n, p in model.named_parameters()}
    with pytest.raises(UsageError, match="export to device cuda needs a CUDA GPU"):
        kvtrace.export(model, tmp_path / "x.kvt", max_seq_len=16, device="cuda")
    assert not (tmp_path / "x.kvt").exists()
    assert {n: p.device for n, p in model.named_parameters()} == before
    with pytest.raises(UsageError, match="must be one of"):
        kvtrace.export(model, tmp_path / "x.kvt", max_seq_len=16, device="gpu")


def test_cli_device_cuda_without_a_gpu_exits_2_with_one_line(cpu_art, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["export", "smollm2-135m-instruct", "-o", str(tmp_path / "x.kvt"), "--device", "cuda", "-q"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "needs a CUDA GPU" in err
    assert main(["run", str(with_device(cpu_art, tmp_path / "c.kvt", "cuda")), "--prompt", "hi", "-q"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["export", "x", "-o", str(tmp_path / "y.kvt"), "--device", "gpu"])
    assert e.value.code == 2 and "expected cpu, cuda or cuda:N" in capsys.readouterr().err


# --- on a GPU ------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.compile
@pytest.mark.parametrize("backend", ["aoti", "exported"])
def test_export_for_cuda_runs_on_the_gpu_and_verifies_against_eager(backend, tmp_path):
    """Programs captured and compiled for CUDA: manifest device, weights and state on the GPU, logits and every
    cache layer within tolerance of eager HF on the GPU at every step; the caller's CPU model untouched."""
    from kvtrace.tools.runners import EagerRunner, SessionRunner

    model = tiny_model("llama")
    path = kvtrace.export(model, tmp_path / "tiny.kvt", max_seq_len=32, backend=backend, device="cuda")
    assert next(model.parameters()).device.type == "cpu"
    art = kvtrace.load(path)
    assert art.manifest.device == "cuda" and art.device.type == "cuda"
    s = art.session()
    assert all(t.is_cuda for t in s.state)
    gpu_model = tiny_model("llama").cuda()
    report = kvtrace.verify(EagerRunner(gpu_model), [SessionRunner(s, backend)],
                            [torch.tensor([[5, 17, 42, 8, 99]]), torch.tensor([[3, 1]])], steps=8)
    assert report.passed, report.summary()
    res = kvtrace.generate(art.session(), [5, 17, 42], max_new_tokens=8)
    assert len(res.tokens) == 8


def test_cuda_graphs_on_a_cpu_artifact_is_one_clear_line(cpu_art, capsys):
    with pytest.raises(UsageError, match="cuda_graphs=True needs a session on a CUDA device"):
        kvtrace.load(cpu_art).session(cuda_graphs=True)
    assert main(["run", str(cpu_art), "--prompt", "hi", "--cuda-graphs", "--raw", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-graphs needs an artifact running on a CUDA device" in err and len(err.strip().splitlines()) == 1
    # generate refuses it before any model is read, converted or compiled
    assert main(["generate", "hi", "--cuda-graphs", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--cuda-graphs needs --device cuda" in err and len(err.strip().splitlines()) == 1


def test_bench_with_cuda_graphs_needs_a_cuda_device():
    from kvtrace.tools.bench import run_bench

    with pytest.raises(UsageError, match="--cuda-graphs needs --device cuda"):
        run_bench(model=tiny_model("llama"), backends=("hf-eager",), cuda_graphs=True)
