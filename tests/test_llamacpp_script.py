"""bench/llamacpp.py's arithmetic on llama-bench's JSON (the build and the runs need llama.cpp: run by hand): each
llama.cpp row's fraction of its bound, and kvtrace rows set against the peer weight format."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("llamacpp_bench", ROOT / "bench" / "llamacpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _raw(fmt: str, size: int, prefill_ts: list[float], decode_ts: list[float]) -> list[dict]:
    """Two llama-bench rows (prefill of 37 tokens, 128 decoded) of one model, as `llama-bench -o json` writes."""
    base = {"model_type": f"llama 256M {fmt}", "model_size": size}
    return [{**base, "n_prompt": 37, "n_gen": 0, "avg_ts": sum(prefill_ts) / len(prefill_ts), "samples_ts": prefill_ts},
            {**base, "n_prompt": 0, "n_gen": 128, "avg_ts": sum(decode_ts) / len(decode_ts), "samples_ts": decode_ts}]


def test_peer_rows_give_each_format_its_fraction_of_the_bound():
    m = _script()
    raw = _raw("Q4_0", 90_000_000, [370.0, 370.0], [180.0, 220.0]) + _raw("F32", 540_000_000, [450.0], [50.0])
    rows = m.peer_rows(raw, bandwidth=36.0)
    assert set(rows) == {"Q4_0", "F32"}
    q = rows["Q4_0"]
    assert q["decode_tok_s"] == 200.0 and q["decode_tok_s_range"] == [180.0, 220.0]
    assert q["bound_fraction"] == 0.5  # 90 MB x 200 tokens/s = 18 GB/s of 36
    assert abs(q["prefill_ms"] - 100.0) < 1e-9  # 37 tokens at 370 tokens/s
    assert rows["F32"]["bound_fraction"] == 0.75 and rows["F32"]["bandwidth_gb_s"] == 36.0


def test_table_sets_each_kvtrace_row_against_its_peer_format():
    m = _script()
    before = m.peer_rows(_raw("Q4_0", 90_000_000, [370.0], [200.0]) + _raw("Q4_1", 96_000_000, [300.0], [100.0]), 36.0)
    after = m.peer_rows(_raw("Q4_0", 90_000_000, [370.0], [300.0]) + _raw("Q4_1", 96_000_000, [300.0], [100.0]), 36.0)
    kv = {"results": [
        {"backend": "hf-eager", "quant": "none", "dtype": "float32"},  # the yardstick: not a row here
        {"backend": "executorch", "quant": "8da4w", "dtype": "float32", "prefill_ms": 50.0, "decode_tok_s": 250.0,
         "decode_tok_s_range": [240.0, 260.0], "bound_fraction": 0.6, "bandwidth_gb_s": 35.0},
        {"backend": "aoti", "quant": "gguf", "dtype": "float32", "prefill_ms": 100.0, "decode_tok_s": 150.0,
         "decode_tok_s_range": [140.0, 155.0], "bound_fraction": 0.45, "bandwidth_gb_s": 34.0},
        {"backend": "executorch", "quant": "int4", "dtype": "float32", "error": "not offered"},
    ]}
    text = m.table(kv, before, after, {**m.PEERS, "gguf": "Q4_1"})
    lines = text.splitlines()
    assert len(lines) == 2 + 4 + 2  # header, 2 llama.cpp rows before and after, the two kvtrace rows that ran
    pte = next(x for x in lines if "executorch" in x)
    assert "| 0.60 |" in pte and pte.endswith("| 1.00 (Q4_0) |")  # 250 / mean(200, 300)
    gguf = next(x for x in lines if "kvtrace aoti" in x)
    assert gguf.endswith("| 1.50 (Q4_1) |")
    assert "| llama.cpp (before) | Q4_0 | 100.0 | 200.0 (200.0-200.0) | 0.50 | 36.0 | - |" in lines
