"""``kvtrace verify``: every candidate against eager, step by step; exit 1 on a mismatch."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from kvtrace.cli.args import POSITIVE, device_arg, int_in, kv_dtype_arg, quant_args
from kvtrace.cli.ui import UI, output_file, tables_markdown


def cmd_verify(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.tools.verify import run_cli_verify

    with output_file(args.json, "--json"):
        report = run_cli_verify(args, step=ui.step)
        if args.json:
            Path(args.json).write_text(report.to_json())
    if not ui.quiet:
        from kvtrace.tools.verify import render

        if ui.out.is_terminal:
            ui.out.print(render(report))
        else:  # piped or logged: the same tables as Markdown, full width
            ui.out.print(tables_markdown(render(report)), markup=False, highlight=False, soft_wrap=True)
    ui.out.print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace verify`` to the parser (``add(name, help)`` makes the subparser)."""
    from kvtrace.backends import registry

    p = add("verify", "Compare jit/exported/aoti against eager: logits and every cache layer, step by step.",
            json_flag=False)
    p.add_argument("source", help="smollm2-135m-instruct, a HF model dir, or a GGUF file")
    p.add_argument("--artifact", action="append", default=[], help="also verify this artifact (repeatable)")
    p.add_argument("--against", default="jit,exported",
                   help=f"comma list of jit, jit-eager, {', '.join(registry.names())}")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", default=None, help="first prompt (a second, different prompt follows a reset)")
    g.add_argument("--prompts", default=None, help="file with one prompt per line")
    p.add_argument("--steps", type=int_in(0), default=8, help="greedy decode steps per prompt")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-fp32-reference", dest="fp32_reference", action="store_false", default=True,
                   help="bfloat16 only: judge against eager bf16 alone (by default a candidate may also pass a "
                        "tensor by being no further from an fp32 run of the same weights than eager bf16 is; that "
                        "fp32 copy of the model needs twice the bf16 model's memory)")
    p.add_argument("--no-noise-floor", dest="noise_floor", action="store_false", default=True,
                   help="int8 caches and quantized weights: judge with the fixed tolerances alone (by default a "
                        "candidate may also pass a tensor within the tolerance + 2x the reference's own noise floor, "
                        "measured by two more eager runs of it with its linear layers summed differently)")
    p.add_argument("--max-seq-len", type=POSITIVE, default=None,
                   help="the cache of the --against exports (default 256, or the model's max_position_embeddings "
                        "where that is less; at least the longest prompt plus --steps)")
    p.add_argument("--raw", dest="chat", action="store_false", default=True)
    p.add_argument("--image-features", default=None, metavar="FILE.safetensors",
                   help="vision decoders: cross_attention_states [1, N, dim]; every prompt runs with this image, "
                        "then again text only")
    kv_dtype_arg(p)  # for the --against exports; an --artifact's own cache is read from its manifest
    device_arg(p, what="where eager (the reference) and every candidate run; the --against artifacts are compiled "
                       "for it (default cpu)")
    quant_args(p)  # likewise: an --artifact's quantized weights are read from its manifest
    p.set_defaults(func=cmd_verify)

