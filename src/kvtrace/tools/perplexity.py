"""perplexity: how well each runner predicts a text, and how far its predictions stray from the reference's.

``verify`` asks "is this program the same computation?", step by step, with tolerances. A quantized program
is not meant to be the same computation: what a user deploying int8/int4 weights or an int8 KV cache wants
to know is what it costs in quality. This answers it the way llama.cpp's ``llama-perplexity`` does, so the
numbers compare with theirs:

* the text's tokens are cut into ``chunks`` of ``ctx`` tokens (a last partial chunk is dropped); where the
  tokenizer adds a BOS token, each chunk's first token is replaced by it;
* each chunk is one prefill from an empty cache (``reset()`` first), every position's logits ``[1, ctx, V]``;
* positions ``ctx // 2 .. ctx - 2`` are scored, each predicting the token after it: every scored token has
  at least ``ctx / 2`` tokens of context (the first half only gives context), so ``ctx - 1 - ctx // 2``
  tokens per chunk.

Per runner: the mean negative log-likelihood of the scored tokens, ``ppl = exp(nll)`` and its standard error
(``ppl * std(nll) / sqrt(n)``, llama.cpp's ±). Per runner other than the reference (the first), against the
reference's predictions at the same positions: the KL divergence ``KL(reference || runner)`` of the two
next-token distributions (mean, 99th percentile, max; nats) and the fraction of positions whose most likely
token is the same. Everything is computed in float32 from the runners' logits; a runner's prefill time is
summed (its tokens per second of prefill).

The runners are those of ``verify`` (``tools.runners``): an ``EagerRunner`` (the HF model) or a
``SessionRunner`` over an artifact exported with ``prefill_logits="all"`` (an artifact whose prefill returns
the last position's logits only is refused: it cannot be scored).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvtrace._errors import UsageError

__all__ = ["PerplexityReport", "PerplexityRow", "chunk_tokens", "perplexity", "scored_per_chunk"]

MIN_CTX = 4  # scores at least one token per chunk: ctx - 1 - ctx // 2 >= 1


@dataclass(frozen=True)
class PerplexityRow:
    """One runner's numbers over every scored token. ``kl_*`` and ``top1_agree`` are None for the reference."""

    name: str
    tokens: int  # scored tokens (chunks x scored_per_chunk(ctx))
    nll: float  # mean negative log-likelihood, nats
    ppl: float  # exp(nll)
    ppl_err: float  # ppl x the standard error of the mean nll
    prefill_tok_s: float  # chunk tokens (all of them, not only the scored) per second of prefill
    kl_mean: float | None = None  # KL(reference || this), nats, mean over scored positions
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_agree: float | None = None  # fraction of scored positions whose argmax equals the reference's


@dataclass(frozen=True)
class PerplexityReport:
    """The rows (the reference first) and how the text was scored."""

    rows: tuple[PerplexityRow, ...]
    ctx: int
    chunks: int
    text_tokens: int  # tokens in the whole text (the chunks use chunks x ctx of them)
    bos_id: int | None  # the token each chunk starts with, where the tokenizer adds one
    text: str = ""  # where the text came from (a file name), for the report

    @property
    def reference(self) -> PerplexityRow:
        return self.rows[0]

    def exceeds(self, max_kl: float) -> list[str]:
        """The rows whose mean KL from the reference is above ``max_kl`` (or not finite), as one line each."""
        return [f"{r.name}: mean KL {'none' if r.kl_mean is None else f'{r.kl_mean:.4g}'} > {max_kl:g}"
                for r in self.rows[1:] if r.kl_mean is None or not r.kl_mean <= max_kl]

    def to_json(self) -> str:
        d = asdict(self)
        ref = self.reference.ppl
        for row in d["rows"]:
            row["ppl_vs_reference"] = row["ppl"] / ref if ref else None
        return json.dumps(d, indent=2)


