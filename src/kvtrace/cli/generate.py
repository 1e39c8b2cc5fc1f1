"""``kvtrace generate``: stream an answer from a model, compiled once and cached; the prompt and
generation helpers ``kvtrace run`` shares."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from kvtrace._errors import UsageError
from kvtrace.cli.args import POSITIVE, cuda_graphs_arg, device_arg, kv_dtype_arg, quant_args, sampling_args
from kvtrace.cli.ui import UI


def read_prompt(prompt: str | None) -> str:
    if prompt == "-":
        prompt = sys.stdin.read()
    if prompt is None or not prompt.strip():
        raise UsageError("the prompt is empty; pass text, or - to read it from stdin")
    return prompt


def encode(art: Any, text: str, chat: bool) -> list[int]:
    from kvtrace.sources.chat import encode_prompt

    tok = art.tokenizer()
    if tok is None:
        raise UsageError(f"{art.path} has no tokenizer; export it from a model source that has one")
    m = art.manifest
    return encode_prompt(tok, text, chat=chat, template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids)


def check_cuda_graphs(art: Any, args: argparse.Namespace) -> None:
    """--cuda-graphs on an artifact that runs on the CPU: refused before any prompt is read or encoded."""
    if getattr(args, "cuda_graphs", False) and art.device.type != "cuda":
        raise UsageError(f"--cuda-graphs needs an artifact running on a CUDA device; {art.path.name} runs on "
                         f"{art.device} (export it with --device cuda, or drop --cuda-graphs)")


def generate_text(ui: UI, art: Any, prompt: str, args: argparse.Namespace, max_new: int) -> dict[str, Any]:
    from kvtrace.runtime.generate import Sampling, generate

    ids = encode(art, prompt, args.chat)
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

    inputs = image_inputs(art, getattr(args, "image_features", None))
    res = generate(art.session(cuda_graphs=getattr(args, "cuda_graphs", False)), ids, max_new_tokens=min(max_new, room), sampling=sampling, inputs=inputs,
                   eos_ids=art.manifest.eos_ids, decode_text=lambda t: tok.decode(t, skip_special_tokens=True),
                   on_text=on_text)
    if not ui.json_mode:
        sys.stdout.write("\n")
    ui.info(f"[dim]{res.stats.line()}[/dim]")
    return {"text": res.text, "tokens": res.tokens, **res.stats.to_dict()}


def image_inputs(art: Any, path: str | None) -> dict[str, Any]:
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


def cmd_generate(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.artifact.store import cached_artifact

    prompt = read_prompt(args.prompt)
    t0 = time.perf_counter()
    # loads (and so checks) the artifact too; a cached one that fails its integrity check is rebuilt
    built = cached_artifact(args.model, backend=args.backend, max_seq_len=args.max_seq_len, dtype=args.dtype,
                            progress=ui.step, load=True, notice=ui.notice, kv_dtype=args.kv_dtype,
                            device=args.device, quant=args.quant, quant_group_size=args.quant_group_size,
                            quant_head=args.quant_head)
    art = built.artifact
    check_cuda_graphs(art, args)
    load_s = time.perf_counter() - t0
    ui.info(f"[dim]{'cache hit' if built.cache_hit else f'compiled in {built.seconds:.1f}s'}: {built.path}[/dim]")
    out = generate_text(ui, art, prompt, args, args.max_new_tokens)
    out.update(load_s=round(load_s, 2), compile_s=round(built.seconds, 2), cache_hit=built.cache_hit)
    ui.info(f"[dim]load {load_s:.1f}s ({'cache hit' if built.cache_hit else f'compile {built.seconds:.1f}s'})[/dim]")
    if ui.json_mode:
        print(json.dumps(out))
    return 0


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace generate`` to the parser (``add(name, help)`` makes the subparser)."""
    from kvtrace.backends import registry

    p = add("generate", "Stream an answer from a model (default: the embedded SmolLM2-135M-Instruct), compiled.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text, or - for stdin")
    p.add_argument("--model", default=None, help="smollm2-135m-instruct (default), a HF model dir, or a GGUF file")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=256)
    p.add_argument("--backend", choices=sorted(registry.names()), default="aoti")
    p.add_argument("--max-seq-len", type=POSITIVE, default=1024)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    kv_dtype_arg(p)
    quant_args(p)
    sampling_args(p)
    device_arg(p)
    cuda_graphs_arg(p)
    p.set_defaults(func=cmd_generate)

