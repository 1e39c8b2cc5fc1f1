"""Generator: sampling, stop ids, streaming text, and stats over a Session.

Runs at artifact-run time: imports neither transformers nor anything that unpickles.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace._errors import CacheOverflowError, UsageError
from kvtrace.runtime.session import Session

__all__ = ["GenerationResult", "GenerationStats", "Sampling", "generate", "sample"]


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k/top_p filter before sampling; seed makes it repeatable."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UsageError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:  # NaN fails this too
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    decode_seconds: float = 0.0
    peak_rss_mib: float = 0.0
    stop_reason: str = ""  # "eos", "max_new_tokens" or "max_seq_len"

    @property
    def decode_tokens_per_s(self) -> float:
        # the first new token comes from prefill; decode produced the rest
        n = max(self.new_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def line(self) -> str:
        return (
            f"{self.prompt_tokens} prompt tokens, prefill {self.prefill_ms:.1f} ms, "
            f"{self.new_tokens} new tokens, decode {self.decode_tokens_per_s:.1f} tokens/s, "
            f"peak RSS {self.peak_rss_mib:.0f} MiB, stop: {self.stop_reason}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "peak_rss_mib": round(self.peak_rss_mib, 1),
            "stop_reason": self.stop_reason,
        }


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)  # new tokens only (eos excluded)
    text: str = ""
    stats: GenerationStats = field(default_factory=GenerationStats)


def sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B, 1]."""
    if s.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / s.temperature
    if s.top_k is not None:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > s.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)


class _TextStream:
    """Turns a growing token list into text deltas; holds back incomplete UTF-8 sequences."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._emitted = ""

    def push(self, tokens: list[int]) -> str:
        text = self._decode(tokens)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        delta = text[len(self._emitted):] if text.startswith(self._emitted) else text
        self._emitted = text
        return delta


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def generate(
    session: Session,
    prompt: Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int = 256,
    sampling: Sampling | None = None,
    eos_ids: Sequence[int] = (),
    decode_text: Callable[[list[int]], str] | None = None,
    on_text: Callable[[str], None] | None = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
) -> GenerationResult:
    """Prefill ``prompt`` (batch 1) and decode until EOS, ``max_new_tokens`` or the cache is full.

    ``inputs``: named prefill inputs of the artifact, e.g. ``{"cross_attention_states": x}`` for a vision decoder.
    """
    sampling = sampling or Sampling()
    ids = torch.as_tensor(prompt, dtype=torch.int64).reshape(1, -1)  # [1, T]
    if ids.shape[1] == 0:
        raise UsageError("the prompt is empty; give at least one token of text")
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    room = session.spec.max_seq_len - session.position
    if ids.shape[1] > room:
        raise CacheOverflowError(
            f"the prompt has {ids.shape[1]} tokens but only {room} of max_seq_len={session.spec.max_seq_len} "
            "cache slots are free; shorten the prompt or export with a larger --max-seq-len"
        )
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    stream = _TextStream(decode_text) if decode_text is not None else None
    result = GenerationResult()
    st = result.stats
    st.prompt_tokens = ids.shape[1]
    eos = set(eos_ids)

    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = session.prefill(ids, **(inputs or {}))[:, -1]  # [1, V]
        st.prefill_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        while True:
            tok = sample(logits, sampling, gen)  # [1, 1]
            t = int(tok)
            if t in eos:
                st.stop_reason = "eos"
                break
            result.tokens.append(t)
            st.new_tokens += 1
            if stream is not None and on_text is not None:
                delta = stream.push(result.tokens)
                if delta:
                    on_text(delta)
            if st.new_tokens >= max_new_tokens:
                st.stop_reason = "max_new_tokens"
                break
            if session.position >= session.spec.max_seq_len:
                st.stop_reason = "max_seq_len"
                break
            logits = session.decode(tok)[:, -1]
        st.decode_seconds = time.perf_counter() - t1
    st.peak_rss_mib = _peak_rss_mib()
    if decode_text is not None:
        result.text = decode_text(result.tokens)
    return result
