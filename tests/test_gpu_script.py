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
                           "--skip", "hf-compile", *extra], capture_output=True, text=True, env=env, timeout=1200)
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
    proc, lines = dry_run(tmp_path, "--backend", "aoti", "--skip", "hf-compile,hf-eager")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any("error" in rec for rec in lines)
    assert lines[-1]["phase"] == "summary" and all(lines[-1]["passed"].values())
