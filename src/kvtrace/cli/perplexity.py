"""``kvtrace perplexity``: what quantized weights or an int8 KV cache cost in quality, llama.cpp's way."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from kvtrace.cli.args import POSITIVE, choice_list, chosen_backend, int_in, kv_dtype_arg, quant_args
from kvtrace.cli.ui import UI, output_file


def cmd_perplexity(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.tools.perplexity import render_markdown, run_cli_perplexity

    def backend_for(quant: str) -> str:
        return chosen_backend(argparse.Namespace(backend=args.backend, quant=quant))

    with output_file(args.json, "--json"):
        report = run_cli_perplexity(args, step=ui.step, backend_for=backend_for)
        if args.json:
            Path(args.json).write_text(report.to_json())
    ui.out.print(render_markdown(report), markup=False, highlight=False, soft_wrap=True)
    if args.max_kl is not None:
        over = report.exceeds(args.max_kl)
        for line in over:
            ui.out.print(f"FAIL {line}", markup=False, highlight=False)
        return 1 if over else 0
    return 0


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace perplexity`` to the parser (``add(name, help)`` makes the subparser)."""
    from kvtrace.backends import registry

    p = add("perplexity", "Perplexity of a text, and each quantized artifact's KL divergence from float32 eager.",
            json_flag=False)
    p.add_argument("model", nargs="?", default=None,
                   help="smollm2-135m-instruct (default), a HF model dir, a GGUF file, or an artifact (.kvt/.pte, "
                        "exported with --prefill-logits all: scored alone, without a reference)")
    p.add_argument("--text", required=True, help="a UTF-8 text file to score (or - for stdin)")
    from kvtrace.tools.perplexity import MIN_CTX

    p.add_argument("--ctx", type=int_in(MIN_CTX), default=512,
                   help="tokens per chunk (default 512, as llama-perplexity); the second half of each is scored")
    p.add_argument("--chunks", type=POSITIVE, default=None, help="score at most this many chunks (default: all)")
    p.add_argument("--dtype", type=choice_list(("float32", "bfloat16")), default="float32", metavar="LIST",
                   help="comma list of float32, bfloat16: the artifacts' dtype, one row each (the reference is "
                        "always float32)")
    quant_args(p, many=True)
    kv_dtype_arg(p, many=True)
    p.add_argument("--backend", choices=sorted(registry.names()), default=None,
                   help="the artifacts' backend (default aoti; aoti-packed for int8 / int4 / 8da4w weights)")
    p.add_argument("--artifact", action="append", default=[],
                   help="also score this artifact (repeatable; exported with --prefill-logits all)")
    p.add_argument("--max-kl", type=float, default=None, metavar="NATS",
                   help="exit 1 when any artifact's mean KL divergence from the reference is above this")
    p.set_defaults(func=cmd_perplexity)
