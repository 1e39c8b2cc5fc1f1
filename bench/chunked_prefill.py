"""Chunked prefill: how long a long prompt pauses the conversations already streaming (issue #18).

On the default model's slots artifact (``kvtrace serve``'s: aoti-packed, fp32, cached), ``--streams``
requests decode; then a prompt of ``--long`` tokens arrives. Without chunking its whole prefill runs between
two decode steps, so every other conversation stalls for it; with ``prefill_chunk=C`` each step prefills at
most C of its tokens beside the decode step. Per setting: the longest and the p95 gap between two tokens of
the streaming requests while the long prompt is prefilled, the long request's time to first token, and the
streams' tokens/s over that window. Settings are run in turn ``--repeats`` times (these 2-core machines drift
by 10 % within minutes) and reported as medians, one JSON line each, then a table.

    .venv/bin/python bench/chunked_prefill.py [--chunks 0,128,256,512] [--long 900] [--streams 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtrace.artifact.store import cached_artifact
from kvtrace.runtime.slots import SlotEngine, SlotRequest

TEXT = ("The history of the printing press begins with movable type in East Asia and continues in Europe, "
        "where Gutenberg's press spread books, pamphlets and newspapers across the continent. ")


def one_run(art, chunk: int, long_ids: list[int], short: list[list[int]]) -> dict[str, float]:
    eng: SlotEngine = art.slot_engine(prefill_chunk=chunk or None)
    for ids in short:  # the streams, decoding before the long prompt arrives
        eng.admit(SlotRequest(ids, max_tokens=eng.max_seq_len - len(ids) - 1))
    for _ in range(4):
        eng.step()
    streams = set(eng.active)
    last = {s: time.perf_counter() for s in streams}
    gaps: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    slot, ev = eng.admit(SlotRequest(long_ids, max_tokens=8))
    while ev is None:
        for e in eng.step():
            now = time.perf_counter()
            if e.slot == slot:
                ev = e
            elif e.slot in streams:
                gaps.append(now - last[e.slot])
                last[e.slot] = now
                tokens += 1
    ttft = time.perf_counter() - t0
    for s in streams:  # the gap still open when the long request got its first token
        gaps.append(time.perf_counter() - last[s])
    eng.reset()
    gaps.sort()
    return {"max_gap_ms": 1e3 * gaps[-1], "p95_gap_ms": 1e3 * gaps[int(0.95 * (len(gaps) - 1))],
            "long_ttft_s": ttft, "stream_tok_s": tokens / ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="aoti-packed")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--chunks", default="0,128,256,512", help="prefill_chunk settings; 0: whole prompts")
    ap.add_argument("--long", type=int, default=900, help="the long prompt's tokens")
    ap.add_argument("--streams", type=int, default=3, help="requests decoding when it arrives")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    built = cached_artifact(args.model, backend=args.backend, max_seq_len=1024, slots=args.slots, load=True,
                            progress=None)
    art = built.artifact
    tok = art.tokenizer()
    ids = tok.encode(TEXT * 40, add_special_tokens=False).ids
    long_ids = ids[: args.long]
    short = [ids[7 * i : 7 * i + 24] for i in range(args.streams)]
    chunks = [int(c) for c in args.chunks.split(",")]
    with torch.inference_mode():
        one_run(art, chunks[-1], long_ids[:64], short)  # warm-up
        runs: dict[int, list[dict[str, float]]] = {c: [] for c in chunks}
        for _ in range(args.repeats):
            for c in chunks:
                runs[c].append(one_run(art, c, long_ids, short))
    rows = []
    for c in chunks:
        row = {"prefill_chunk": c, "long_prompt": len(long_ids), "streams": args.streams,
               **{k: round(statistics.median(r[k] for r in runs[c]), 3) for k in runs[c][0]}}
        rows.append(row)
        print(json.dumps(row))
    print("\n| prefill_chunk | longest gap ms | p95 gap ms | long prompt TTFT s | streams tok/s meanwhile |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prefill_chunk'] or 'whole'} | {r['max_gap_ms']:.0f} | {r['p95_gap_ms']:.0f} | "
              f"{r['long_ttft_s']:.2f} | {r['stream_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
