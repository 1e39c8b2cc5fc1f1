"""The kvtrace command line. The only module that prints or exits.

Exit codes: 0 success; 1 failure (verify found a mismatch, a capture/compile failed); 2 bad input
(a missing or malformed model, artifact or prompt; an unsupported model or cache).
Errors are one line on stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvtrace import __version__
from kvtrace._errors import CaptureError, KvtraceError, UsageError

EXAMPLES = {
    "generate": 'kvtrace generate "Who\'s the founder of Meta?"\n  echo "Hi" | kvtrace generate - --temperature 0.7 --seed 1',
    "export": "kvtrace export smollm2-135m-instruct -o smollm2.kvt --max-seq-len 1024 --backend aoti",
    "run": 'kvtrace run smollm2.kvt --prompt "Who\'s the founder of Meta?" --max-len 128\n'
           '  kvtrace run vision.kvt --prompt "Describe the image." --image-features image.safetensors',
    "verify": 'kvtrace verify smollm2-135m-instruct --against jit,exported --steps 8 --json report.json',
    "lint": "kvtrace lint smollm2-135m-instruct --json lint.json",
    "cache": "kvtrace cache list\n  kvtrace cache clear",
    "bench": "kvtrace bench --backends hf-eager,exported,aoti --new-tokens 128 --json bench.json --plot bench.png",
}


class _UI:
    """stderr status/progress (rich) and stdout results; quiet/json switch them off."""

    def __init__(self, quiet: bool, json_mode: bool):
        from rich.console import Console

        self.quiet = quiet or json_mode
        self.json_mode = json_mode
        self.err = Console(stderr=True)
        self.out = Console()

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        if self.quiet:
            yield
            return
        with self.err.status(f"{what}..."):
            yield
        self.err.print(f"[dim]{what}: {time.perf_counter() - t0:.1f}s[/dim]")

    def info(self, text: str) -> None:
        if not self.quiet:
            self.err.print(text)

    def notice(self, text: str) -> None:
        """One line the user should see even in --quiet/--json mode (e.g. a cache entry rebuilt)."""
        self.err.print(f"kvtrace: {text}", markup=False, highlight=False, style="yellow", soft_wrap=True)


# --- shared: prompts and generation ------------------------------------------------------------
def _read_prompt(prompt: str | None) -> str:
    if prompt == "-":
        prompt = sys.stdin.read()
    if prompt is None or not prompt.strip():
        raise UsageError("the prompt is empty; pass text, or - to read it from stdin")
    return prompt


def _encode(art: Any, text: str, chat: bool) -> list[int]:
    from kvtrace.sources.chat import encode_prompt

    tok = art.tokenizer()
    if tok is None:
        raise UsageError(f"{art.path} has no tokenizer; export it from a model source that has one")
    m = art.manifest
    return encode_prompt(tok, text, chat=chat, template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids)


def _generate(ui: _UI, art: Any, prompt: str, args: argparse.Namespace, max_new: int) -> dict[str, Any]:
    from kvtrace.runtime.generate import Sampling, generate

    ids = _encode(art, prompt, args.chat)
    room = art.cache_spec.max_seq_len - len(ids)
    if room < 1:
        raise UsageError(
            f"the prompt is {len(ids)} tokens; the artifact's max_seq_len is {art.cache_spec.max_seq_len}. "
            "Shorten the prompt or export with a larger --max-seq-len"
        )
    tok = art.tokenizer()
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)

    def on_text(delta: str) -> None:
        if not ui.json_mode:
            sys.stdout.write(delta)
            sys.stdout.flush()

    inputs = _image_inputs(art, getattr(args, "image_features", None))
    res = generate(art.session(), ids, max_new_tokens=min(max_new, room), sampling=sampling, inputs=inputs,
                   eos_ids=art.manifest.eos_ids, decode_text=lambda t: tok.decode(t, skip_special_tokens=True),
                   on_text=on_text)
    if not ui.json_mode:
        sys.stdout.write("\n")
    ui.info(f"[dim]{res.stats.line()}[/dim]")
    return {"text": res.text, "tokens": res.tokens, **res.stats.to_dict()}


@contextlib.contextmanager
def _output_file(path: str | None, flag: str) -> Iterator[Path | None]:
    """Check now, before minutes of capture, that ``path`` can be written: UsageError for a folder, a
    path inside a file, a folder without write permission or on a read-only mount. Missing folders are
    created for the probe and removed again if the command fails."""
    if path is None:
        yield None
        return
    p = Path(path).expanduser()
    folder = p.absolute().parent
    created = []
    try:
        if p.is_dir():
            raise UsageError(f"{flag} {path} is a directory; expected a file name such as model.kvt")
        missing = folder
        while not missing.exists():
            created.append(missing)
            missing = missing.parent
        if not missing.is_dir():
            raise UsageError(f"{flag} {path} cannot be written: {missing} is a file, not a folder; choose another path")
        for d in reversed(created):
            d.mkdir()
        fd, probe = tempfile.mkstemp(prefix=".kvtrace-probe-", dir=folder)  # permissions, mounts, quotas
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        _remove_empty(created)
        raise UsageError(f"{flag} {path} cannot be written ({e.strerror or e}); expected a file in a writable "
                         "folder. Choose another path") from e
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield p
    except BaseException:
        _remove_empty(created)
        raise


def _remove_empty(folders: list[Path]) -> None:
    for d in folders:  # deepest first
        with contextlib.suppress(OSError):
            d.rmdir()


def _image_inputs(art: Any, path: str | None) -> dict[str, Any]:
    """--image-features FILE.safetensors -> named prefill inputs (checked by the Session)."""
    if path is None:
        return {}
    from kvtrace.spec.program import read_inputs_file

    accepted = {i.name for p in art.manifest.programs.values() for i in p.inputs}  # no cache allocated
    if not accepted:
        raise UsageError(f"--image-features given, but {art.path} was exported from a text-only model "
                         f"({art.manifest.model_name or art.manifest.model_type}); its prefill takes token ids only")
    tensors = read_inputs_file(path)
    if len(tensors) == 1 and "cross_attention_states" in accepted:
        return {"cross_attention_states": next(iter(tensors.values()))}
    unknown = sorted(set(tensors) - accepted)
    if unknown:
        raise UsageError(f"--image-features {path} holds {unknown}; expected tensors named {sorted(accepted)}")
    return tensors


# --- commands ---------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace, ui: _UI) -> int:
    from kvtrace.artifact.store import cached_artifact

    prompt = _read_prompt(args.prompt)
    t0 = time.perf_counter()
    # loads (and so checks) the artifact too; a cached one that fails its integrity check is rebuilt
    built = cached_artifact(args.model, backend=args.backend, max_seq_len=args.max_seq_len, dtype=args.dtype,
                            progress=ui.step, load=True, notice=ui.notice)
    art = built.artifact
    load_s = time.perf_counter() - t0
    ui.info(f"[dim]{'cache hit' if built.cache_hit else f'compiled in {built.seconds:.1f}s'}: {built.path}[/dim]")
    out = _generate(ui, art, prompt, args, args.max_new_tokens)
    out.update(load_s=round(load_s, 2), compile_s=round(built.seconds, 2), cache_hit=built.cache_hit)
    ui.info(f"[dim]load {load_s:.1f}s ({'cache hit' if built.cache_hit else f'compile {built.seconds:.1f}s'})[/dim]")
    if ui.json_mode:
        print(json.dumps(out))
    return 0


def cmd_run(args: argparse.Namespace, ui: _UI) -> int:
    from kvtrace.artifact.archive import load

    prompt = _read_prompt(args.prompt)
    with ui.step(f"loading {args.file}"):
        art = load(args.file, expected_sha256=args.expected_sha256)
    n_prompt = len(_encode(art, prompt, args.chat))
    if args.max_len <= n_prompt:
        raise UsageError(f"--max-len {args.max_len} leaves no room after the {n_prompt}-token prompt; raise it")
    out = _generate(ui, art, prompt, args, args.max_len - n_prompt)
    if ui.json_mode:
        print(json.dumps(out))
    return 0


def cmd_export(args: argparse.Namespace, ui: _UI) -> int:
    from kvtrace.artifact.export import export

    t0 = time.perf_counter()
    with _output_file(args.output, "-o"):
        path = export(args.source, args.output, max_seq_len=args.max_seq_len, dtype=args.dtype, backend=args.backend,
                      image_tokens=args.image_tokens, prefill_logits=args.prefill_logits, progress=ui.step)
    info = {"path": str(path), "bytes": path.stat().st_size, "seconds": round(time.perf_counter() - t0, 2)}
    if ui.json_mode:
        print(json.dumps(info))
    else:
        ui.out.print(f"wrote {path} ({info['bytes'] / 2**20:.1f} MiB) in {info['seconds']:.1f}s")
    return 0


def cmd_verify(args: argparse.Namespace, ui: _UI) -> int:
    from kvtrace.tools.verify import run_cli_verify

    with _output_file(args.json, "--json"):
        report = run_cli_verify(args, step=ui.step)
        if args.json:
            Path(args.json).write_text(report.to_json())
    if not ui.quiet:
        from kvtrace.tools.verify import render

        ui.out.print(render(report))
    ui.out.print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


def cmd_lint(args: argparse.Namespace, ui: _UI) -> int:
    from kvtrace.tools.lint import run_cli_lint

    with _output_file(args.json, "--json"):
        report = run_cli_lint(args, step=ui.step)
        if args.json:
            Path(args.json).write_text(report.to_json())
    ui.out.print("\n".join(report.lines()), markup=False, highlight=False, soft_wrap=True)
    return 0 if report.ok else 1


def cmd_cache(args: argparse.Namespace, ui: _UI) -> int:
    from kvtrace.artifact.store import clear_artifacts, list_artifacts
    from kvtrace.sources.store import cache_dir, clear_cache, list_cache

    if args.action == "clear":
        freed = clear_cache() + clear_artifacts()
        ui.out.print(f"freed {freed / 2**20:.1f} MiB from {cache_dir()}")
        return 0
    entries = [*list_cache(), *list_artifacts()]
    if ui.json_mode:
        print(json.dumps([{"path": str(p), "bytes": n} for p, n in entries]))
        return 0
    ui.out.print(f"cache: {cache_dir()}")
    for p, n in entries:
        ui.out.print(f"  {n / 2**20:9.1f} MiB  {p}")
    if not entries:
        ui.out.print("  (empty)")
    return 0


def cmd_bench(args: argparse.Namespace, ui: _UI) -> int:
    from kvtrace.tools.bench import run_cli_bench

    with _output_file(args.json, "--json"), _output_file(args.plot, "--plot"):
        return run_cli_bench(args, ui)


# --- parser -----------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with kvtrace's one-line errors (exit 2): ``kvtrace run: error: ... (see kvtrace run --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]."""
    want = f"a whole number >= {low}" if high is None else f"a whole number in [{low}, {high}]"

    def whole_number(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"expected {want}, got {v}")
        return v

    return whole_number


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def _temperature(text: str) -> float:
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (0 = greedy), got {text!r}")
    return v


