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
from kvtrace.cli.args import (
    POSITIVE,
    backend_arg,
    chosen_backend,
    chosen_quant,
    constraint_args,
    constraint_of,
    cuda_graphs_arg,
    device_arg,
    huge_pages_arg,
    kv_dtype_arg,
    quant_args,
    sampling_args,
    sampling_of,
    speculate_arg,
    tiered_arg,
)
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


def generate_text(ui: UI, art: Any, prompt: str, args: argparse.Namespace, max_new: int,
                  tier: Any = None) -> dict[str, Any]:
    """Stream the answer to stdout. ``tier`` (an ``artifact.tiered.Tiered``): the session starts on its eager
    programs and switches to the compiled ones between two tokens once their background build lands."""
    from kvtrace.runtime.generate import stream

    ids = encode(art, prompt, args.chat)
    room = art.cache_spec.max_seq_len - len(ids)
    if room < 1:
        raise UsageError(
            f"the prompt is {len(ids)} tokens; the artifact's max_seq_len is {art.cache_spec.max_seq_len}. "
            "Shorten the prompt or export with a larger --max-seq-len"
        )
    tok = art.tokenizer()
    sampling = sampling_of(args)
    vocab = art.manifest.vocab_size
    if sampling.logit_bias and vocab is not None and sampling.logit_bias[-1][0] >= vocab:  # before the prefill
        raise UsageError(f"--logit-bias names token id {sampling.logit_bias[-1][0]}; this model's vocabulary is "
                         f"[0, {vocab}): give ids below {vocab}")
    inputs = image_inputs(art, getattr(args, "image_features", None))
    grammar = bind_grammar(art, getattr(args, "constraint", None))
    session = art.session(cuda_graphs=getattr(args, "cuda_graphs", False))
    gen = stream(session, ids, max_new_tokens=min(max_new, room), sampling=sampling, inputs=inputs,
                 eos_ids=art.manifest.eos_ids, decode_text=lambda t: tok.decode(t, skip_special_tokens=True),
                 speculate=getattr(args, "speculate", 0), grammar=grammar)
    switch = Switch(session.label)
    for chunk in gen:
        if chunk.text and not ui.json_mode:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        switch.token()
        if tier is not None and tier.poll(session):
            switch.now(session.label)
    switch.end()
    res = gen.result
    if not ui.json_mode:
        sys.stdout.write("\n")
    ui.info(f"[dim]{res.stats.line()}[/dim]")
    if switch.line():
        ui.info(f"[dim]{switch.line()}[/dim]")
    return {"text": res.text, "tokens": res.tokens, **res.stats.to_dict(), **switch.to_dict()}


def bind_grammar(art: Any, constraint: Any) -> Any:
    """``constraint`` (``constraint_of``'s) compiled for the artifact's tokenizer and stop ids, or None."""
    return None if constraint is None else art.grammar(constraint)


class Switch:
    """When a tiered session switched programs (between two tokens) and the decode speed on each side."""

    def __init__(self, label: str):
        self.before, self.after = label, ""
        self.n = 0  # tokens generated so far
        self.at: int | None = None  # the first token the new programs produced
        self._t = [time.perf_counter()]  # time of each token (the first one: prefill's)
        self._at_t = 0.0

    def token(self) -> None:
        self.n += 1
        self._t.append(time.perf_counter())

    def now(self, label: str) -> None:
        self.at, self.after = self.n + 1, label
        self._at_t = time.perf_counter()

    def end(self) -> None:
        self._end = time.perf_counter()

    def _speeds(self) -> tuple[float, float]:
        if self.at is None:
            return 0.0, 0.0
        before = (self.at - 2) / (self._t[self.at - 1] - self._t[1]) if self.at > 2 else 0.0  # decode steps only
        n_after = self.n - self.at + 1
        after = n_after / (self._t[-1] - self._at_t) if n_after > 0 else 0.0
        return before, after

    def line(self) -> str:
        if self.at is None:
            return ""
        if self.at == 1:
            return f"switched to {self.after} before this answer (compiled in the background)"
        before, after = self._speeds()
        return (f"switched to {self.after} at token {self.at} ({self.before} {before:.1f} tokens/s before, "
                f"{self.after} {after:.1f} after)")

    def to_dict(self) -> dict[str, Any]:
        before, after = self._speeds()
        return {"programs": self.after or self.before, **({"switched_at": self.at, "tokens_per_s_before": round(before, 2),
                "tokens_per_s_after": round(after, 2)} if self.at is not None else {})}


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


