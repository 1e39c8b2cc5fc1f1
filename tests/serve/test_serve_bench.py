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
                 "--quiet", "--huge-pages"])  # server and baseline runs load with huge pages: the same answers
    data = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().err
    assert [lv["clients"] for lv in data["levels"]] == [1, 2] and data["slots"] == 2
    assert [lv["tokens"] for lv in data["levels"]] == [8, 16], "ignore_eos: exactly new_tokens per request"
    assert all(lv["mismatches"] == 0 and lv["aggregate_tok_s"] > 0 for lv in data["levels"])
    assert data["kvtrace_run_decode_tok_s"] > 0 and data["checked_against_solo"]
    assert data["huge_pages"] is True
    one, two = data["levels"]
    # the server's own decode steps (its /metrics): one request alone decodes one row a step (its first token came
    # from the prefill: 7 decode rows); two concurrent requests share steps
    assert one["mean_rows"] == 1.0 and 1.0 < two["mean_rows"] <= 2.0
    assert one["decode_step_tok_s"] > 0 and two["decode_step_vs_one_client"] > 0
    assert all(0 < lv["prefill_share"] < 1 for lv in data["levels"])
    table = capsys.readouterr().out
    assert "| clients | requests |" in table and "server decode tok/s (rows/step)" in table
    assert "`kvtrace run` decode" in table

