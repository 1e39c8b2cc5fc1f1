"""``kvtrace serve``: an OpenAI-compatible HTTP server over an artifact's conversation slots."""

from __future__ import annotations

import argparse
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtrace._errors import UsageError
from kvtrace.cli.args import POSITIVE, huge_pages_arg, int_in, kv_dtype_arg
from kvtrace.cli.ui import UI
from kvtrace.serve import SERVE_BACKEND

DEFAULT_PARALLEL = 4  # conversation slots when serving a model source
DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per prefill call (see SlotEngine: chunked prefill)


def load_served(args: argparse.Namespace, ui: UI) -> Any:
    """The artifact to serve: a ``.kvt`` file as it is, or a model source exported (and cached) with
    ``--parallel`` slots (one slot: the plain artifact ``kvtrace generate`` uses, no extra compile)."""
    path = Path(args.model) if args.model is not None else None
    kv = getattr(args, "kv_dtype", "auto")  # --kv-dtype (a namespace built by hand may leave it out)
    if path is not None and path.is_file() and zipfile.is_zipfile(path):
        from kvtrace.artifact.archive import load

        with ui.step(f"loading {path}"):
            art = load(path, expected_sha256=args.expected_sha256, huge_pages=args.huge_pages)
        slots = art.cache_spec.batch_size if art.manifest.programs["prefill"].slots else 1
        if args.parallel is not None and args.parallel != slots:
            raise UsageError(f"{path} holds {slots} conversation slot(s), --parallel asks for {args.parallel}: export "
                             f"it with `kvtrace export SOURCE --slots {args.parallel}`, or pass the model source")
        if kv != "auto" and kv != art.cache_spec.kv_dtype:
            raise UsageError(f"{path} holds a {art.cache_spec.kv_dtype or art.cache_spec.dtype} KV cache, --kv-dtype "
                             f"asks for {kv}: export it with `kvtrace export SOURCE --slots {slots} --kv-dtype {kv}`, "
                             "or pass the model source")
        return art
    if args.expected_sha256 is not None:
        raise UsageError("--expected-sha256 checks an artifact file; the model given is a source, built here")
    from kvtrace.artifact.store import cached_artifact

    parallel = args.parallel or DEFAULT_PARALLEL
    built = cached_artifact(args.model, backend=args.backend, max_seq_len=args.max_seq_len or 1024,
                            dtype=args.dtype, slots=parallel if parallel > 1 else None, progress=ui.step, load=True,
                            notice=ui.notice, huge_pages=args.huge_pages,
                            kv_dtype=None if kv == "auto" else kv)
    ui.info(f"[dim]{'cache hit' if built.cache_hit else f'compiled in {built.seconds:.1f}s'}: {built.path}[/dim]")
    return built.artifact


def cmd_serve(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.serve.app import app_for, serve

    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        ui.notice(f"listening on {args.host} without --api-key: anyone who can reach this port can use the model")
    art = load_served(args, ui)
    max_seq = args.max_seq_len
    if max_seq is not None and max_seq > art.cache_spec.max_seq_len:
        raise UsageError(f"--max-seq-len {max_seq} is more than {art.path.name}'s cache holds "
                         f"({art.cache_spec.max_seq_len}); lower it or re-export with a larger --max-seq-len")
    app = app_for(art, max_seq_len=max_seq, api_key=args.api_key, max_queue=args.queue,
                  prefill_chunk=args.prefill_chunk or None)
    engine = app.state.engine
    if art.cache_spec.kv_dtype is not None and engine.n_slots > 1:
        ui.notice(f"{art.cache_spec.kv_dtype} KV cache: a conversation decoded beside others can leave the answer it "
                  "gets alone where two tokens nearly tie (a value on a rounding edge is stored one step apart when "
                  "the batch changes the matmul's last bits; bench/batch_divergence.py measures it)")

    def ready(url: str) -> None:
        ui.notice(f"serving {art.manifest.model_name or art.path.stem} on {url}/v1 (OpenAI API): "
                  f"{engine.n_slots} conversation slot(s), max_seq_len {engine.max_seq_len}"
                  f"{f', {art.cache_spec.kv_dtype} KV cache' if art.cache_spec.kv_dtype else ''}, prompts prefilled "
                  f"{f'{engine.prefill_chunk} tokens per step' if engine.prefill_chunk else 'whole'}, backend "
                  f"{art.manifest.backend}; Ctrl-C stops")

    serve(app, host=args.host, port=args.port, log_level="info" if args.debug else "warning", on_ready=ready)
    return 0


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace serve`` to the parser (``add(name, help)`` makes the subparser)."""
    from kvtrace.backends import registry

    p = add("serve", "Serve a model over an OpenAI-compatible HTTP API, many conversations batched.", json_flag=True)
    p.add_argument("model", nargs="?", default=None,
                   help="an artifact (.kvt, exported with --slots N for N parallel conversations), or a model source "
                        "(smollm2-135m-instruct, the default; a HF dir; a GGUF file), exported and cached")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000)
    p.add_argument("--parallel", type=int_in(1, 256), default=None, metavar="N",
                   help=f"conversation slots decoded together (a source: default {DEFAULT_PARALLEL}; an artifact: "
                        "its own)")
    p.add_argument("--max-seq-len", type=POSITIVE, default=None,
                   help="tokens per conversation, prompt and answer (a source: its cache, default 1024; an artifact: "
                        "at most its cache)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--queue", type=int_in(0), default=64, metavar="N",
                   help="requests that may wait for a slot; more get HTTP 429 (default 64)")
    p.add_argument("--prefill-chunk", type=int_in(0), default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help="prefill long prompts N tokens at a time between decode steps, so other conversations keep "
                        f"streaming (default {DEFAULT_PREFILL_CHUNK}; 0: whole prompts)")
    p.add_argument("--backend", choices=sorted(registry.names()), default=SERVE_BACKEND,
                   help=f"for a model source (default {SERVE_BACKEND}: one frozen program whose CPU matmuls stay fast "
                        "from 1 to N rows; aoti compiles faster)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="for a model source")
    kv_dtype_arg(p)  # for a model source; an artifact keeps its own (a different one asked for is refused)
    p.add_argument("--expected-sha256", default=None, metavar="HEX",
                   help="refuse the artifact unless the whole file has this SHA-256")
    huge_pages_arg(p)
    p.set_defaults(func=cmd_serve)
