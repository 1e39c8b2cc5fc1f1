"""kvtrace bench internals: fresh exports are measured, then deleted (they are hundreds of MiB)."""

from __future__ import annotations

import tempfile

from conftest import tiny_model
from kvtrace._bench import run_bench


def test_fresh_artifacts_are_deleted_after_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = run_bench(model=tiny_model("llama"), backends=("hf-eager", "exported"), prompt_lens=(4,), new_tokens=4,
                     runs=1, max_seq_len=32)
    rows = {r["backend"]: r for r in data["results"]}
    assert not rows["exported"]["error"] and rows["exported"]["artifact_mib"] > 0  # it was there when measured
    assert rows["exported"]["tokens_match_eager"] is True
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvtrace-bench-")] == []


def test_bench_in_another_dtype_leaves_the_callers_model_alone():
    import torch

    model = tiny_model("llama")
    before = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
    data = run_bench(model=model, backends=("hf-eager",), prompt_lens=(4,), new_tokens=2, runs=1, max_seq_len=16,
                     dtypes=("bfloat16",))
    assert [r["dtype"] for r in data["results"]] == ["bfloat16"] and not data["results"][0]["error"]
    assert {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()} == before
    assert next(model.parameters()).dtype == torch.float32
