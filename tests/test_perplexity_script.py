"""bench/perplexity.py's reading of llama-perplexity's output (the runs need llama.cpp: run by hand) and its table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BASE_LOG = """0.03.828.193 I perplexity: calculating perplexity over 14 chunks, n_ctx=512, batch_size=2048, n_seq=4
[1]16.2628,[2]17.6855,
0.15.840.204 I Final estimate: PPL = 17.6855 +/- 2.15407
"""
KL_LOG = """perplexity: calculating perplexity over 2 chunks, n_ctx=512, batch_size=2048, n_seq=4
====== Perplexity statistics ======
Mean PPL(Q)                   :  17.893767 ±   2.190960
Mean PPL(base)                :  17.685395 ±   2.154057
====== KL divergence statistics ======
Mean    KLD:   0.003122 ±   0.000142
Maximum KLD:   0.025519
99.9%   KLD:   0.025329
99.0%   KLD:   0.016570
Median  KLD:   0.002274
====== Token probability statistics ======
Same top p: 96.471 ± 0.818 %
"""


def _script():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("perplexity_bench", ROOT / "bench" / "perplexity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_reads_the_base_run_and_a_kl_run():
    m = _script()
    assert m.parse_log(BASE_LOG, kl=False) == {"chunks": 14, "ctx": 512, "ppl": 17.6855, "ppl_err": 2.15407}
    got = m.parse_log(KL_LOG, kl=True)
    assert got == {"chunks": 2, "ctx": 512, "ppl": 17.893767, "ppl_err": 2.19096, "kl_mean": 0.003122,
                   "kl_p99": 0.01657, "kl_max": 0.025519, "top1_agree": pytest.approx(0.96471)}
    with pytest.raises(SystemExit, match="no 'kl_mean'"):
        m.parse_log(KL_LOG.replace("Mean    KLD", "Mean KL"), kl=True)


def test_table_puts_each_tool_against_its_own_float32_reference():
    m = _script()
    lc = [{"model": "F32.gguf", "ppl": 20.0, "ppl_err": 1.0},
          {"model": "Q8_0.gguf", "ppl": 20.2, "ppl_err": 1.0, "kl_mean": 0.004, "kl_p99": 0.02, "kl_max": 0.1,
           "top1_agree": 0.96}]
    kv = {"rows": [{"name": "eager fp32", "ppl": 19.0, "ppl_err": 0.9, "kl_mean": None},
                   {"name": "aoti-packed int8", "ppl": 19.38, "ppl_err": 0.9, "kl_mean": 0.005, "kl_p99": 0.02,
                    "kl_max": 0.1, "top1_agree": 0.955}]}
    lines = m.table(lc, kv).splitlines()
    assert lines[3].startswith("| llama.cpp | Q8_0.gguf | 20.2000 ± 1.0000 | 1.0100 | 0.00400 |")
    assert lines[5].startswith("| kvtrace | aoti-packed int8 | 19.3800 ± 0.9000 | 1.0200 | 0.00500 |")
    assert "95.50%" in lines[5] and lines[2].endswith("| — | — | — | — |")
