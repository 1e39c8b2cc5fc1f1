"""``kvtrace serve``: an OpenAI-compatible HTTP server over an artifact's conversation slots."""

from __future__ import annotations

import argparse
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtrace._errors import UsageError
from kvtrace.cli.args import POSITIVE, huge_pages_arg, int_in, kv_dtype_arg, quant_args
from kvtrace.cli.ui import UI
from kvtrace.serve import GGUF_SERVE_BACKEND, SERVE_BACKEND

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
        quant = getattr(args, "quant", "none")
        has = art.manifest.quant.scheme if art.manifest.quant is not None else "none"
        if quant != "none" and quant != has:
            raise UsageError(f"{path} holds {has if has != 'none' else 'unquantized'} weights, --quant asks for "
                             f"{quant}: export it with `kvtrace export SOURCE --slots {slots} --quant {quant}`, or "
                             "pass the model source")
        if kv != "auto" and kv != art.cache_spec.kv_dtype:
            raise UsageError(f"{path} holds a {art.cache_spec.kv_dtype or art.cache_spec.dtype} KV cache, --kv-dtype "
                             f"asks for {kv}: export it with `kvtrace export SOURCE --slots {slots} --kv-dtype {kv}`, "
                             "or pass the model source")
        return art
    if args.expected_sha256 is not None:
        raise UsageError("--expected-sha256 checks an artifact file; the model given is a source, built here")
    from kvtrace.artifact.store import cached_artifact

    parallel = args.parallel or DEFAULT_PARALLEL
    quant = {k: getattr(args, k) for k in ("quant", "quant_group_size", "quant_head") if hasattr(args, k)}
    if quant.get("quant") == "none":
        quant = {}
    backend = args.backend or (GGUF_SERVE_BACKEND if quant.get("quant") == "gguf" else SERVE_BACKEND)
    built = cached_artifact(args.model, backend=backend, max_seq_len=args.max_seq_len or 1024,
                            dtype=args.dtype, slots=parallel if parallel > 1 else None, progress=ui.step, load=True,
                            notice=ui.notice, huge_pages=args.huge_pages,
                            kv_dtype=None if kv == "auto" else kv, **quant)
    ui.info(f"[dim]{'cache hit' if built.cache_hit else f'compiled in {built.seconds:.1f}s'}: {built.path}[/dim]")
    return built.artifact


def rounding_steps(art: Any) -> list[str]:
    """What rounds at run time in ``art``'s programs (an int8 KV cache, weights computed with bfloat16 or int8
    activations): where batched answers may leave solo ones. Float32 caches and GGUF blocks (float32
    activations) have no such step."""
    why = []
    if art.cache_spec.kv_dtype is not None:
        why.append(f"{art.cache_spec.kv_dtype} KV cache")
    q = art.manifest.quant
    if q is not None and q.activations != "float32":
        why.append(f"{q.scheme} weights with {q.activations} activations")
    return why


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
                  prefill_chunk=args.prefill_chunk or None, prefix_cache=args.prefix_cache)
    engine = app.state.engine
    why = rounding_steps(art)
    if why:
        ui.notice(f"{' and '.join(why)}: an answer can leave the one `kvtrace run` gives where two tokens nearly tie, "
                  "as calls of other shapes (rows decoded together, prompts prefilled in chunks or after a prefix "
                  "a slot held) round otherwise than a one-conversation program's (bench/batch_divergence.py "
                  "measures it)")

    def ready(url: str) -> None:
        ui.notice(f"serving {art.manifest.model_name or art.path.stem} on {url}/v1 (OpenAI API): "
                  f"{engine.n_slots} conversation slot(s), max_seq_len {engine.max_seq_len}"
                  f"{f', {art.cache_spec.kv_dtype} KV cache' if art.cache_spec.kv_dtype else ''}, prompts prefilled "
                  f"{f'{engine.prefill_chunk} tokens per step' if engine.prefill_chunk else 'whole'}"
                  f"{' after the prefix a slot holds' if engine.prefix_cache else ''}, backend "
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
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="reset a slot when its request ends (default: keep it, and prefill a later prompt that begins "
                        "alike, a chat's next turn, only after the prefix it holds)")
    p.add_argument("--backend", choices=sorted(registry.names()), default=None,
                   help=f"for a model source (default {SERVE_BACKEND}: one frozen program whose CPU matmuls stay fast "
                        f"from 1 to N rows; aoti compiles faster; --quant gguf: {GGUF_SERVE_BACKEND}, whose decode "
                        "program of one token a row reads the GGUF blocks once a row)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="for a model source")
    kv_dtype_arg(p)  # for a model source; an artifact keeps its own (a different one asked for is refused)
    quant_args(p)  # likewise
    p.add_argument("--expected-sha256", default=None, metavar="HEX",
                   help="refuse the artifact unless the whole file has this SHA-256")
    huge_pages_arg(p)
    p.set_defaults(func=cmd_serve)