def _probability(text: str) -> float:
    v = _float(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return v


def _int_list(text: str) -> str:
    """A comma list of whole numbers >= 1 (bench --prompt-len), kept as text."""
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() and int(t) >= 1 for t in items):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1 separated by commas, got {text!r}")
    return ",".join(items)


_POSITIVE, _SEED = _int_in(1), _int_in(0, 2**63 - 1)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=_POSITIVE, default=None)
    p.add_argument("--top-p", type=_probability, default=None, help="in (0, 1]")
    p.add_argument("--seed", type=_SEED, default=None)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--chat", dest="chat", action="store_true", default=True, help="apply the chat template (default)")
    g.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt as plain text")


def _common(p: argparse.ArgumentParser, json_flag: bool) -> None:
    if json_flag:
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    else:
        p.add_argument("--json", default=None, metavar="OUT", help="write every step's numbers as JSON to OUT")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress or stats on stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvtrace", description="Compile and export LLM decoders together with their KV cache.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  " + "\n  ".join(EXAMPLES.values()),
    )
    parser.add_argument("--version", action="version", version=f"kvtrace {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, json_flag: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {EXAMPLES[name]}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _common(p, json_flag)
        return p

    p = add("generate", "Stream an answer from a model (default: the embedded SmolLM2-135M-Instruct), compiled.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text, or - for stdin")
    p.add_argument("--model", default=None, help="smollm2-135m-instruct (default), a HF model dir, or a GGUF file")
    p.add_argument("--max-new-tokens", type=_POSITIVE, default=256)
    p.add_argument("--backend", choices=("aoti", "aoti-packed", "exported"), default="aoti")
    p.add_argument("--max-seq-len", type=_POSITIVE, default=1024)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    _sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = add("export", "Export a model with its KV cache to one artifact file.")
    p.add_argument("source", help="smollm2-135m-instruct, a HF model dir, or a GGUF file")
    p.add_argument("-o", "--output", required=True, help="artifact file to write, e.g. model.kvt")
    p.add_argument("--max-seq-len", type=_POSITIVE, default=1024)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--backend", choices=("exported", "aoti", "aoti-packed"), default="exported",
                   help="aoti-packed: frozen, prepacked weights and CPU GEMM templates (fastest decode, "
                        "slowest compile)")
    p.add_argument("--image-tokens", type=_POSITIVE, default=None, metavar="N",
                   help="vision decoders (Llama 3.2 Vision): image tokens N of cross_attention_states [B, N, dim] "
                        "(default 6404 = 4 tiles x 1601)")
    p.add_argument("--prefill-logits", choices=("last", "all"), default="last",
                   help="last (default): prefill returns the last position's logits, all a generation needs "
                        "(the vocabulary projection runs on one row); all: every prompt position's, for scoring")
    p.set_defaults(func=cmd_export)

    p = add("run", "Generate from an exported artifact (no transformers needed).")
    p.add_argument("file", help="artifact written by `kvtrace export`")
    p.add_argument("--prompt", required=True, help="prompt text, or - for stdin")
    p.add_argument("--max-len", type=_POSITIVE, default=64, help="prompt + generated tokens (default 64)")
    p.add_argument("--image-features", default=None, metavar="FILE.safetensors",
                   help="vision decoder artifacts: image features for the prefill, a .safetensors file holding "
                        "cross_attention_states [1, N, dim] (and optionally cross_attention_mask [1, T, N])")
    p.add_argument("--expected-sha256", default=None, metavar="HEX",
                   help="refuse the artifact unless the whole file has this SHA-256 (checked before anything in "
                        "it is read; aoti artifacts hold native code: pin the hash of one you trust)")
    _sampling_args(p)
    p.set_defaults(func=cmd_run)

    p = add("verify", "Compare jit/exported/aoti against eager: logits and every cache layer, step by step.",
            json_flag=False)
    p.add_argument("source", help="smollm2-135m-instruct, a HF model dir, or a GGUF file")
    p.add_argument("--artifact", action="append", default=[], help="also verify this artifact (repeatable)")
    p.add_argument("--against", default="jit,exported",
                   help="comma list of jit, jit-eager, exported, aoti, aoti-packed")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompt", default=None, help="first prompt (a second, different prompt follows a reset)")
    g.add_argument("--prompts", default=None, help="file with one prompt per line")
    p.add_argument("--steps", type=_int_in(0), default=8, help="greedy decode steps per prompt")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-fp32-reference", dest="fp32_reference", action="store_false", default=True,
                   help="bfloat16 only: judge against eager bf16 alone (by default a candidate may also pass a "
                        "tensor by being no further from an fp32 run of the same weights than eager bf16 is; that "
                        "fp32 copy of the model needs twice the bf16 model's memory)")
    p.add_argument("--max-seq-len", type=_POSITIVE, default=256)
    p.add_argument("--raw", dest="chat", action="store_false", default=True)
    p.add_argument("--image-features", default=None, metavar="FILE.safetensors",
                   help="vision decoders: cross_attention_states [1, N, dim]; every prompt runs with this image, "
                        "then again text only")
    p.set_defaults(func=cmd_verify)

    p = add("lint", "Check that a model captures under kvtrace.jit with no length baked in, no recapture and no "
            "side effects.", json_flag=False)
    p.add_argument("source", help="smollm2-135m-instruct, a HF model dir, or a GGUF file")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.set_defaults(func=cmd_lint)

    p = add("cache", "List or clear kvtrace's caches (converted weights, compiled artifacts).")
    p.add_argument("action", choices=("list", "clear"))
    p.set_defaults(func=cmd_cache)

    p = add("bench", "Prefill ms, decode tokens/s, peak memory and recompiles, per backend, side by side.",
            json_flag=False)
    p.add_argument("--model", default=None)
    p.add_argument("--backends", default="hf-eager,exported,aoti")
    p.add_argument("--prompt-len", type=_int_list, default="37")
    p.add_argument("--new-tokens", type=_POSITIVE, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=_POSITIVE, default=None)
    p.add_argument("--runs", type=_POSITIVE, default=3)
    p.add_argument("--max-seq-len", type=_POSITIVE, default=1024)
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="also measure decode speed against context position and plot it (needs matplotlib)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    json_mode = args.json is True
    ui = _UI(args.quiet, json_mode)
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
