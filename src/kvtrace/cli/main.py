"""The kvtrace command line. The only module that prints or exits.

Exit codes: 0 success; 1 failure (verify found a mismatch, a capture/compile failed); 2 bad input
(a missing or malformed model, artifact or prompt; an unsupported model or cache).
Errors are one line on stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvtrace import __version__
from kvtrace._errors import CaptureError, KvtraceError
from kvtrace.cli import bench, cache, chat, export, generate, lint, perplexity, run, serve, verify
from kvtrace.cli.args import Parser, common
from kvtrace.cli.ui import UI
from kvtrace.sources.quiet import quiet_libraries

EXAMPLES = {
    "generate": 'kvtrace generate "Who\'s the founder of Meta?"\n  echo "Hi" | kvtrace generate - --temperature 0.7 --seed 1',
    "chat": "kvtrace chat            (the default model; /help inside)\n  kvtrace chat smollm2.kvt --system \"Answer briefly.\"",
    "export": "kvtrace export smollm2-135m-instruct -o smollm2.kvt --max-seq-len 1024 --backend aoti",
    "run": 'kvtrace run smollm2.kvt --prompt "Who\'s the founder of Meta?" --max-len 128\n'
           '  kvtrace run vision.kvt --prompt "Describe the image." --image-features image.safetensors',
    "verify": 'kvtrace verify smollm2-135m-instruct --against jit,exported --steps 8 --json report.json',
    "lint": "kvtrace lint smollm2-135m-instruct --json lint.json",
    "cache": "kvtrace cache list\n  kvtrace cache clear",
    "serve": "kvtrace serve --parallel 8            (the default model; OpenAI API on http://127.0.0.1:8000/v1)\n"
             "  kvtrace serve smollm2-slots8.kvt --port 8080 --api-key sk-local",
    "perplexity": "kvtrace perplexity --text wiki.test.raw --quant none,int8,int4 --kv-dtype auto,int8 --chunks 20",
    "bench": "kvtrace bench --backends hf-eager,exported,aoti --new-tokens 128 --json bench.json --plot bench.png",
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvtrace", description="Compile and export LLM decoders together with their KV cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  " + "\n  ".join(EXAMPLES.values()),
    )
    parser.add_argument("--version", action="version", version=f"kvtrace {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, json_flag: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {EXAMPLES[name]}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        common(p, json_flag)
        return p

    generate.register(add)
    chat.register(add)
    export.register(add)
    run.register(add)
    verify.register(add)
    lint.register(add)
    cache.register(add)
    serve.register(add)
    bench.register(add)
    perplexity.register(add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.debug:
        quiet_libraries()  # --debug keeps the libraries' own output
    json_mode = args.json is True
    ui = UI(args.quiet, json_mode)
    try:
        return args.func(args, ui)
    except KvtraceError as e:
        if args.debug:
            raise
        print(f"kvtrace {args.command}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, CaptureError) else 2
    except OSError as e:  # the file system refused (disk full, a path that vanished): not a kvtrace bug
        if args.debug:
            raise
        where = f" ({e.filename})" if e.filename else ""
        print(f"kvtrace {args.command}: error: {e.strerror or e}{where}; check the paths and free space "
              "(--debug shows the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
