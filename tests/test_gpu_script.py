"""bench/gpu.py, the prepared GPU run of issue #19, end to end on the CPU with a tiny model (its dry run): every
phase runs and prints its JSON line, verify and the graph checks pass, and a bench line carries its bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONWARNINGS": "ignore", "KVTRACE_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu", "--tiny", "--out", str(out),
                           "--runs", "1", "--new-tokens", "6", "--steps", "3", "--graph-steps", "66",
                           "--skip", "hf-compile,smoke", *extra], capture_output=True, text=True, env=env, timeout=1200)
    lines = [json.loads(x) for x in (out / "gpu.jsonl").read_text().splitlines()]
    assert [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")] == lines  # stdout = the file
    return proc, lines


def test_gpu_script_dry_run_on_cpu(tmp_path):
    proc, lines = dry_run(tmp_path, "--backend", "exported")
    assert proc.returncode == 0, proc.stderr[-2000:]
    by = {}
    for rec in lines:
        by.setdefault(rec["phase"], []).append(rec)
    assert set(by) == {"env", "model", "export", "verify", "bench", "graphs", "summary"}
    assert not any("error" in rec for rec in lines)
    assert by["env"][0]["bandwidth_gb_s"] > 0 and by["export"][0]["manifest_device"] == "cpu"
    assert [v["result"] for v in by["verify"]] == ["PASS", "PASS"]  # without and with the graph path
    g = by["graphs"][0]
    assert g["bit_identical"] and g["snapshot_restore_same_bits"] and g["rewind_same_bits"] and g["reset_same_bits"]
    assert g["stats"]["buckets"] == [64, 128] and not g["real_cuda_graphs"]  # 66 steps after 37 cross a bucket
    benches = {b["backend"]: b for b in by["bench"]}
    assert set(benches) == {"kvtrace-exported", "hf-eager", "kvtrace-exported+graphs"}
    for b in benches.values():
        assert b["decode_tok_s"] > 0 and b["bytes_per_token"] > 0
        assert b["fraction_of_bound"] == pytest.approx(b["decode_tok_s"] / b["bound_tok_s"], abs=1e-3)
    assert benches["kvtrace-exported+graphs"]["tokens_match_hf_eager"] is not None
    assert by["summary"][0]["failed_phases"] == [] and all(by["summary"][0]["passed"].values())
    assert (tmp_path / "out" / "verify-exported.json").is_file()


@pytest.mark.compile
def test_gpu_script_dry_run_on_cpu_with_aoti(tmp_path):
    """The backend the GPU run uses (aoti), compiled for the CPU: the same phases pass."""
    proc, lines = dry_run(tmp_path, "--backend", "aoti", "--skip", "hf-compile,hf-eager,smoke")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any("error" in rec for rec in lines)
    assert lines[-1]["phase"] == "summary" and all(lines[-1]["passed"].values())


def _bench_module(name: str):
    import importlib

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_smoke_picks_the_first_backend_that_loaded():
    pick = _bench_module("gpu_smoke").pick_backend
    ok = lambda *names: [{"probe": n, "ok": True} for n in names]  # noqa: E731
    assert pick(ok("torch-packaged", "kvtrace-aoti", "kvtrace-aoti-packed")) == "aoti"
    assert pick([*ok("kvtrace-aoti-packed"), {"probe": "kvtrace-aoti", "ok": False, "signal": 11}]) == "aoti-packed"
    assert pick([{"probe": "kvtrace-aoti", "ok": False}, {"probe": "kvtrace-aoti-packed", "ok": False}]) == "exported"


def test_a_load_that_segfaults_in_the_child_is_reported_not_fatal(tmp_path, monkeypatch):
    """The H200 run died of SIGSEGV loading the aoti artifact; now the load runs in a child first, and its death
    is a LoadDied naming the signal and showing faulthandler's stack, in a process that goes on."""
    gpu = _bench_module("gpu")
    monkeypatch.setattr(gpu, "_LOAD_CHILD", "import ctypes; ctypes.string_at(0)")  # a real SIGSEGV
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        with pytest.raises(gpu.LoadDied, match=r"died of signal 11: Current thread"):
            gpu.load_in_child(tmp_path / "x.kvt", gpu.torch.device("cpu"))
        monkeypatch.setattr(gpu, "_LOAD_CHILD", "raise SystemExit('no such artifact')")
        with pytest.raises(RuntimeError, match=r"exit 1\): no such artifact") as e:
            gpu.load_in_child(tmp_path / "x.kvt", gpu.torch.device("cpu"))
        assert not isinstance(e.value, gpu.LoadDied)
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.mark.compile
def test_gpu_script_smoke_probes_on_cpu(tmp_path):
    """The smoke phase's probes, each in its own process (torch alone: weights in the .so and handed in; kvtrace
    aoti and aoti-packed, and aoti at the 1B's widths), pass on the CPU, and --backend auto then picks aoti."""
    proc, lines = dry_run(tmp_path, "--backend", "auto", "--skip", "hf-compile,hf-eager,verify,graphs")
    assert proc.returncode == 0, proc.stderr[-2000:]
    smoke = [r for r in lines if r["phase"] == "smoke"]
    probes = {r["probe"]: r for r in smoke if "probe" in r}
    assert set(probes) == {"torch-packaged", "torch-external", "kvtrace-aoti", "kvtrace-aoti-packed",
                           "kvtrace-aoti-wide"}
    assert all(r["ok"] for r in probes.values()), probes
    assert probes["torch-external"]["max_abs"] < 1e-5 and probes["kvtrace-aoti"]["position"] == 8
    assert smoke[-1]["backend_chosen"] == "aoti"
    assert [r["backend"] for r in lines if r["phase"] == "export"] == ["aoti"]
