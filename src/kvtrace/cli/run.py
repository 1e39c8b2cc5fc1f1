"""``kvtrace run``: generate from an exported artifact (no transformers needed)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from kvtrace._errors import UsageError
from kvtrace.cli.args import (
    POSITIVE,
    constraint_args,
    constraint_of,
    cuda_graphs_arg,
    device_arg,
    huge_pages_arg,
    sampling_args,
    speculate_arg,
)
from kvtrace.cli.generate import check_cuda_graphs, encode, generate_text, read_prompt
from kvtrace.cli.ui import UI


def cmd_run(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.artifact.archive import load

    prompt = read_prompt(args.prompt)
    args.constraint = constraint_of(args)  # a bad schema or pattern: refused before the artifact loads
    with ui.step(f"loading {args.file}"):
        art = load(args.file, expected_sha256=args.expected_sha256, device=args.device, huge_pages=args.huge_pages)
    check_cuda_graphs(art, args)
    n_prompt = len(encode(art, prompt, args.chat))
    if args.max_len <= n_prompt:
        raise UsageError(f"--max-len {args.max_len} leaves no room after the {n_prompt}-token prompt; raise it")
    out = generate_text(ui, art, prompt, args, args.max_len - n_prompt)
    if ui.json_mode:
        print(json.dumps(out))
    return 0


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace run`` to the parser (``add(name, help)`` makes the subparser)."""
    p = add("run", "Generate from an exported artifact (no transformers needed).")
    p.add_argument("file", help="artifact written by `kvtrace export`")
    p.add_argument("--prompt", required=True, help="prompt text, or - for stdin")
    p.add_argument("--max-len", type=POSITIVE, default=64, help="prompt + generated tokens (default 64)")
    p.add_argument("--image-features", default=None, metavar="FILE.safetensors",
                   help="vision decoder artifacts: image features for the prefill, a .safetensors file holding "
                        "cross_attention_states [1, N, dim] (and optionally cross_attention_mask [1, T, N])")
    p.add_argument("--expected-sha256", default=None, metavar="HEX",
                   help="refuse the artifact unless the whole file has this SHA-256 (checked before anything in "
                        "it is read; aoti artifacts hold native code: pin the hash of one you trust)")
    sampling_args(p)
    constraint_args(p)
    speculate_arg(p, builds=False)
    device_arg(p, default=None, what="where to run it: the device type it was compiled for (default), or cuda:N")
    cuda_graphs_arg(p)
    huge_pages_arg(p)
    p.set_defaults(func=cmd_run)

