"""Structured output and tool calling on the default model: what the constraint costs, and what it answers.

    .venv/bin/python bench/grammar.py [--new-tokens 128] [--rounds 3] [--threads 2] [--json OUT.json]

On the artifact `kvtrace generate` uses by default (the GGUF's blocks on aoti, from the kvtrace cache):
  1. llguidance's view of the tokenizer: seconds to build it (once per process); a new schema's compile time;
  2. one prompt answered greedily plain, under a JSON schema and in JSON-object mode, alternated --rounds times:
     decode tokens/s, and the time the mask took per token (GrammarState.mask, timed around every call);
  3. tool calling through `kvtrace serve`'s app in this process (the OpenAI client, one slot): three questions,
     tool_choice auto and required, parallel_tool_calls false: what each answer called or said;
  4. with --speculate K (--speculate-quant Q, default int8: an artifact exported with every position's logits):
     the JSON-schema answer plain and with speculative decoding, whose drafts are the tokens the schema forces
     next (else prompt lookup), alternated --rounds times: decode tokens/s, drafts accepted, same answer.

Prints Markdown tables and writes everything to --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "properties": {"company": {"type": "string"},
                                           "founders": {"type": "array", "items": {"type": "string"},
                                                        "maxItems": 4},
                                           "year": {"type": "integer"}, "summary": {"type": "string"}},
          "required": ["company", "founders", "year", "summary"], "additionalProperties": False}
PROMPT = "Describe Meta as JSON: company, founders, year founded, and a long summary of its history."
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
]
QUESTIONS = ["What's the weather in Paris right now?", "Hi! How are you?",
             "Search the web for the tallest building in the world."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--speculate", type=int, default=0, metavar="K")
    ap.add_argument("--speculate-quant", default="int8")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import kvtrace
    from kvtrace.artifact.store import cached_artifact
    from kvtrace.cli.generate import encode
    from kvtrace.runtime import grammar as G
    from kvtrace.runtime.generate import stream

    built = cached_artifact(None, backend="aoti", max_seq_len=1024, dtype="float32", quant="gguf", load=True)
    art, tok = built.artifact, built.artifact.tokenizer()
    t0 = time.perf_counter()
    G.warm(tok, art.manifest.eos_ids)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars = {"plain": None, "json_schema": art.grammar(kvtrace.Constraint.json_schema(SCHEMA)),
                "json_object": art.grammar(kvtrace.Constraint.json_object())}
    compile_ms = (time.perf_counter() - t0) * 1e3 / 2
    mask_s: list[float] = []
    real_mask = G.GrammarState.mask

    def timed(self, logits):
        t = time.perf_counter()
        try:
            return real_mask(self, logits)
        finally:
            mask_s.append(time.perf_counter() - t)

    G.GrammarState.mask = timed
    ids = encode(art, PROMPT, True)
    session = art.session()
    rows: dict[str, dict] = {k: {"tok_s": [], "mask_ms": [], "new_tokens": [], "stop": []} for k in grammars}
    texts = {}
    for _ in range(args.rounds):
        for name, g in grammars.items():
            session.reset()
            mask_s.clear()
            gen = stream(session, ids, max_new_tokens=args.new_tokens, eos_ids=art.manifest.eos_ids,
                         decode_text=lambda t: tok.decode(t, skip_special_tokens=True), grammar=g)
            for _c in gen:
                pass
            st = gen.result.stats
            r = rows[name]
            r["tok_s"].append(round(st.decode_tokens_per_s, 1))
            r["new_tokens"].append(st.new_tokens)
            r["stop"].append(st.stop_reason)
            if mask_s:
                r["mask_ms"].append([round(statistics.median(mask_s) * 1e3, 3),
                                     round(sorted(mask_s)[int(0.9 * len(mask_s))] * 1e3, 3),
                                     round(max(mask_s) * 1e3, 3)])
            texts[name] = gen.result.text
    G.GrammarState.mask = real_mask
    print(f"llguidance tokenizer view: {tokenizer_s:.2f} s; a new schema compiles in {compile_ms:.2f} ms\n")
    print("| answer | decode tok/s per round | mask ms per token (median / p90 / max) per round | stop |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        masks = "; ".join(" / ".join(f"{v:.2f}" for v in m) for m in r["mask_ms"]) or "-"
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in r['tok_s'])} | {masks} | {', '.join(r['stop'])} |")

    spec = speculated(args, SCHEMA) if args.speculate else {}
    tools = tool_calls(art)
    print("\n| question | tool_choice | finish | answer |\n|---|---|---|---|")
    for t in tools:
        print(f"| {t['question']} | {t['choice']} | {t['finish']} | {t['answer'][:100]} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "artifact": str(built.path), "threads": args.threads, "new_tokens": args.new_tokens,
            "tokenizer_view_s": round(tokenizer_s, 3), "schema_compile_ms": round(compile_ms, 3),
            "rows": rows, "texts": texts, "tools": tools, "speculate": spec, "torch": torch.__version__}, indent=1))
    return 0


def speculated(args, schema: dict) -> dict:
    """The JSON-schema answer on a --speculate-quant artifact, plain and with --speculate drafts."""
    import kvtrace
    from kvtrace.artifact.store import cached_artifact
    from kvtrace.cli.args import chosen_backend
    from kvtrace.cli.generate import encode
    from kvtrace.runtime.generate import stream

    quant = args.speculate_quant
    backend = chosen_backend(argparse.Namespace(backend=None, quant=quant))
    art = cached_artifact(None, backend=backend, max_seq_len=1024, prefill_logits="all", load=True,
                          quant=None if quant == "none" else quant).artifact
    grammar = art.grammar(kvtrace.Constraint.json_schema(schema))
    ids = encode(art, PROMPT, True)
    session = art.session()
    from kvtrace.runtime.grammar import GrammarState

    out: dict = {"quant": quant, "backend": backend, "k": args.speculate, "plain": [], "speculative": [],
                 "lookup_only": []}
    forced = GrammarState.forced
    for _ in range(args.rounds):
        for name, k in (("plain", 0), ("speculative", args.speculate), ("lookup_only", args.speculate)):
            session.reset()
            GrammarState.forced = forced if name != "lookup_only" else (lambda self: [])  # drafts: prompt lookup only
            gen = stream(session, ids, max_new_tokens=args.new_tokens, eos_ids=art.manifest.eos_ids, grammar=grammar,
                         speculate=k)
            toks = [c.token for c in gen]
            GrammarState.forced = forced
            st = gen.result.stats
            out[name].append({"tok_s": round(st.decode_tokens_per_s, 1), "tokens": toks, "drafted": st.drafted,
                              "accepted": st.accepted, "calls": st.calls, "stop": st.stop_reason})
    same = all(r["tokens"] == out["plain"][0]["tokens"] for r in out["speculative"] + out["lookup_only"])
    print(f"\n{quant} {backend}, --speculate {args.speculate}, JSON schema answer of {args.new_tokens} tokens at most "
          f"(same answer every way: {same}):")
    for name in ("plain", "speculative", "lookup_only"):
        rs = out[name]
        print(f"  {name}: {[r['tok_s'] for r in rs]} tok/s, accepted "
              f"{[str(r['accepted']) + '/' + str(r['drafted']) for r in rs]}, calls {[r['calls'] for r in rs]}")
    print("  answer: " + repr(art.tokenizer().decode(out["plain"][0]["tokens"], skip_special_tokens=True)[:300]))
    out["same_answer"] = same
    return out


def tool_calls(art) -> list[dict]:
    from openai import OpenAI

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.serve.test_serve import start_server

    from kvtrace.serve.app import app_for

    url, srv, thread = start_server(app_for(art))
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = []
    try:
        for q in QUESTIONS:
            for choice in ("auto", "required"):
                t0 = time.perf_counter()
                r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], tools=TOOLS,
                                                   tool_choice=choice, max_tokens=100, parallel_tool_calls=False)
                m = r.choices[0].message
                answer = (json.dumps([[c.function.name, json.loads(c.function.arguments)] for c in m.tool_calls])
                          if m.tool_calls else repr(m.content))
                out.append({"question": q, "choice": choice, "finish": r.choices[0].finish_reason, "answer": answer,
                            "seconds": round(time.perf_counter() - t0, 2), "prompt_tokens": r.usage.prompt_tokens})
    finally:
        srv.should_exit = True
        thread.join(30)
    return out


if __name__ == "__main__":
    sys.exit(main())