def scored_per_chunk(ctx: int) -> int:
    """Tokens scored in one chunk of ``ctx``: positions ctx // 2 .. ctx - 2 each predict the next one."""
    return ctx - 1 - ctx // 2


def chunk_tokens(ids: Sequence[int], ctx: int, *, chunks: int | None = None,
                 bos_id: int | None = None) -> torch.Tensor:
    """The text's token ids cut into ``[N, ctx]`` chunks (a last partial chunk dropped; at most ``chunks``),
    each one's first token replaced by ``bos_id`` when given. Too short a text is a UsageError with both
    numbers."""
    if ctx < MIN_CTX:
        raise UsageError(f"the context must be at least {MIN_CTX} tokens (half of it is context, the rest scored); "
                         f"got {ctx}")
    if chunks is not None and chunks < 1:
        raise UsageError(f"chunks must be at least 1; got {chunks}")
    n = len(ids) // ctx
    if n == 0:
        raise UsageError(f"the text has {len(ids)} tokens; a context of {ctx} needs at least {ctx}: pass a longer "
                         "text or a smaller context (--ctx)")
    n = min(n, chunks) if chunks is not None else n
    out = torch.tensor(list(ids[: n * ctx]), dtype=torch.long).view(n, ctx)  # [N, ctx]
    if bos_id is not None:
        out[:, 0] = bos_id
    return out


def perplexity(runners: Sequence[Any], chunks: torch.Tensor, *, text_tokens: int | None = None,
               bos_id: int | None = None, text: str = "",
               progress: Callable[[int, int], None] | None = None) -> PerplexityReport:
    """Score ``chunks`` (``[N, ctx]``, from ``chunk_tokens``) with every runner; the first is the reference
    the others' KL divergence and top-1 agreement are measured against. ``progress(done, total)`` is called
    after each chunk."""
    if not runners:
        raise UsageError("perplexity needs at least one runner")
    if chunks.dim() != 2 or chunks.shape[1] < MIN_CTX:
        raise UsageError(f"chunks must be [N, ctx] token ids with ctx >= {MIN_CTX}; got shape {list(chunks.shape)}")
    for r in runners:
        _check_runner(r, chunks.shape[1])
    n, ctx = chunks.shape
    first = ctx // 2
    nll: list[list[torch.Tensor]] = [[] for _ in runners]  # per runner, per chunk: [scored]
    kl: list[list[torch.Tensor]] = [[] for _ in runners]
    agree = [0] * len(runners)
    seconds = [0.0] * len(runners)
    for c in range(n):
        ids = chunks[c : c + 1]  # [1, ctx]
        targets = chunks[c, first + 1 :]  # [scored]: the tokens the scored positions predict
        ref_logp = ref_top = None
        for i, r in enumerate(runners):
            r.reset()
            t0 = time.perf_counter()
            logits = r.prefill(ids)  # [1, ctx, V]
            if tuple(logits.shape[:2]) != (1, ctx):
                raise UsageError(f"{r.name}: prefill of [1, {ctx}] tokens returned logits {list(logits.shape)}; "
                                 f"expected [1, {ctx}, V] (every position's)")
            scored = logits[0, first : ctx - 1].float().cpu()  # [scored, V]; on a GPU, waits for the prefill
            seconds[i] += time.perf_counter() - t0
            logp = torch.log_softmax(scored, dim=-1)
            nll[i].append(-logp.gather(1, targets[:, None]).squeeze(1))
            if i == 0:
                ref_logp, ref_top = logp, logp.argmax(-1)
                continue
            if logp.shape[-1] != ref_logp.shape[-1]:
                raise UsageError(f"{r.name} predicts over {logp.shape[-1]} tokens, the reference "
                                 f"{runners[0].name} over {ref_logp.shape[-1]}: they are not the same model's")
            # KL(ref || r) per position: sum_v p_ref(v) (log p_ref(v) - log p_r(v))
            kl[i].append((ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0))
            agree[i] += int((logp.argmax(-1) == ref_top).sum())
        if progress is not None:
            progress(c + 1, n)
    rows = []
    for i, r in enumerate(runners):
        x = torch.cat(nll[i]).double()
        mean = float(x.mean())
        err = float(x.std() / math.sqrt(x.numel())) if x.numel() > 1 else 0.0
        ppl = math.exp(mean)
        extra: dict[str, float] = {}
        if i > 0:
            k = torch.cat(kl[i]).double()
            extra = dict(kl_mean=float(k.mean()), kl_p99=float(torch.quantile(k, 0.99)), kl_max=float(k.max()),
                         top1_agree=agree[i] / k.numel())
        rows.append(PerplexityRow(r.name, tokens=x.numel(), nll=mean, ppl=ppl, ppl_err=ppl * err,
                                  prefill_tok_s=n * ctx / max(seconds[i], 1e-9), **extra))
    return PerplexityReport(tuple(rows), ctx=ctx, chunks=n, text_tokens=text_tokens if text_tokens is not None
                            else n * ctx, bos_id=bos_id, text=text)


