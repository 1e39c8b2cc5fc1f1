"""Generator: sampling, stop ids, streaming text, and stats over a Session.

Runs at artifact-run time: imports neither transformers nor anything that unpickles.
"""

from __future__ import annotations

import math
import operator
import resource
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace._errors import CacheOverflowError, UsageError
from kvtrace.runtime.grammar import Grammar, GrammarState, checked_grammar
from kvtrace.runtime.session import Session

__all__ = ["Chunk", "Generation", "GenerationResult", "GenerationStats", "Penalties", "Sampling", "generate", "sample",
           "stream"]

MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's bounds)
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100] (OpenAI's bounds: -100 bans a token, 100 all but forces it)


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k/top_p filter before sampling; seed makes it repeatable.

    Penalties reshape the logits before any of that (greedy too), from what the generation holds so far
    (``Penalties``): ``repetition_penalty`` r (HF's and llama.cpp's; 1 = off) divides the logit of every token
    already in the prompt or the output by r where it is positive and multiplies it by r where it is negative;
    ``presence_penalty`` p and ``frequency_penalty`` f (OpenAI's, in [-2, 2]) subtract p from the logit of every
    token already in the output and f times the number of times it is there.

    ``logit_bias`` ((token id, bias), ...; OpenAI's, bias in [-100, 100]) adds each bias to its token's logit
    after the penalties (-100 in effect bans the token)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UsageError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UsageError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:  # NaN fails this too
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise UsageError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:  # NaN fails this too
                raise UsageError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {v}")
        bias = self.logit_bias
        if not isinstance(bias, (Mapping, tuple, list)):
            raise UsageError(f"logit_bias maps token ids to biases ({{id: bias}} or ((id, bias), ...)); got {bias!r}")
        pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias)
        for pair in pairs:
            tok, b = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (None, None)
            if isinstance(tok, bool) or not hasattr(tok, "__index__") or operator.index(tok) < 0:  # ints, numpy's too
                raise UsageError(f"logit_bias maps token ids (whole numbers >= 0) to biases; got {pair!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise UsageError(f"the logit bias of token {tok} must be a number in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {b!r}")
        # kept as pairs sorted by id (frozen, hashable; the largest id last)
        object.__setattr__(self, "logit_bias", tuple(sorted((operator.index(t), float(b)) for t, b in pairs)))
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise UsageError("logit_bias names a token id twice; give each token one bias")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (then sampling needs the generation's ``Penalties``)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class Penalties:
    """What ``Sampling``'s penalties read, for one generation: which tokens the prompt and the output hold
    (``seen [V]``) and how often the output holds each (``counts [V]``), on the logits' device (made at the first
    ``apply``, so nothing goes back to the host). ``add`` each sampled token."""

    def __init__(self, sampling: Sampling, prompt: Sequence[int] | torch.Tensor):
        self.sampling = sampling
        self._prompt = torch.as_tensor(prompt, dtype=torch.int64).reshape(-1)  # [P]
        self._counts: torch.Tensor | None = None  # [V] float32: the output's tokens
        self._seen: torch.Tensor | None = None  # [V] bool: the prompt's and the output's

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> penalized float32 logits [B, V] (every row by this generation's tokens)."""
        s, x = self.sampling, logits.float()
        if self._counts is None:
            self._counts = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
            self._seen = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
            self._seen[self._prompt.to(x.device)] = True
        if s.repetition_penalty != 1:
            r = s.repetition_penalty
            x = torch.where(self._seen, torch.where(x > 0, x / r, x * r), x)
        if s.frequency_penalty or s.presence_penalty:
            x = x - self._counts * s.frequency_penalty - (self._counts > 0).float() * s.presence_penalty
        return x

    def add(self, token: torch.Tensor | int) -> None:
        """Count a sampled ``token`` (an int or a [1, 1] tensor on the logits' device) as part of the output."""
        if self._counts is None:
            raise UsageError("Penalties.add before apply: apply the penalties to the first logits first")
        idx = torch.as_tensor(token, device=self._counts.device).reshape(-1)  # [1]
        self._counts.index_add_(0, idx, torch.ones(1, device=self._counts.device))
        self._seen[idx] = True


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    decode_seconds: float = 0.0
    peak_rss_mib: float = 0.0
    stop_reason: str = ""  # "eos", "max_new_tokens", "max_seq_len" or "grammar" (the constraint is complete)
    drafted: int = 0  # speculative decoding: draft tokens verified (runtime.speculate)
    accepted: int = 0  # ... and how many of them the model's own samples matched
    calls: int = 0  # speculative decoding: program calls after prefill (verify calls and decode steps)

    @property
    def decode_tokens_per_s(self) -> float:
        # the first new token comes from prefill; decode produced the rest
        n = max(self.new_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def line(self) -> str:
        spec = (f", speculation: {self.accepted} of {self.drafted} draft tokens accepted in {self.calls} calls"
                if self.drafted else "")
        return (
            f"{self.prompt_tokens} prompt tokens, prefill {self.prefill_ms:.1f} ms, "
            f"{self.new_tokens} new tokens, decode {self.decode_tokens_per_s:.1f} tokens/s, "
            f"peak RSS {self.peak_rss_mib:.0f} MiB, stop: {self.stop_reason}{spec}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "peak_rss_mib": round(self.peak_rss_mib, 1),
            "stop_reason": self.stop_reason,
            **({"drafted": self.drafted, "accepted": self.accepted, "calls": self.calls} if self.drafted else {}),
        }


@dataclass
class GenerationResult:
    tokens: list[int] = field(default_factory=list)  # new tokens only (eos excluded)
    text: str = ""
    stats: GenerationStats = field(default_factory=GenerationStats)


def sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None,
           penalties: Penalties | None = None, grammar: GrammarState | None = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B, 1]; ``penalties`` (needed where ``s.penalized``) first reshape them,
    then ``s.logit_bias``, then ``grammar`` (structured output, batch 1) forbids what its constraint does not
    allow next; both then count the token sampled (``Penalties.add``, ``GrammarState.advance``: the one place a
    generation's penalty and grammar states advance)."""
    if s.penalized and penalties is None:
        raise UsageError("this Sampling has penalties; pass the generation's Penalties to sample")
    if not s.penalized and not s.logit_bias and grammar is None:
        return _pick(logits, s, gen)
    x = penalties.apply(logits) if s.penalized else logits
    if s.logit_bias:
        x = _biased(x, s.logit_bias)
    tok = _pick(grammar.mask(x) if grammar is not None else x, s, gen)
    if s.penalized:
        penalties.add(tok)
    if grammar is not None:
        grammar.advance(int(tok))
    return tok


def _biased(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """logits [B, V] + each (token, bias) of ``bias`` -> float32 logits [B, V]."""
    v = logits.shape[-1]
    if bias[-1][0] >= v:  # sorted by id: the last is the largest
        raise UsageError(f"logit_bias names token id {bias[-1][0]}, outside the model's vocabulary [0, {v})")
    ids = torch.tensor([t for t, _ in bias], device=logits.device)  # [N]
    add = torch.tensor([b for _, b in bias], dtype=torch.float32, device=logits.device)  # [N]
    return logits.float().index_add(-1, ids, add.expand(logits.shape[0], -1))


def _pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """Greedy, or temperature / top-k / top-p sampling: logits [B, V] -> ids [B, 1]."""
    if s.temperature == 0:
        return logits.argmax(-1, keepdim=True)
    # shifted so the largest is 0 and kept at 0: a temperature so small it rounds to 0 in float32 (1e-300) then
    # sends the rest to -inf (greedy, its limit) instead of 0 / 0 = nan
    shifted = logits.float() - logits.float().max(-1, keepdim=True).values
    logits = torch.where(shifted == 0, 0.0, shifted / s.temperature)
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


@dataclass(frozen=True)
class Chunk:
    """One generated token and the text it completes (``""`` while a multi-byte character is still
    incomplete, or when no ``decode_text`` was given)."""

    token: int
    text: str


class Generation:
    """An iterator of :class:`Chunk` s, one per new token, decoding lazily: each ``next()`` runs one
    program step (the first one runs prefill). ``result`` holds the tokens, text and stats so far; it is
    final once the iterator is exhausted (``done``). Breaking out early leaves the session at the tokens
    generated so far.

    ``speculate=k`` (> 0): prompt-lookup speculative decoding (``runtime.speculate``): each step verifies up to
    k drafted tokens in one prefill call and yields every token it accepted, one chunk each; at each chunk the
    session holds the tokens before it, as in a plain generation (breaking out early leaves it there too).
    Needs an artifact whose prefill returns every position's logits.
    """

    def __init__(self, session: Session, prompt: Sequence[int] | torch.Tensor, *, max_new_tokens: int,
                 sampling: Sampling | None, eos_ids: Sequence[int],
                 decode_text: Callable[[list[int]], str] | None, inputs: Mapping[str, torch.Tensor] | None,
                 speculate: int = 0, draft_context: Sequence[int] = (), grammar: Grammar | None = None):
        self._sampling = sampling or Sampling()
        self._grammar = checked_grammar(grammar, eos_ids)
        self._drafter = _drafter(session, speculate)
        if self._drafter is not None:
            self._drafter.extend(draft_context)
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
        self.result = GenerationResult()
        self.result.stats.prompt_tokens = ids.shape[1]
        self.done = False
        self._decode_text = decode_text
        self._steps = self._run(session, ids, max_new_tokens, set(eos_ids), inputs or {})

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Chunk:
        try:
            return next(self._steps)
        except StopIteration:
            self.done = True
            raise

    def _run(self, session: Session, ids: torch.Tensor, max_new: int, eos: set[int],
             inputs: Mapping[str, torch.Tensor]) -> Iterator[Chunk]:
        s, res, st = self._sampling, self.result, self.result.stats
        # sampling runs where the logits are (the session's device): only the sampled id comes back to the host
        gen = torch.Generator(device=session.device).manual_seed(s.seed) if s.seed is not None else None
        pen = Penalties(s, ids) if s.penalized else None
        gs = self._grammar.start() if self._grammar is not None else None
        stream = _TextStream(self._decode_text) if self._decode_text is not None else None
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = session.prefill(ids, **inputs)[:, -1]  # [1, V]
        st.prefill_ms = (time.perf_counter() - t0) * 1e3
        decoding = 0.0  # seconds inside sample/decode; the caller's time between chunks is not counted
        t1 = time.perf_counter()
        if self._drafter is not None:
            self._drafter.extend(ids[0].tolist())
            steps = self._speculative(session, logits, max_new, eos, gen, pen, gs)
        else:
            steps = self._plain(session, logits, max_new, eos, gen, pen, gs)
        for t, stop in steps:
            if t is not None:
                res.tokens.append(t)
                st.new_tokens += 1
                text = stream.push(res.tokens) if stream is not None else ""
                decoding += time.perf_counter() - t1
                st.decode_seconds = decoding
                st.stop_reason = stop
                yield Chunk(t, text)
                t1 = time.perf_counter()
            if stop:
                st.stop_reason = stop
                break
        st.decode_seconds = decoding + (time.perf_counter() - t1)
        st.peak_rss_mib = _peak_rss_mib()
        if self._decode_text is not None:
            res.text = self._decode_text(res.tokens)

    def _stop(self, session: Session, max_new: int, n_new: int, gs: GrammarState | None = None) -> str:
        """Why the generation ends after its ``n_new``-th token (the session at the tokens before it), or ""."""
        return ("grammar" if gs is not None and gs.done
                else "max_new_tokens" if n_new >= max_new
                else "max_seq_len" if session.position >= session.spec.max_seq_len else "")

    def _plain(self, session: Session, logits: torch.Tensor, max_new: int, eos: set[int],
               gen: torch.Generator | None, pen: Penalties | None,
               gs: GrammarState | None) -> Iterator[tuple[int | None, str]]:
        """One token per program call: (token, why the generation stops after it, or ""); (None, "eos") at EOS.
        At each yield the session holds the tokens before the one yielded."""
        s = self._sampling
        n = 0
        while True:
            with torch.inference_mode():
                tok = sample(logits, s, gen, pen, gs)  # [1, 1]
            t = int(tok)
            if t in eos:
                yield None, "eos"
                return
            n += 1
            stop = self._stop(session, max_new, n, gs)
            yield t, stop
            if stop:
                return
            with torch.inference_mode():
                logits = session._decode_sampled(tok)[:, -1]  # tok [1, 1] stays on the device

    def _speculative(self, session: Session, logits: torch.Tensor, max_new: int, eos: set[int],
                     gen: torch.Generator | None, pen: Penalties | None,
                     gs: GrammarState | None) -> Iterator[tuple[int | None, str]]:
        """As ``_plain``, a verify call at a time: sample the call's rows in order while they confirm its draft
        (``rows[i]`` [1, V] predicts the token after ``tok`` and the first ``i`` draft tokens), rewind the session
        to ``tok``, then yield the tokens, taking back one accepted draft slot before each after the first
        (``Session._replay``): at each yield, as in ``_plain``, the session holds the tokens before it."""
        from kvtrace.runtime.speculate import Pace, draft_room

        s, st, drafter = self._sampling, self.result.stats, self._drafter
        assert drafter is not None
        pace = Pace()  # whether drafting pays on this artifact and this text, measured as it runs
        rows, draft, n = [logits], [], 0
        called: float | None = None  # when the last program call started (None: the prompt's prefill)
        while True:
            out: list[int] = []
            stop = ""
            with torch.inference_mode():
                for i, row in enumerate(rows):
                    tok = sample(row, s, gen, pen, gs)  # [1, 1]: row i's mask follows the i tokens before it
                    t = int(tok)  # on a GPU: waits for the call
                    if t in eos:
                        stop = "eos"
                        break
                    out.append(t)
                    if gs is not None and gs.done:
                        stop = "grammar"
                        break
                    if n + len(out) >= max_new:
                        stop = "max_new_tokens"
                        break
                    if i == len(draft) or t != draft[i]:
                        break
            if called is not None:  # the call and its sampling, before the consumer's time between chunks
                seconds = time.perf_counter() - called
                if draft:
                    pace.verified(seconds, len(out) + (stop == "eos"))
                else:
                    pace.decoded(seconds)
            st.accepted += min(len(out) - (stop != "eos"), len(draft))
            if draft:
                session.rewind(len(draft))  # to tok: the draft's slots stay written, for _replay
            for j, t in enumerate(out):
                if j:
                    session._replay(1)  # out[j - 1] == draft[j - 1]: its slot holds it
                n += 1
                last = j == len(out) - 1
                why = self._stop(session, max_new, n, gs) if last and stop != "eos" else ""
                yield t, why
                if why:
                    return
            if stop == "eos":
                if out:
                    session._replay(1)  # the last token before EOS was fed, as in _plain
                yield None, "eos"
                return
            drafter.extend(out)
            most = min(pace.draft_len(drafter.k), max_new - n - 1)
            # under a constraint, what it forces next (a JSON key, the punctuation around it) drafts first, then
            # prompt lookup from there
            forced = gs.forced()[:most] if gs is not None and most > 0 else []
            draft = forced + drafter.propose(most - len(forced), after=forced)
            if draft and pace.worth():  # a probe is spent only on a draft
                draft = draft[: draft_room(session, len(draft))]
            else:
                draft = []
            called = time.perf_counter()
            with torch.inference_mode():
                if draft:
                    call = torch.cat([tok, torch.tensor([draft], dtype=tok.dtype, device=tok.device)], dim=1)
                    got = session._prefill_sampled(call)  # [1, 1 + d, V]: tok at the session's position, then the draft
                    rows = [got[:, i] for i in range(got.shape[1])]
                    st.drafted += len(draft)
                else:
                    rows = [session._decode_sampled(tok)[:, -1]]
            st.calls += 1


def _drafter(session: Session, speculate: int) -> Any:
    """The NgramDrafter of a speculative generation (None for ``speculate=0``), once the session can verify
    drafts (``speculate.check_session``)."""
    if not speculate:
        return None
    from kvtrace.runtime.speculate import NgramDrafter, check_session

    drafter = NgramDrafter(speculate)
    check_session(session)
    return drafter


def stream(
    session: Session,
    prompt: Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int = 256,
    sampling: Sampling | None = None,
    eos_ids: Sequence[int] = (),
    decode_text: Callable[[list[int]], str] | None = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
    speculate: int = 0,
    draft_context: Sequence[int] = (),
    grammar: Grammar | None = None,
) -> Generation:
    """Like :func:`generate`, as an iterator of :class:`Chunk` s (``for c in stream(...): print(c.text)``).

    Arguments are checked here, before the first step; prefill runs on the first ``next()``.
    """
    return Generation(session, prompt, max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids,
                      decode_text=decode_text, inputs=inputs, speculate=speculate, draft_context=draft_context,
                      grammar=grammar)


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
    speculate: int = 0,
    grammar: Grammar | None = None,
) -> GenerationResult:
    """Prefill ``prompt`` (batch 1) and decode until EOS, ``max_new_tokens`` or the cache is full.

    ``inputs``: named prefill inputs of the artifact, e.g. ``{"cross_attention_states": x}`` for a vision decoder.
    ``on_text(delta)`` is called with each new piece of text (needs ``decode_text``); :func:`stream` is the
    same generation as an iterator. ``speculate=k``: prompt-lookup speculative decoding with up to k draft
    tokens per call (``runtime.speculate``; the artifact exported with ``prefill_logits="all"``).
    ``grammar``: structured output (``runtime.grammar``): every token sampled keeps the output within the
    constraint (a JSON schema, regex or grammar; ``artifact.grammar(kvtrace.Constraint.json_schema(...))``); the
    generation ends when the constraint is complete (stop reason "grammar") or at a stop id it allows.
    """
    g = stream(session, prompt, max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids,
               decode_text=decode_text, inputs=inputs, speculate=speculate, grammar=grammar)
    for chunk in g:
        if chunk.text and on_text is not None:
            on_text(chunk.text)
    return g.result
