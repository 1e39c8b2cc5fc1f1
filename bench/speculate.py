"""Prompt-lookup speculative decoding against plain decoding, on the default model, in one process.

    .venv/bin/python bench/speculate.py [--quant none,gguf] [--k 4,8] [--new-tokens 160] [--rounds 2]
        [--threads 2] [--json OUT.json]

For each --quant (an artifact of the default model exported with every position's prefill logits, from the
kvtrace cache; the same artifact serves both ways):
  1. what a verify call costs: the prefill program over 1 + d tokens (d = 0..63) against one decode step, at
     position ~200 (the median of 15 calls each); --costs-only stops there;
  2. four chat prompts, from one whose answer copies its prompt to one whose answer owes it nothing, answered
     greedily, plain and with --speculate K for each --k, alternated --rounds times: decode tokens/s (the
     median), draft tokens accepted / drafted, program calls, and whether the answer equals the plain one.

Prints one Markdown table per section and writes everything to --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PARAGRAPH = ("The Industrial Revolution began in Great Britain in the late eighteenth century and spread to "
             "continental Europe and North America. It replaced hand production with machines, new chemical "
             "processes and iron production, and it brought the rise of the factory system. Steam power, fuelled "
             "by coal, drove the mills, and railways carried goods and people faster than ever before.")
TYPOS = PARAGRAPH.replace("century", "centuy").replace("machines", "machnes").replace("factory", "factroy") \
    .replace("railways", "railwyas")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total = total + (v - m) ** 2
    return total / len(values)'''
PROMPTS = {
    "repeat": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    "fix typos": f"Fix the spelling mistakes in this text and write it out again in full:\n\n{TYPOS}",
    "code edit": f"Rewrite these Python functions with type hints and docstrings:\n\n```python\n{CODE}\n```",
    "open": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def verify_costs(session, positions: int = 200, reps: int = 15) -> list[dict]:
    ids = torch.randint(100, 4000, (1, positions), generator=torch.Generator().manual_seed(0))

    def median_ms(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    session.reset()
    session.prefill(ids)
    one = torch.tensor([[5]])

    def decode():
        session.decode(one)
        session.rewind(1)

    rows = [{"tokens": 1, "program": "decode", "ms": round(median_ms(decode), 2)}]
    for d in (0, 1, 2, 3, 4, 6, 8, 15, 63):
        x = torch.randint(100, 4000, (1, 1 + d))

        def verify(x=x, d=d):
            session.prefill(x)
            session.rewind(1 + d)

        rows.append({"tokens": 1 + d, "program": "prefill (all logits)", "ms": round(median_ms(verify), 2)})
    base = rows[0]["ms"]
    for r in rows:
        r["vs_decode"] = round(r["ms"] / base, 2)
    return rows


def answer(art, ids: list[int], new_tokens: int, k: int) -> dict:
    from kvtrace.runtime.generate import generate

    s = art.session()
    res = generate(s, ids, max_new_tokens=new_tokens, eos_ids=art.manifest.eos_ids, speculate=k)
    st = res.stats
    return {"tokens": res.tokens, "decode_tok_s": st.decode_tokens_per_s, "drafted": st.drafted,
            "accepted": st.accepted, "calls": st.calls, "new_tokens": st.new_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="none,gguf")
    ap.add_argument("--k", default="4,8")
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, default=512, help="the artifacts' (kvtrace perplexity's default ctx)")
    ap.add_argument("--costs-only", action="store_true", help="measure the verify calls' cost only (section 1)")
    ap.add_argument("--json", type=Path, default=Path("bench_speculate.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from kvtrace.artifact.store import cached_artifact
    from kvtrace.cli.args import chosen_backend
    from kvtrace.sources.chat import encode_prompt

    ks = [int(k) for k in args.k.split(",")]
    out: dict = {"command": " ".join(sys.argv), "threads": args.threads, "new_tokens": args.new_tokens, "quant": {}}
    lines = []
    for quant in args.quant.split(","):
        print(f"[speculate] {quant}: loading (exported with every position's logits; cached)", file=sys.stderr)
        backend = chosen_backend(argparse.Namespace(backend=None, quant=quant))  # as kvtrace generate picks
        art = cached_artifact(None, backend=backend, max_seq_len=args.max_seq_len, prefill_logits="all", load=True,
                              quant=None if quant == "none" else quant).artifact
        costs = verify_costs(art.session())
        m, tok = art.manifest, art.tokenizer()
        rows = []
        for name, text in ({} if args.costs_only else PROMPTS).items():
            ids = encode_prompt(tok, text, chat=True, template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids)
            runs: dict[int, list[dict]] = {k: [] for k in (0, *ks)}
            for _ in range(args.rounds):
                for k in (0, *ks):
                    runs[k].append(answer(art, ids, args.new_tokens, k))
            plain = runs[0][0]["tokens"]
            for k, rs in runs.items():
                rows.append({"prompt": name, "prompt_tokens": len(ids), "k": k,
                             "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in rs), 2),
                             "decode_tok_s_runs": [round(r["decode_tok_s"], 2) for r in rs],
                             "new_tokens": rs[0]["new_tokens"], "drafted": rs[0]["drafted"],
                             "accepted": rs[0]["accepted"], "calls": rs[0]["calls"],
                             "same_as_plain": all(r["tokens"] == plain for r in rs)})
            print(f"[speculate] {quant} {name}: " + ", ".join(
                f"k={r['k']} {r['decode_tok_s']} tok/s" for r in rows if r["prompt"] == name), file=sys.stderr)
        out["quant"][quant] = {"verify_costs": costs, "answers": rows}
        lines += [f"\n### {quant}: a verify call against one decode step (position 200)\n",
                  "| tokens in the call | ms | x decode |", "|---|---|---|"]
        lines += [f"| {c['tokens']} ({c['program']}) | {c['ms']} | {c['vs_decode']} |" for c in costs]
        lines += [] if args.costs_only else [f"\n### {quant}: greedy answers, plain (k=0) and speculative\n",
                  "| prompt | k | decode tok/s | x plain | accepted / drafted | calls | tokens | same answer |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            base = next(x for x in rows if x["prompt"] == r["prompt"] and x["k"] == 0)["decode_tok_s"]
            lines.append(f"| {r['prompt']} | {r['k']} | {r['decode_tok_s']} | {r['decode_tok_s'] / base:.2f} | "
                         f"{r['accepted']} / {r['drafted']} | {r['calls']} | {r['new_tokens']} | "
                         f"{'yes' if r['same_as_plain'] else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    out["table"] = text
    args.json.write_text(json.dumps(out, indent=1))
    print(f"[speculate] wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
