"""``kvtrace export``: a model with its KV cache to one artifact file."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from kvtrace.cli.args import POSITIVE, device_arg, kv_dtype_arg, quant_args
from kvtrace.cli.ui import UI, output_file


def cmd_export(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.artifact.export import export

    t0 = time.perf_counter()
    with output_file(args.output, "-o"):
        path = export(args.source, args.output, max_seq_len=args.max_seq_len, dtype=args.dtype, backend=args.backend,
                      image_tokens=args.image_tokens, prefill_logits=args.prefill_logits, progress=ui.step,
                      kv_dtype=args.kv_dtype, device=args.device, quant=args.quant,
                      quant_group_size=args.quant_group_size, quant_head=args.quant_head, slots=args.slots)
    info = {"path": str(path), "bytes": path.stat().st_size, "seconds": round(time.perf_counter() - t0, 2)}
    if ui.json_mode:
        print(json.dumps(info))
    else:
        ui.out.print(f"wrote {path} ({info['bytes'] / 2**20:.1f} MiB) in {info['seconds']:.1f}s")
    return 0


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace export`` to the parser (``add(name, help)`` makes the subparser)."""
    from kvtrace.backends import registry

    p = add("export", "Export a model with its KV cache to one artifact file.")
    p.add_argument("source", help="smollm2-135m-instruct, a HF model dir, or a GGUF file")
    p.add_argument("-o", "--output", required=True, help="artifact file to write, e.g. model.kvt")
    p.add_argument("--max-seq-len", type=POSITIVE, default=1024)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--backend", choices=registry.names(), default="exported",
                   help="aoti-packed: frozen, prepacked weights and CPU GEMM templates (fastest decode, "
                        "slowest compile)")
    p.add_argument("--image-tokens", type=POSITIVE, default=None, metavar="N",
                   help="vision decoders (Llama 3.2 Vision): image tokens N of cross_attention_states [B, N, dim] "
                        "(default 6404 = 4 tiles x 1601)")
    p.add_argument("--prefill-logits", choices=("last", "all"), default="last",
                   help="last (default): prefill returns the last position's logits, all a generation needs "
                        "(the vocabulary projection runs on one row); all: every prompt position's, for scoring")
    p.add_argument("--slots", type=POSITIVE, default=None, metavar="N",
                   help="N conversation slots for `kvtrace serve --parallel N`: a cache of N rows and programs that "
                        "prefill one slot and decode all active slots together, each at its own position "
                        "(text decoders of full and sliding layers, int8 caches too; not the vision decoder)")
    kv_dtype_arg(p)
    device_arg(p, what="the device the programs are compiled for: cpu (default), or cuda (AOTInductor compiles CUDA "
                       "kernels; needs a GPU here and where the artifact runs)")
    quant_args(p)
    p.set_defaults(func=cmd_export)