def _check_runner(r: Any, ctx: int) -> None:
    """An artifact Session must return every position's logits and hold ``ctx`` tokens in one batch row."""
    session = getattr(r, "session", None)
    if session is None:
        return
    if r.prefill_logits != "all":
        raise UsageError(f"{r.name}: its prefill returns the last position's logits only (exported with "
                         "prefill_logits='last', what generation needs); perplexity scores every position: export "
                         "it with --prefill-logits all")
    spec = session.spec
    if spec.batch_size != 1:
        raise UsageError(f"{r.name} was exported for batch {spec.batch_size}; perplexity runs one chunk at a time: "
                         "export it with batch 1")
    if ctx > spec.max_seq_len:
        raise UsageError(f"{r.name} holds {spec.max_seq_len} tokens (max_seq_len) but a chunk is {ctx}: pass a "
                         f"context of at most {spec.max_seq_len}, or export with --max-seq-len {ctx}")


def render_markdown(report: PerplexityReport) -> str:
    """The report as a Markdown table, the reference first."""
    ref = report.reference
    head = (f"{report.chunks} chunks of {report.ctx} tokens ({ref.tokens} scored, each with at least "
            f"{report.ctx // 2} tokens of context) from {report.text or 'the text'} ({report.text_tokens} tokens); "
            f"KL and top-1 against {ref.name}\n\n")
    lines = ["| runner | ppl | vs ref | mean KL | KL p99 | KL max | same top-1 | prefill tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        kl = ("— | — | — | —" if r.kl_mean is None
              else f"{r.kl_mean:.5f} | {r.kl_p99:.4f} | {r.kl_max:.3f} | {r.top1_agree:.2%}")
        lines.append(f"| {r.name} | {r.ppl:.4f} ± {r.ppl_err:.4f} | {r.ppl / ref.ppl:.4f} | {kl} | "
                     f"{r.prefill_tok_s:.0f} |")
    return head + "\n".join(lines)


def text_ids(tokenizer: Any, text: str, bos_id: int | None) -> tuple[list[int], int | None]:
    """The text's token ids and the BOS each chunk starts with: where the tokenizer itself puts ``bos_id`` first
    when it adds special tokens (llama.cpp's ``add_bos``), the ids start with it, as llama.cpp tokenizes the
    text, and it is returned; else the ids without special tokens, and None."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    lead = tokenizer.encode("", add_special_tokens=True).ids
    if bos_id is not None and lead[:1] == [bos_id]:
        return [bos_id, *ids], bos_id
    return ids, None


def row_name(backend: str, quant: str, kv_dtype: str, dtype: str) -> str:
    """A candidate's name: its backend, then what differs from float32 weights and cache (e.g. "aoti-packed int8")."""
    return " ".join([backend, *([quant] if quant != "none" else []), *([f"kv {kv_dtype}"] if kv_dtype != "auto" else []),
                     *(["bf16"] if dtype == "bfloat16" else [])])


