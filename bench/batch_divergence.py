"""Where batched greedy answers leave solo ones, and how close solo's top two logits were there.

A slots artifact decodes every active conversation in one call of R rows; its matmuls then run other
kernels (other blocking, other summation orders) than a batch-1 program's, so K, V and logits differ from a
solo run's in the last bits. With float32 caches that changes a greedy token only where the top two logits
tie within that noise. With an int8 cache a K/V value that sits within that noise of an int8 rounding edge
is stored one step apart (~1 % of its row's largest value), and greedy decoding can then leave the solo
answer at the next near-tie. This script measures it on the default model: ``--requests`` prompts decoded
together through the slots artifact (``kvtrace serve``'s: aoti-packed, cached) against each alone through
the batch-1 artifact of the same cache, printing per request the first token that differs and solo's
top-2 margin at that step (and its smallest margin anywhere), one JSON line each.

    .venv/bin/python bench/batch_divergence.py [--kv-dtype int8|auto] [--quant none|int8|...] [--new-tokens 128]
        [--requests 4]

``--quant``: quantized weights (both artifacts; the slots one runs other kernels for R rows than the batch-1
one's own decode program, so with bf16 or int8 activations even one slot may leave the solo answer).
"""

from __future__ import annotations

import argparse
import json

import torch

from kvtrace.artifact.store import cached_artifact
from kvtrace.runtime.slots import SlotRequest
from kvtrace.serve import SERVE_BACKEND
from kvtrace.serve.bench import PROMPTS
from kvtrace.sources.chat import encode_prompt


def batched(art, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Every prompt admitted at once (one slot each), then decode steps of all rows until each has n tokens."""
    engine = art.slot_engine()
    out: dict[int, list[int]] = {}
    owner = {}
    for i, p in enumerate(prompts):
        slot, ev = engine.admit(SlotRequest(p, max_tokens=n))
        owner[slot], out[i] = i, [ev.token]
    while engine.active:
        for ev in engine.step():
            if ev.token is not None:
                out[owner[ev.slot]].append(ev.token)
    return [out[i] for i in range(len(prompts))]


def solo(art, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of one prompt alone, and the top-2 logit margin before each."""
    s = art.session()
    tokens, margins = [], []
    with torch.inference_mode():
        logits = s.prefill(torch.tensor([prompt]))[0, -1]
        for _ in range(n):
            top = torch.topk(logits.float(), 2)
            margins.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
            if len(tokens) < n:
                logits = s.decode(torch.tensor([[tokens[-1]]]))[0, -1]
    return tokens, margins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", choices=("auto", "int8"), default="int8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4, help=f"prompts decoded together (at most {len(PROMPTS)})")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--quant", default="none", help="weights: none (default), int8, int4, 8da4w, gguf")
    ap.add_argument("--backend", default=SERVE_BACKEND)
    ap.add_argument("--slots", type=int, default=None, help="slots of the artifact (default: --requests)")
    args = ap.parse_args()
    kv = None if args.kv_dtype == "auto" else args.kv_dtype
    opts = dict(backend=args.backend, max_seq_len=args.max_seq_len, kv_dtype=kv,
                quant=None if args.quant == "none" else args.quant, load=True)
    plain = cached_artifact(None, **opts).artifact
    many = cached_artifact(None, slots=args.slots or args.requests, **opts).artifact
    tok, m = plain.tokenizer(), plain.manifest
    prompts = [encode_prompt(tok, p, chat=True, template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids)
               for p in PROMPTS[: args.requests]]
    for i, (p, got) in enumerate(zip(prompts, batched(many, prompts, args.new_tokens), strict=True)):
        ref, margins = solo(plain, p, args.new_tokens)
        first = next((j for j, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b), None)
        print(json.dumps({"request": i, "kv_dtype": args.kv_dtype, "quant": args.quant, "prompt_tokens": len(p),
                          "first_difference": first,
                          "solo_margin_there": None if first is None else round(margins[first], 4),
                          "solo_min_margin": round(min(margins), 4), "at": margins.index(min(margins)),
                          "solo_median_margin": round(sorted(margins)[len(margins) // 2], 3)}), flush=True)


if __name__ == "__main__":
    main()