def open_model(args: argparse.Namespace, ui: UI, kv_dtype: str | None = None) -> tuple[Any, Any, float]:
    """(artifact, tier, compile seconds) for a model source: the cached artifact, else (tiered, the default)
    the eager programs with the build in the background (``tier``), else (``--no-tiered``) built now."""
    from kvtrace.artifact.store import cached_artifact

    device = getattr(args, "device", "cpu")
    args.quant = chosen_quant(args)  # "auto" resolved against the source and the other options
    args.backend = chosen_backend(args)
    quant = {k: getattr(args, k) for k in ("quant", "quant_group_size", "quant_head") if hasattr(args, k)}
    huge_pages = getattr(args, "huge_pages", False)
    # speculative decoding verifies drafts through prefill: every position's logits (an artifact of its own)
    logits = "all" if getattr(args, "speculate", 0) else "last"

    # the tiered start runs eager programs on the CPU and hands their cache to the compiled ones (copied into
    # an ExecuTorch program's own buffers): a GPU artifact (--device cuda) is built first
    if not args.tiered or str(device) != "cpu":
        built = cached_artifact(args.model, backend=args.backend, max_seq_len=args.max_seq_len, dtype=args.dtype,
                                progress=ui.step, load=True, notice=ui.notice, kv_dtype=kv_dtype, device=device,
                                huge_pages=huge_pages, prefill_logits=logits, **quant)
        ui.info(f"[dim]{'cache hit' if built.cache_hit else f'compiled in {built.seconds:.1f}s'}: {built.path}[/dim]")
        return built.artifact, None, built.seconds
    from kvtrace.artifact import tiered

    tier = tiered.start(args.model, backend=args.backend, max_seq_len=args.max_seq_len, dtype=args.dtype,
                        progress=ui.step, notice=ui.notice, kv_dtype=kv_dtype, huge_pages=huge_pages,
                        prefill_logits=logits, **quant)
    if tier.build is None:
        ui.info(f"[dim]cache hit: {tier.artifact.path}[/dim]")
    else:
        ui.info(f"[dim]no cached {args.backend} artifact yet: compiling it in the background (pid {tier.build.pid}, "
                f"nice {tiered.NICE}); answering with the eager decoder meanwhile[/dim]")
    return tier.artifact, tier, 0.0


def finish_build(ui: UI, tier: Any) -> dict[str, Any]:
    """After the answer: wait for a background build still running, so the next start is compiled
    (Ctrl-C skips it: the build is stopped and leaves nothing the cache would load)."""
    if tier is None or tier.build is None:
        return {}
    build = tier.build
    if build.running:
        try:
            with ui.live("") as update:
                while not build.wait(0.5):
                    update(f"background build: {build.phase} ({time.perf_counter() - build.started:.0f}s); "
                           "finishing it for the next run (Ctrl-C skips it)")
        except KeyboardInterrupt:
            tier.close()
            ui.notice("background build stopped; the next run starts it again")
    build.poll()
    if build.path is not None:
        ui.info(f"[dim]{tier.backend} artifact cached (built in {build.seconds:.1f}s in the background): "
                f"{build.path}[/dim]")
    elif build.error not in (None, "cancelled"):
        ui.notice(f"the background {tier.backend} build failed: {build.error}")
    error = tier.error or build.error
    return {"compile_s": build.seconds or 0.0, **({"build_error": error} if error else {})}


def cmd_generate(args: argparse.Namespace, ui: UI) -> int:
    prompt = read_prompt(args.prompt)
    args.constraint = constraint_of(args)  # a bad schema or pattern: refused before anything loads
    if getattr(args, "cuda_graphs", False) and str(args.device) == "cpu":  # before any model is read or compiled
        raise UsageError("--cuda-graphs needs --device cuda (decode replayed from CUDA graphs); drop it on the CPU")
    t0 = time.perf_counter()
    # loads (and so checks) the artifact too; a cached one that fails its integrity check is rebuilt
    art, tier, compile_s = open_model(args, ui, kv_dtype=args.kv_dtype)
    try:
        check_cuda_graphs(art, args)
        load_s = time.perf_counter() - t0
        out = generate_text(ui, art, prompt, args, args.max_new_tokens, tier=tier)
        if tier is not None and tier.error:
            ui.notice(f"{tier.error}; the answer ran on the eager decoder")
        out.update(load_s=round(load_s, 2), compile_s=round(compile_s, 2),
                   cache_hit=not compile_s and (tier is None or tier.build is None))
        out.update(finish_build(ui, tier))  # a background build's compile_s
    finally:
        if tier is not None:
            tier.close()
    ui.info(f"[dim]ready in {load_s:.1f}s[/dim]")
    if ui.json_mode:
        print(json.dumps(out))
    return 0


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace generate`` to the parser (``add(name, help)`` makes the subparser)."""

    p = add("generate", "Stream an answer from a model (default: the embedded SmolLM2-135M-Instruct), compiled.")
    p.add_argument("prompt", nargs="?", default=None, help="prompt text, or - for stdin")
    p.add_argument("--model", default=None, help="smollm2-135m-instruct (default), a HF model dir, or a GGUF file")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=256)
    backend_arg(p)
    p.add_argument("--max-seq-len", type=POSITIVE, default=1024)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    kv_dtype_arg(p)
    quant_args(p, auto=True)
    tiered_arg(p)
    sampling_args(p)
    constraint_args(p)
    speculate_arg(p, builds=True)
    device_arg(p)
    cuda_graphs_arg(p)
    huge_pages_arg(p)
    p.set_defaults(func=cmd_generate)

