"""Prompt-lookup speculative decoding: draft tokens from the text itself, verify them in one program call.

Batch-1 decode reads every weight once per token, and a program call over a few tokens reads them once too:
on a CPU or GPU bound by memory bandwidth, checking 4 guessed tokens costs little more than decoding one.
Where the answer repeats its context (a rewrite, an edit, a summary quoting its source, code), the next tokens
are often the ones that followed the same few tokens earlier: ``NgramDrafter`` proposes them (prompt lookup
decoding; vLLM's ``ngram`` speculator, HF's ``prompt_lookup_num_tokens``). No second model.

One step of ``Generation`` with ``speculate=k`` (``runtime.generate``): with ``tok`` the last sampled token (not
yet in the cache, at position ``p``) and ``d <= k`` drafted tokens,

* ``logits = session.prefill([tok, *draft])``: positions ``p .. p+d``, logits ``[1, 1+d, V]`` (the artifact's
  prefill must return every position's: ``prefill_logits="all"``);
* ``y_i = sample(logits[:, i])`` in order, each through the same sampling and penalties as a plain decode
  step; ``y_i`` is emitted, and the next position is looked at only while ``y_i == draft[i]`` (then the cache
  already holds the token ``y_i`` at ``p+i+1``);
* the first ``y_i != draft[i]`` (or a stop) ends the step. The session is rewound to ``tok`` and the tokens are
  yielded one at a time, each accepted draft slot taken back (``Session._replay``: the call wrote it) before
  the token after it: at every yield the session holds the tokens before the one yielded, as in a plain
  generation. ``y_i`` becomes ``tok``.

Every emitted token is sampled from the model's own distribution given the tokens before it, so a sampled
generation has the distribution of a plain one (a draft token is accepted exactly when the sample equals it),
and a greedy one the same tokens, up to the rounding differences between the prefill and the decode
program: where the top two logits are that close, a speculative greedy answer can leave the plain one.

Drafts are capped so that every rejected token can be rewound (``Session.rewind``: a sliding-window ring past its
window keeps too little to drop more than ``KindOps.max_rewind`` allows), by the cache's free slots and by the
tokens still wanted.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from kvtrace._errors import UsageError

__all__ = ["NgramDrafter", "Pace", "check_session", "draft_room"]

MAX_DRAFT = 16  # more draft tokens than this verify in a call that costs more than the decode steps it could save
MIN_NGRAM = 2  # a draft needs the last 2 tokens to have occurred before: 1-token matches ("the") mostly miss
PROBE_SHARE = 0.1  # after drafting stopped paying: the most of the decode time spent trying it again
EMA = 0.3  # weight of the newest call in Pace's running means


class NgramDrafter:
    """Proposes the tokens that followed the most recent earlier occurrence of the history's last ``n`` tokens
    (``n`` from ``max_ngram`` down to ``min_ngram``; the longest match wins). ``extend`` the history with every
    token the generation holds (prompt, then each emitted token); each n-gram's latest start is indexed as it
    comes, so a proposal costs ``O(max_ngram)``."""

    def __init__(self, k: int, *, max_ngram: int = 3, min_ngram: int = MIN_NGRAM):
        try:  # ints and int-like objects only; never 2.0 or True
            if isinstance(k, bool):
                raise TypeError
            k = operator.index(k)
        except TypeError:
            raise UsageError(f"speculate takes a whole number of draft tokens; got {type(k).__name__} {k!r}") from None
        if not 1 <= k <= MAX_DRAFT:
            raise UsageError(f"speculate takes 1 .. {MAX_DRAFT} draft tokens; got {k}")
        if not 1 <= min_ngram <= max_ngram:
            raise UsageError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram; got {min_ngram}, {max_ngram}")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self.tokens: list[int] = []
        # n-gram -> the position right after its latest occurrence that is followed by at least one token
        self._after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1  # the n-grams ending just before this token are now followed by it
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._after[tuple(self.tokens[end - n : end])] = end

    def propose(self, most: int | None = None, after: Sequence[int] = ()) -> list[int]:
        """Up to ``min(k, most)`` tokens to try next (empty when the history's tail never occurred before);
        ``after``: tokens taken to follow the history first (e.g. a draft's start that a grammar forces), not
        indexed."""
        most = self.k if most is None else min(self.k, most)
        if most <= 0:
            return []
        tail = [*self.tokens[-self.max_ngram :], *after] if after else self.tokens
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tail) < n:
                continue
            at = self._after.get(tuple(tail[-n:]))  # an earlier occurrence: the tail's own is not indexed
            if at is not None:
                return self.tokens[at : at + most]
        return []


class Pace:
    """Whether drafting pays, and how long a draft to try, measured as the generation runs: running means of a
    decode step's seconds, a verify call's seconds and the tokens a verify call yields (accepted + 1).

    Drafting pays while a verify call yields more tokens per second than a decode step (``worth``). A verify call
    is a prefill program over ``1 + d`` tokens; where that program is much slower than the decode one (measured
    on the default model, 2 threads, stop 52: 3-5x a decode step in float32 ``aoti``, 13-28x for GGUF blocks,
    whose prefill dequantizes every weight; 1.2-2x for int8 on ``aoti-packed`` up to 5 tokens, 5x at 9) only
    long accepted runs pay for it. Once drafting stops paying, it is tried again when the decode steps since
    have taken ``1 / PROBE_SHARE`` times a verify call: the text may have moved to a part that repeats its
    context, and the probes cost at most ``PROBE_SHARE`` of the time. ``draft_len`` caps a draft near the runs
    accepted lately (a longer call costs more where few of its tokens will be kept)."""

    def __init__(self) -> None:
        self.decode_s: float | None = None
        self.verify_s: float | None = None
        self.gain: float | None = None  # tokens a verify call yields (accepted + 1)
        self._waited = 0.0  # decode seconds since drafting last stopped paying

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else (1 - EMA) * old + EMA * new

    def decoded(self, seconds: float) -> None:
        self.decode_s = self._mean(self.decode_s, seconds)
        self._waited += seconds

    def verified(self, seconds: float, tokens: int) -> None:
        self.verify_s = self._mean(self.verify_s, seconds)
        self.gain = self._mean(self.gain, float(tokens))

    def worth(self) -> bool:
        """Whether the next step should verify a draft (if one is proposed) rather than decode one token."""
        if self.verify_s is None or self.gain is None:
            return True  # measure a verify call first,
        if self.decode_s is None:
            return False  # then a decode step
        if self.gain / self.verify_s >= 1 / self.decode_s:
            self._waited = 0.0
            return True
        if self._waited * PROBE_SHARE >= self.verify_s:
            self._waited = 0.0
            return True
        return False

    def draft_len(self, k: int) -> int:
        """The most draft tokens to try next: k until measured, then about one more than the mean yield."""
        return k if self.gain is None else max(1, min(k, math.ceil(self.gain) + 1))


def check_session(session: Any) -> None:
    """UsageError unless ``session`` can verify drafts: every position's prefill logits, a cache ``rewind`` can
    take back (no extra state), one sequence."""
    if session.prefill_logits != "all":
        raise UsageError("speculative decoding verifies its draft tokens in one prefill call and needs every "
                         "position's logits; this artifact's prefill returns the last position's only: export it "
                         "with --prefill-logits all (kvtrace.export(..., prefill_logits=\"all\"))")
    if session.spec.extra:
        raise UsageError(f"speculative decoding rewinds rejected draft tokens; this cache has extra state "
                         f"{[b.name for b in session.spec.extra]} that rewind cannot take back: generate without "
                         "speculating")
    if session.spec.batch_size != 1:
        raise UsageError(f"speculative decoding runs one sequence; this artifact has batch {session.spec.batch_size}")


def draft_room(session: Any, wanted: int) -> int:
    """How many draft tokens a call at the session's position may carry: at most ``wanted``, what the cache
    has room for besides the last sampled token, and what every layer could rewind after the call (the rule
    ``Session.rewind`` applies, ``Session._kept``)."""
    spec = session.spec
    d = min(wanted, spec.max_seq_len - session.position - 1)
    while d > 0 and any(session._kept(layer, after=d + 1) < d for layer in spec.layers):
        d -= 1
    return max(d, 0)
