"""Multi-turn chats through ``kvtrace serve``, with and without its prefix cache: what re-sending the whole
conversation each turn costs, and what keeping it in the slot saves.

An OpenAI client sends the whole conversation every turn (the API is stateless). Without a prefix cache the
server prefills all of it again; with one (the default), the slot that answered the previous turn still holds
it, and only the new turn is prefilled. This script starts the server (the default model's slots artifact,
``kvtrace serve``'s backend, cached) once per configuration, alternating ``--rounds`` times (these machines
drift within minutes), and runs ``--clients`` concurrent chats of ``--turns`` turns each: the first user
message carries a document (~``--doc-words`` words) and the later ones short questions about it, every answer
at most ``--new-tokens`` tokens at temperature 0 (streamed; an answer that ends at the end-of-turn token is
re-sent whole, so its slot holds all of it). Per turn: time to first token (median
over clients and rounds), prompt tokens and the tokens the server reported as cached
(``usage.prompt_tokens_details.cached_tokens``); per configuration the wall time. Every answer is compared
with the other configuration's: the cache must change no token. One JSON line per configuration, then a
markdown table.

    .venv/bin/python bench/prefix_cache.py [--clients 1] [--turns 4] [--new-tokens 48] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from kvtrace.artifact.store import cached_artifact
from kvtrace.serve import SERVE_BACKEND
from kvtrace.serve.bench import _free_port, _stop_server, _wait_healthy

DOC = ("A key-value cache stores the keys and values that a transformer's attention layers computed for earlier "
       "tokens, so that generating the next token needs only the new token's projections. Its size grows with "
       "the context: layers times heads times head size times positions, twice. Serving many conversations at "
       "once batches their decode steps, which read the weights once for every row, while each conversation "
       "keeps its own rows of the cache. Chat clients send the whole conversation with every request; a server "
       "that remembers which tokens a row already holds can skip recomputing them. ")
QUESTIONS = ("Summarize the text above in one sentence.", "What grows with the context?",
             "Why does batching help?", "What can a server skip?", "Give the text a title.",
             "Name one cost of a large cache.")


async def chat(client, url: str, messages: list[dict[str, str]], n: int) -> dict:
    body = {"model": "bench", "messages": messages, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, parts, usage = None, [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for ch in obj.get("choices", ()):
                if ch["delta"].get("content"):
                    first = first or time.perf_counter()
                    parts.append(ch["delta"]["content"])
    return {"ttft": (first or time.perf_counter()) - t0, "text": "".join(parts),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


async def conversations(url: str, clients: int, turns: int, n: int, doc: str) -> tuple[list[list[dict]], float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(c: int) -> list[dict]:
            msgs, out = [], []
            for t in range(turns):
                q = QUESTIONS[(c + t) % len(QUESTIONS)]
                msgs.append({"role": "user", "content": f"{doc}\n\n{q}" if t == 0 else q})
                r = await chat(client, url, msgs, n)
                msgs.append({"role": "assistant", "content": r["text"]})
                out.append(r)
            return out

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(c) for c in range(clients)))
        return res, time.perf_counter() - t0


def run_server(path, prefix: bool, env: dict, args) -> tuple[list[list[dict]], float]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvtrace.cli", "serve", str(path), "--port", str(port), "--quiet"]
    proc = subprocess.Popen(cmd + ([] if prefix else ["--no-prefix-cache"]), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        _wait_healthy(url, proc)
        asyncio.run(conversations(url, 1, 1, 4, "hello"))  # warm-up
        return asyncio.run(conversations(url, args.clients, args.turns, args.new_tokens, args.doc))
    finally:
        _stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--doc-words", type=int, default=400)
    ap.add_argument("--slots", type=int, default=4)
    args = ap.parse_args()
    words = DOC.split()
    args.doc = " ".join(words[i % len(words)] for i in range(args.doc_words))
    art = cached_artifact(None, backend=SERVE_BACKEND, max_seq_len=1024, slots=args.slots, progress=None)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.threads)}
    runs: dict[bool, list[tuple[list[list[dict]], float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for prefix in (True, False):
            runs[prefix].append(run_server(art.path, prefix, env, args))
    rows = {}
    for prefix, rs in runs.items():
        per_turn = []
        for t in range(args.turns):
            turn = [conv[t] for res, _ in rs for conv in res]
            per_turn.append({"turn": t + 1, "ttft_ms_p50": round(statistics.median(r["ttft"] for r in turn) * 1e3, 1),
                             "prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in turn)),
                             "cached_tokens": round(statistics.mean(r["cached_tokens"] for r in turn))})
        rows[prefix] = {"prefix_cache": prefix, "clients": args.clients, "turns": args.turns,
                        "new_tokens": args.new_tokens, "threads": args.threads, "backend": SERVE_BACKEND,
                        "wall_s": [round(w, 2) for _, w in rs], "per_turn": per_turn}
    texts = {p: [[r["text"] for conv in res for r in conv] for res, _ in rs] for p, rs in runs.items()}
    flat_on = [x for run in texts[True] for x in run]
    flat_off = [x for run in texts[False] for x in run]
    mismatches = sum(a != b for a, b in zip(flat_on, flat_off, strict=True))
    for p in (True, False):
        rows[p]["answers_differing_from_the_other_configuration"] = mismatches
        print(json.dumps(rows[p]))
    print("\n| turn | prompt tokens | cached (prefix cache) | TTFT ms, prefix cache | TTFT ms, without |")
    print("|---|---|---|---|---|")
    for on, off in zip(rows[True]["per_turn"], rows[False]["per_turn"], strict=True):
        print(f"| {on['turn']} | {on['prompt_tokens']} | {on['cached_tokens']} | {on['ttft_ms_p50']} | "
              f"{off['ttft_ms_p50']} |")
    print(f"\nwall s: prefix cache {rows[True]['wall_s']}, without {rows[False]['wall_s']}; "
          f"{mismatches} of {len(flat_on)} answers differ between the two")


if __name__ == "__main__":
    main()
