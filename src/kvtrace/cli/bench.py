"""``kvtrace bench``: prefill ms, decode tokens/s, memory and recompiles per backend."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvtrace._errors import UsageError
from kvtrace.cli.args import POSITIVE, device_arg, huge_pages_arg, int_list, kv_dtype_arg, quant_args
from kvtrace.cli.ui import UI, output_file


def cmd_bench(args: argparse.Namespace, ui: UI) -> int:
    if args.serve:
        return cmd_bench_serve(args, ui)
    from kvtrace.tools.bench import run_cli_bench

    with output_file(args.json, "--json"), output_file(args.plot, "--plot"):
        return run_cli_bench(args, ui)


def cmd_bench_serve(args: argparse.Namespace, ui: UI) -> int:
    """``kvtrace bench --serve``: kvtrace serve under 1, 2, 4, 8 concurrent clients (kvtrace.serve.bench)."""
    import json
    from pathlib import Path

    from kvtrace.serve import GGUF_SERVE_BACKEND, SERVE_BACKEND
    from kvtrace.serve.bench import render_markdown, run_serve_bench

    kv = args.kv_dtype.split(",") if isinstance(args.kv_dtype, str) else list(args.kv_dtype)
    quant = str(args.quant).split(",")
    ignored = [f for f, on in (("a --quant list", len(quant) > 1), ("a --kv-dtype list", len(kv) > 1),
                               ("--device", str(args.device) != "cpu"),
                               ("--cuda-graphs", args.cuda_graphs), ("--plot", args.plot is not None)) if on]
    if ignored:
        raise UsageError(f"bench --serve measures one CPU slots artifact (one --quant, one --kv-dtype); "
                         f"{', '.join(ignored)} is not offered with it: drop it")
    clients = tuple(int(x) for x in str(args.clients).split(","))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    # the default list names several: serve's own (for GGUF blocks, the backend serve picks for them)
    backend = backends[0] if len(backends) == 1 else GGUF_SERVE_BACKEND if quant == ["gguf"] else SERVE_BACKEND
    with output_file(args.json, "--json"):
        data = run_serve_bench(args.model, clients=clients, requests_per_client=args.requests, new_tokens=args.new_tokens,
                               max_seq_len=args.max_seq_len, backend=backend, baseline_runs=args.runs,
                               check=not args.no_check, threads=args.threads, huge_pages=args.huge_pages,
                               kv_dtype=None if kv == ["auto"] else kv[0],
                               quant=None if quant == ["none"] else quant[0], progress=ui.step)
        if args.json:
            Path(args.json).write_text(json.dumps(data, indent=2))
    ui.out.print(render_markdown(data), markup=False, highlight=False, soft_wrap=True)
    return 0 if all(lv["mismatches"] == 0 for lv in data["levels"]) else 1


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace bench`` to the parser (``add(name, help)`` makes the subparser)."""
    p = add("bench", "Prefill ms, decode tokens/s, peak memory and recompiles, per backend, side by side.",
            json_flag=False)
    from kvtrace.backends import registry

    p.add_argument("--model", default=None,
                   help="smollm2-135m-instruct (default), a HF model dir, or a GGUF file")
    p.add_argument("--backends", default="hf-eager,exported,aoti", metavar="LIST",
                   help="comma list, one row each: hf-eager (the yardstick), hf-compile, jit, or an artifact backend "
                        f"({', '.join(sorted(registry.names()))}; each exported, then measured in a fresh process)")
    p.add_argument("--prompt-len", type=int_list, default="37", metavar="LIST",
                   help="comma list of prompt lengths in tokens, one row each (default 37)")
    p.add_argument("--new-tokens", type=POSITIVE, default=128, help="tokens decoded after the prompt (default 128)")
    p.add_argument("--dtype", default="float32", metavar="LIST",
                   help="comma list of float32, bfloat16: one row per choice (default float32)")
    p.add_argument("--threads", type=POSITIVE, default=None,
                   help="CPU threads for every row (default: torch's, one per core)")
    p.add_argument("--runs", type=POSITIVE, default=3, help="generations per row; the median is reported (default 3)")
    p.add_argument("--max-seq-len", type=POSITIVE, default=1024, help="the artifacts' cache length (default 1024)")
    quant_args(p, many=True)
    kv_dtype_arg(p, many=True)
    p.add_argument("--serve", action="store_true",
                   help="measure kvtrace serve instead: aggregate tokens/s, time to first token and inter-token "
                        "latency for --clients concurrent clients (a server process on the model's slots artifact; "
                        "--backends names its one backend, default kvtrace serve's: aoti-packed), answers checked against solo runs")
    p.add_argument("--clients", type=int_list, default="1,2,4,8", help="with --serve: concurrency levels")
    p.add_argument("--requests", type=POSITIVE, default=2, help="with --serve: requests per client per level")
    p.add_argument("--no-check", action="store_true",
                   help="with --serve: skip the solo runs that check every answer (timing only)")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="also measure decode speed against context position and plot it (needs matplotlib)")
    device_arg(p, what="where every backend runs; artifacts are compiled for it (default cpu)")
    huge_pages_arg(p)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="with --device cuda: also measure each aoti/exported artifact with decode replayed from CUDA "
                        "graphs (a row '<backend>+graphs')")
    p.set_defaults(func=cmd_bench)
