"""One conversation through a quantized slots artifact: its decode steps on the one-row program (DECODE_ONE) vs
the step program compiled for R rows, against the batch-1 artifact (what ``kvtrace run`` decodes with).

A slots artifact whose weights are mostly int8 / int4 linears holds its decode captured for one row
(``backends.aoti_packed.DECODE_ONE``) beside the step program; ``ByRows(most=1)`` runs a step of one active
slot there. This script builds (cached) the default model's 4-slot and batch-1 aoti-packed artifacts with
``--quant``, then alternates ``--rounds`` times in one process: one request of ``--new-tokens`` greedy tokens
through a ``SlotEngine`` with the one-row program, the same forced onto the step program (``most=0``), and a
batch-1 ``Session``. Prints decode tokens/s per run and the first token at which each answer leaves the
batch-1 artifact's (null: none), one JSON line.

    OMP_NUM_THREADS=2 .venv/bin/python bench/slots_one_row.py [--quant int8] [--new-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvtrace.artifact.archive import load
from kvtrace.artifact.store import cached_artifact
from kvtrace.runtime.generate import generate
from kvtrace.runtime.slots import SlotRequest
from kvtrace.serve.bench import PROMPTS
from kvtrace.sources.chat import encode_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="int8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.new_tokens
    slots = cached_artifact(None, backend="aoti-packed", max_seq_len=1024, slots=4, quant=args.quant, progress=None)
    solo = cached_artifact(None, backend="aoti-packed", max_seq_len=1024, quant=args.quant, progress=None)
    art, one = load(slots.path), load(solo.path)
    m, tok = one.manifest, one.tokenizer()
    prompt = encode_prompt(tok, PROMPTS[0], chat=True, template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids)
    decode = art._programs["decode"]
    if getattr(decode, "most", None) != 1:
        raise SystemExit(f"{slots.path.name} holds no one-row decode program ({type(decode).__name__})")

    def engine(most: int) -> tuple[float, list[int]]:
        decode.most = most  # 1: a one-row step on DECODE_ONE; 0: every step on the step program
        eng = art.slot_engine()
        _, ev = eng.admit(SlotRequest(prompt, max_tokens=n))
        toks = [ev.token]
        t0 = time.perf_counter()
        while eng.active:
            toks += [e.token for e in eng.step() if e.token is not None]
        return (len(toks) - 1) / (time.perf_counter() - t0), toks

    def batch1() -> tuple[float, list[int]]:
        r = generate(one.session(), prompt, max_new_tokens=n)
        return r.stats.decode_tokens_per_s, r.tokens

    runs: dict[str, list[float]] = {"one_row": [], "step": [], "batch1": []}
    toks: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, fn in (("one_row", lambda: engine(1)), ("step", lambda: engine(0)), ("batch1", batch1)):
            rate, toks[name] = fn()
            runs[name].append(round(rate, 1))
    decode.most = 1
    differs = {k: next((i for i, (a, b) in enumerate(zip(t, toks["batch1"], strict=False)) if a != b), None)
               for k, t in toks.items() if k != "batch1"}
    print(json.dumps({"quant": args.quant, "new_tokens": n, "decode_tok_s": runs,
                      "median": {k: statistics.median(v) for k, v in runs.items()},
                      "first_token_differing_from_batch1": differs,
                      "slots_artifact_mb": round(slots.path.stat().st_size / 1e6, 1),
                      "batch1_artifact_mb": round(solo.path.stat().st_size / 1e6, 1)}))


if __name__ == "__main__":
    main()