def run_cli_perplexity(args: Any, step: Any, backend_for: Callable[[str], str]) -> PerplexityReport:
    """What ``kvtrace perplexity`` runs: the reference (eager HF in float32, or the one artifact given as the
    model) and one artifact per ``--dtype`` x ``--quant`` x ``--kv-dtype`` choice (cached, exported with every
    position's logits), plus each ``--artifact``, over the chunks of ``--text``. The text is tokenized and
    chunked before anything is exported: a text too short for ``--ctx`` is refused at once. ``backend_for(quant)``:
    the backend of that weight scheme's artifacts (the CLI's ``--backend``, or its default for the scheme)."""
    from pathlib import Path

    from kvtrace.artifact.archive import load
    from kvtrace.tools.runners import EagerRunner, SessionRunner

    text = _read_text(args.text)
    for f in args.artifact:
        if not Path(f).is_file():
            raise UsageError(f"--artifact {f} does not exist; expected a file written by `kvtrace export`")
    model = str(args.model) if args.model is not None else None
    runners: list[Any] = []
    if model is not None and model.endswith((".kvt", ".pte")):  # an artifact alone: no eager reference
        with step(f"loading {model}"):
            art = load(model)
        tokenizer = art.tokenizer()
        if tokenizer is None:
            raise UsageError(f"{model} carries no tokenizer; pass the model source instead (perplexity tokenizes "
                             "the text with it)")
        ids, bos_id = text_ids(tokenizer, text, art.manifest.bos_id)
        chunks = chunk_tokens(ids, args.ctx, chunks=args.chunks, bos_id=bos_id)
        runners.append(SessionRunner(art.session(), Path(model).name))
    else:
        from kvtrace.sources.load import load_model

        with step(f"loading {model or 'the default model'} (the float32 reference)"):
            lm = load_model(model, dtype=torch.float32)
        ids, bos_id = text_ids(lm.tokenizer, text, lm.bos_id)
        chunks = chunk_tokens(ids, args.ctx, chunks=args.chunks, bos_id=bos_id)
        runners.append(EagerRunner(lm.model, name="eager fp32"))
        runners += _exported(args, model, step, backend_for)
    for f in args.artifact:
        with step(f"loading {f}"):
            runners.append(SessionRunner(load(f).session(), Path(f).name))
    where = "stdin" if args.text == "-" else Path(args.text).name
    with step(f"scoring {chunks.shape[0]} chunks of {args.ctx} tokens with {len(runners)} runner(s)"):
        with torch.inference_mode():
            return perplexity(runners, chunks, text_tokens=len(ids), bos_id=bos_id, text=where)


def _exported(args: Any, model: str | None, step: Any, backend_for: Callable[[str], str]) -> list[Any]:
    """One Session per --dtype x --quant x --kv-dtype choice, from the artifact cache (exported on a miss)."""
    from kvtrace.artifact.store import cached_artifact
    from kvtrace.tools.runners import SessionRunner

    out = []
    for dtype in args.dtype.split(","):
        for quant in args.quant.split(","):
            for kv in args.kv_dtype.split(","):
                backend = backend_for(quant)
                name = row_name(backend, quant, kv, dtype)
                with step(f"{name}: its artifact (every position's logits), from the cache or exported into it"):
                    built = cached_artifact(model, backend=backend, max_seq_len=args.ctx, dtype=dtype,
                                            prefill_logits="all", load=True, quant=None if quant == "none" else quant,
                                            kv_dtype=None if kv == "auto" else kv,
                                            quant_group_size=args.quant_group_size, quant_head=args.quant_head)
                out.append(SessionRunner(built.artifact.session(), name))
    return out


def _read_text(path: str) -> str:
    import sys
    from pathlib import Path

    if path == "-":
        return sys.stdin.read()
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--text {path} is not a file; expected a UTF-8 text file (or - for stdin)")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--text {path} is not UTF-8 text ({e.reason} at byte {e.start}); pass a UTF-8 file") from e
