"""``kvtrace bench``: prefill ms, decode tokens/s, memory and recompiles per backend."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvtrace.cli.args import POSITIVE, device_arg, int_list, quant_args
from kvtrace.cli.ui import UI, output_file


def cmd_bench(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.tools.bench import run_cli_bench

    with output_file(args.json, "--json"), output_file(args.plot, "--plot"):
        return run_cli_bench(args, ui)


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace bench`` to the parser (``add(name, help)`` makes the subparser)."""
    p = add("bench", "Prefill ms, decode tokens/s, peak memory and recompiles, per backend, side by side.",
            json_flag=False)
    p.add_argument("--model", default=None)
    p.add_argument("--backends", default="hf-eager,exported,aoti")
    p.add_argument("--prompt-len", type=int_list, default="37")
    p.add_argument("--new-tokens", type=POSITIVE, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=POSITIVE, default=None)
    p.add_argument("--runs", type=POSITIVE, default=3)
    p.add_argument("--max-seq-len", type=POSITIVE, default=1024)
    quant_args(p, many=True)
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="also measure decode speed against context position and plot it (needs matplotlib)")
    device_arg(p, what="where every backend runs; artifacts are compiled for it (default cpu)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="with --device cuda: also measure each aoti/exported artifact with decode replayed from CUDA "
                        "graphs (a row '<backend>+graphs')")
    p.set_defaults(func=cmd_bench)
