"""kvtrace bench --serve on a tiny model: the server in its own process, the levels measured, answers checked."""

from __future__ import annotations

import json

from tests.conftest import make_tiny_hf_dir


def test_serve_bench_measures_levels_and_checks_answers(tmp_path, monkeypatch, capsys):
    from kvtrace.cli.main import main

    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    make_tiny_hf_dir(tmp_path, words_only=True, max_position_embeddings=128)
    out = tmp_path / "serve.json"
    code = main(["bench", "--serve", "--model", str(tmp_path), "--backends", "exported", "--clients", "1,2",
                 "--requests", "1", "--new-tokens", "8", "--max-seq-len", "96", "--runs", "1", "--json", str(out),
                 "--quiet", "--huge-pages", "--kv-dtype", "int8"])
    # server and baseline runs load with huge pages, every artifact holds an int8 cache: the answers are still
    # those of solo runs of the same cache
    data = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().err
    assert [lv["clients"] for lv in data["levels"]] == [1, 2] and data["slots"] == 2
    assert [lv["tokens"] for lv in data["levels"]] == [8, 16], "ignore_eos: exactly new_tokens per request"
    assert all(lv["mismatches"] == 0 and lv["aggregate_tok_s"] > 0 for lv in data["levels"])
    assert data["kvtrace_run_decode_tok_s"] > 0 and data["checked_against_solo"]
    assert data["huge_pages"] is True and data["kv_dtype"] == "int8"
    # 2 slots x 2 layers x 2 KV heads x 96 positions x (K and V: 16 int8 values + a float16 scale each)
    assert data["served_cache_mib"] == round(2 * 2 * 2 * 96 * 2 * (16 + 2) / 2**20, 3)
    one, two = data["levels"]
    # the server's own decode steps (its /metrics): one request alone decodes one row a step (its first token came
    # from the prefill: 7 decode rows); two concurrent requests share steps
    assert one["mean_rows"] == 1.0 and 1.0 < two["mean_rows"] <= 2.0
    assert one["decode_step_tok_s"] > 0 and two["decode_step_vs_one_client"] > 0
    assert all(0 < lv["prefill_share"] < 1 for lv in data["levels"])
    table = capsys.readouterr().out
    assert "| clients | requests |" in table and "server decode tok/s (rows/step)" in table
    assert "`kvtrace run` decode" in table and "2 slots (int8 KV cache, 0.026 MiB)" in table
    assert main(["bench", "--serve", "--model", str(tmp_path), "--kv-dtype", "auto,int8"]) == 2
    assert "a --kv-dtype list is not offered with it" in capsys.readouterr().err

