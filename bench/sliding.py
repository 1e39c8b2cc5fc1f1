"""Sliding-window and hybrid caches: memory and decode speed against context position (issue #15 targets).

A SmolLM2-135M-shaped decoder (random weights, no download) with three cache layouts of one model:
``full`` (every layer attends everything), ``hybrid`` (Gemma-3 style: 5 sliding layers of window 512 to 1
full layer) and ``sliding`` (every layer windowed). For each: the CacheSpec's bytes at max_seq_len 4096, and
decode tokens/s after a prompt of 64 and of 4000 tokens, on one backend, printed as one JSON line each.

    .venv/bin/python bench/sliding.py [--backend exported|aoti] [--threads 2] [--tokens 32] [--repeats 3]

The two positions are measured in turn (64, 4000, 64, 4000, ...) ``--repeats`` times and each reported as its
median, so a drift of the machine during the run (these 2-core machines vary by 10 % within minutes) lands
on both positions alike instead of on whichever ran second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

import kvtrace

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
             num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
WINDOW, MAX_SEQ_LEN = 512, 4096
LAYOUTS = {
    "full": ["full_attention"] * 30,
    "hybrid": [("full_attention" if i % 6 == 5 else "sliding_attention") for i in range(30)],
    "sliding": ["sliding_attention"] * 30,
}


def build(layout: str) -> torch.nn.Module:
    cfg = tf.Qwen2Config(**SHAPE, use_sliding_window=layout != "full", sliding_window=WINDOW,
                         layer_types=LAYOUTS[layout])
    torch.manual_seed(0)
    return tf.Qwen2ForCausalLM(cfg).eval().requires_grad_(False)


def decode_rate(session: kvtrace.Session, prompt: int, tokens: int) -> float:
    session.reset()
    logits = session.prefill(torch.randint(0, SHAPE["vocab_size"], (1, prompt)))
    tok = logits[:, -1:].argmax(-1)
    for _ in range(3):  # warm-up at this position
        tok = session.decode(tok)[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(tokens):
        tok = session.decode(tok)[:, -1:].argmax(-1)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="exported")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="full,hybrid,sliding")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        full_bytes = None
        for layout in args.layouts.split(","):
            model = build(layout)
            path = Path(tmp) / f"{layout}.kvt"
            t0 = time.perf_counter()
            kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=args.backend)
            export_s = time.perf_counter() - t0
            art = kvtrace.load(path)
            spec = art.cache_spec
            nbytes = spec.nbytes()
            full_bytes = full_bytes or (nbytes if layout == "full" else None)
            s = art.session()
            rates: dict[int, list[float]] = {64: [], 4000: []}
            with torch.inference_mode():
                for _ in range(args.repeats):
                    for prompt, got in rates.items():
                        got.append(decode_rate(s, prompt, args.tokens))
            at64, at4000 = statistics.median(rates[64]), statistics.median(rates[4000])
            print(json.dumps({
                "layout": layout, "backend": args.backend, "threads": args.threads, "window": WINDOW,
                "max_seq_len": MAX_SEQ_LEN, "kinds": sorted({x.kind.value for x in spec.layers}),
                "cache_mib": round(nbytes / 2**20, 1),
                "cache_vs_full": round(nbytes / full_bytes, 3) if full_bytes else None,
                "decode_tok_s_at_64": round(at64, 1), "decode_tok_s_at_4000": round(at4000, 1),
                "ratio_4000_vs_64": round(at4000 / at64, 3), "export_s": round(export_s, 1),
                "repeats": {str(p): [round(r, 1) for r in got] for p, got in rates.items()},
            }), flush=True)


if __name__ == "__main__":
    main()
