"""kvtrace bench internals: fresh exports are measured, then deleted (they are hundreds of MiB)."""

from __future__ import annotations

import tempfile

import pytest

from conftest import tiny_model
from helpers import cache_kwarg_only_model
from kvtrace.tools.bench import run_bench


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


def test_bench_calls_hf_with_the_models_own_cache_kwarg():
    """A forward that takes ``cache=`` only (transformers 5.40 drops ``past_key_values=``) still benches."""
    data = run_bench(model=cache_kwarg_only_model(), backends=("hf-eager",), prompt_lens=(4,), new_tokens=3, runs=1,
                     max_seq_len=16)
    assert [(r["backend"], r["error"]) for r in data["results"]] == [("hf-eager", "")]
    assert data["results"][0]["tokens_match_eager"] is True


def test_artifact_backends_are_measured_in_a_fresh_process(tmp_path, monkeypatch):
    """The row of an artifact backend comes from another process: its peak RSS is that process's own, and
    a fresh_process=False run of the same backend says so. Both decode the same greedy tokens as eager."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kw = dict(model=tiny_model("llama"), backends=("exported",), prompt_lens=(4,), new_tokens=4, runs=1,
              max_seq_len=32)
    fresh = {r["backend"]: r for r in run_bench(**kw)["results"]}
    here = {r["backend"]: r for r in run_bench(**kw, fresh_process=False)["results"]}
    assert fresh["exported"]["measured_in"] == "fresh process" and not fresh["exported"]["error"]
    assert here["exported"]["measured_in"] == "this process"
    assert fresh["hf-eager"]["measured_in"] == "this process"
    assert fresh["exported"]["tokens_match_eager"] and here["exported"]["tokens_match_eager"]
    # this process has imported transformers and built a model; a process that only loads the artifact has not
    assert fresh["exported"]["peak_rss_mib"] < here["exported"]["peak_rss_mib"]


def test_bench_table_is_full_width_when_piped():
    from kvtrace.tools.bench import COLUMNS, render_markdown

    row = dict(backend="aoti-packed", dtype="bfloat16", prompt_len=37, error="", compile_s=1.0, prefill_ms=2.0,
               decode_tok_s=3.0, decode_tok_s_range=(2.5, 3.5), vs_hf_eager=1.5, bound_fraction=0.9,
               bandwidth_gb_s=19.31, peak_rss_mib=100.0, recompiles=0, tokens_match_eager=False, first_mismatch=13,
               measured_in="fresh process")
    broken = {**row, "backend": "aoti", "error": "CaptureError: boom | bang"}
    text = render_markdown({"bandwidth_gb_s": 20.0, "threads": 2, "results": [row, broken]})
    lines = text.splitlines()
    assert lines[2] == "| " + " | ".join(COLUMNS) + " |"  # every header whole
    assert "| aoti-packed | bfloat16 | none | auto | 37 |" in lines[4] and "| 0.90 | 19.3 |" in lines[4]
    assert "no (at 13)" in lines[4] and "fresh process" in lines[4]
    assert "error: CaptureError: boom / bang" in lines[5] and lines[5].count("|") == len(COLUMNS) + 1


def test_bench_puts_kv_cache_storages_side_by_side():
    """--kv-dtype auto,int8: one row per storage for each artifact backend (HF's row keeps its own cache), each
    row's bound counting its cache's bytes: int8 K/V are one byte a value plus a float16 scale per token and head."""
    from kvtrace.tools.bench import _kv_bytes, render_markdown

    model = tiny_model("llama")
    data = run_bench(model=model, backends=("hf-eager", "exported"), prompt_lens=(20,), new_tokens=4, runs=1,
                     max_seq_len=32, kv_dtypes=("auto", "int8"), fresh_process=False)
    rows = [(r["backend"], r["kv_dtype"]) for r in data["results"]]
    assert rows == [("hf-eager", "auto"), ("exported", "auto"), ("exported", "int8")]
    by = {r["kv_dtype"]: r for r in data["results"] if r["backend"] == "exported"}
    assert all(not r["error"] for r in by.values()), [r["error"] for r in by.values()]
    ctx = 20 + 4 // 2
    assert by["auto"]["bytes_per_token"] - by["int8"]["bytes_per_token"] == (
        _kv_bytes(model, ctx, "auto") - _kv_bytes(model, ctx, "int8")) > 0
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert _kv_bytes(model, ctx, "int8") == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * ctx * (head_dim + 2)
    assert by["auto"]["tokens_match_eager"]  # the int8 row may leave eager's tokens: reported, not asserted
    assert "| exported | float32 | none | int8 | 20 |" in render_markdown(data)
    # each row's bound uses the bandwidth measured around that row, not the run's first measurement
    for r in data["results"]:
        lo, hi = r["bandwidth_gb_s_range"]
        assert 0 < lo <= r["bandwidth_gb_s"] <= hi
        want = r["decode_tok_s"] * r["bytes_per_token"] / (r["bandwidth_gb_s"] * 1e9)
        assert r["bound_fraction"] == pytest.approx(want, rel=2e-3, abs=1e-3)
        assert f"| {r['bandwidth_gb_s']:.1f} |" in render_markdown(data)


def test_bench_kv_dtype_list_is_checked(capsys):
    from kvtrace.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--kv-dtype", "auto,int4"])
    assert e.value.code == 2 and "--kv-dtype" in capsys.readouterr().err
    assert main(["bench", "--serve", "--kv-dtype", "auto,int8"]) == 2  # one cache per serve bench (stop 50)
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert "a --kv-dtype list" in line and "drop it" in line
    assert main(["bench", "--serve", "--quant", "none,int8"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert "a --quant list" in line and "drop it" in line


def test_the_bound_of_xnnpacks_8da4w_counts_what_xnnpack_reads():
    """executorch's 8da4w (``DynQuantLinear``): 4-bit weights two a byte with a bf16 scale per group of 32, the int8
    head one byte a weight with a float32 scale per row (a tied head's table counted once, with the embedding)."""
    from kvtrace.tools.bench import _kv_bytes, _quant_bytes_per_token

    model = tiny_model("llama")
    cfg = model.config
    d, f, layers, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    n_kv = cfg.num_key_value_heads * (d // cfg.num_attention_heads)
    linear = layers * (d * (d + 2 * n_kv) + d * d + 3 * d * f)  # wqkv, wo, w13, w2: weights per layer
    got = _quant_bytes_per_token(model, None, "8da4w", 32, 10, act="int8-asym") - _kv_bytes(model, 10, "auto")
    norms = (2 * layers + 1) * d * 4
    embed = v * d + v * 2  # int8 table + bf16 scale per row
    head = v * d + v * 4  # untied: int8 + float32 scale per row
    assert got == linear // 2 + linear // 32 * 2 + embed + head + norms
    assert got < _quant_bytes_per_token(model, None, "8da4w", 32, 10) - _kv_bytes(model, 10, "auto")  # int4pack


def test_a_row_whose_bandwidth_probe_does_not_fit_uses_the_runs_first_measurement(monkeypatch):
    """On a GPU the probe copies 4 GiB beside the models a run holds; out of memory, the row keeps the run's value."""
    import torch

    from kvtrace.tools import bench

    def out_of_memory(**_kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(bench, "measure_bandwidth", out_of_memory)
    assert bench._row_bandwidth(torch.device("cpu"), 12.5) == 12.5
    monkeypatch.setattr(bench, "measure_bandwidth", lambda **_kw: 30.0)
    assert bench._row_bandwidth(torch.device("cpu"), 12.5) == 30.0
