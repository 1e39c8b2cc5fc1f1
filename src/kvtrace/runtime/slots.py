"""SlotEngine: many conversations at once over one batched cache (continuous batching).

The cache's B rows are conversation slots: an artifact exported with ``slots=N`` holds programs of
``ProgramSpec.slots`` (``models.step.SLOT_PROGRAMS``). ``admit`` prefills one request into a free slot
(``prefill`` with R = 1 row) and samples its first token; ``step`` decodes one token for every active slot
at once (``decode`` with R = the active rows, each at its own position), which reads the weights once for
all of them. Requests join and leave between steps.

Prefix cache (``prefix_cache=True``, the default): a freed slot keeps its row, and remembers the tokens whose
K/V it holds (the prompt and the output fed back, ``held``). A new request takes the free slot whose held tokens
share the longest reusable prefix with its prompt (``runtime.prefix.reusable``: at most all but one prompt
token; a sliding-window ring past its window only when the prompt extends all of it) and prefills only the
rest, at positions after that prefix: a chat client that sends the whole conversation each turn has only the
new turn prefilled, and prompts that open alike (a system prompt) share it. Without a reusable prefix it takes
an empty slot, else the one freed longest ago. The positions after a row's position hold an earlier
conversation's K/V, masked by position exactly as a rewound Session's are (the math of a chunked prefill whose
first chunk is the kept prefix). ``prefix_cache=False``: a slot is reset when it is freed (the positions it
wrote refilled with the declared initial value), so an idle engine's cache holds only initial values. Either
way a row on which a program failed is reset, never reused, and ``reset()`` clears every row.

Chunked prefill (``prefill_chunk=C``): ``admit`` only takes the slot; each ``step`` decodes the decoding slots,
then prefills at most C prompt tokens in all, oldest request first (a short prompt whole, a long one C
tokens at a time, at positions C, 2C, ... of its row) — so a long prompt pauses the other slots for one
chunk per step instead of its whole prefill. A request's first token comes from the step that prefills
the end of its prompt.

An artifact of the ordinary programs with batch 1 (a Session's prefill and decode) runs as an engine of one
slot; the program specs say which inputs each call takes (``ProgramSpec.spine``).

    engine = artifact.slot_engine()
    slot, first = engine.admit(SlotRequest(prompt_ids, max_tokens=64, sampling=Sampling(), stop_ids=eos))
    while engine.active:
        for event in engine.step(): ...          # SlotEvent(slot, token, text, finish)

Invariants:
- every position and slot index handed to a program is a tensor built here from host-side ints
  (``input_pos [R, T]``, ``key_pos [L]`` with L = the longest row's end, ``slots [R]``); nothing is read
  back from a tensor to decide a shape;
- a request is checked (prompt length and ``max_tokens`` against ``max_seq_len``, token ids against the
  vocabulary, stop strings needing text) before any slot is touched: a refused request changes nothing;
- rows never mix: row r reads and writes only cache row ``slots[r]``, at its own positions;
- a free row's ``held`` tokens are the ones its positions ``[0, len(held))`` were computed from (its last
  request's prompt and the output fed back); a free row holding none is at its initial values (a row a
  program failed on is reset, never reused);
- not thread-safe: one thread owns an engine (``kvtrace serve``'s model thread).
"""

from __future__ import annotations

import enum
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace._errors import CacheOverflowError, KvtraceError, UsageError
from kvtrace.runtime.generate import Penalties, Sampling, _TextStream, sample
from kvtrace.runtime.grammar import Grammar, checked_grammar
from kvtrace.runtime.prefix import reusable
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.program import ProgramSpec

__all__ = ["MAX_TOP_LOGPROBS", "FinishReason", "SlotEngine", "SlotEvent", "SlotRequest", "SlotSession", "StepStats",
           "TokenLogprobs"]

Program = Callable[..., torch.Tensor]
MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask log-probabilities of (OpenAI's bound)


class FinishReason(enum.StrEnum):
    """Why a request stopped. ``openai``: the API's finish_reason ("stop" or "length")."""

    EOS = "eos"  # a stop id (the model's end of turn), not part of the output
    STOP = "stop"  # a stop string appeared; the text ends before it
    MAX_TOKENS = "max_tokens"
    MAX_SEQ_LEN = "max_seq_len"  # the slot's cache is full
    CANCELLED = "cancelled"  # ``cancel`` (e.g. the client went away)
    GRAMMAR = "grammar"  # the request's constraint is complete (structured output): nothing more may follow
    ERROR = "error"  # this request alone failed (``SlotEvent.error`` says why; e.g. its grammar allowed no token)

    @property
    def openai(self) -> str:
        return "stop" if self in (FinishReason.EOS, FinishReason.STOP, FinishReason.GRAMMAR) else "length"


@dataclass(frozen=True)
class SlotRequest:
    """One generation: ``prompt`` token ids, at most ``max_tokens`` new tokens (None: until the slot's
    cache is full), per-request ``sampling`` (temperature, top_k, top_p, seed), ``stop_ids`` (e.g. the
    artifact's eos ids; the id itself is not output) and ``stop`` strings (the text ends before the first).
    ``logprobs``: None, or k in [0, MAX_TOP_LOGPROBS]: every event of a token carries its log-probability and
    the k most likely tokens' (``TokenLogprobs``). ``grammar``: structured output (``runtime.grammar``; bound with
    stop ids among ``stop_ids``): every token keeps the output within it; the request ends when it is complete."""

    prompt: Sequence[int]
    max_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    logprobs: int | None = None
    grammar: Grammar | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """The model's log-probabilities at one step: the log-softmax of its float32 logits, before temperature,
    top-k and top-p reshape them for sampling. ``logprob``: the sampled token's; ``top``: the k most likely
    tokens as (id, logprob), most likely first (ties: the lower id first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SlotEvent:
    """What one slot produced in one call: a new ``token`` (None when it finished without one: a stop id,
    or cancelled), the ``text`` it completes (held back while it may begin a stop string or end inside a
    multi-byte character), and ``finish`` once the request is done (its slot is then free). ``logprobs``: the
    token's, where the request asked for them."""

    slot: int
    token: int | None
    text: str
    finish: FinishReason | None = None
    logprobs: TokenLogprobs | None = None
    error: str = ""  # with FinishReason.ERROR: why this request failed (the others go on)


class _Active:
    """One admitted request's state: its position in its row, the token to feed next, its output."""

    def __init__(self, request: SlotRequest, limit: int, decode_text: Callable[[list[int]], str] | None, order: int,
                 cached: int = 0, written: int = 0):
        s = request.sampling
        self.request = request
        self.order = order  # admission order: the oldest still-prefilling request gets the next chunk
        self.limit = limit  # at most this many new tokens (max_tokens, or what the cache leaves)
        self.gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        self.penalties = Penalties(s, request.prompt) if s.penalized else None
        self.grammar = request.grammar.start() if request.grammar is not None else None
        # a plain argmax, batched over such rows
        self.greedy = s.temperature == 0 and self.penalties is None and self.grammar is None and not s.logit_bias
        self.stop_ids = frozenset(request.stop_ids)
        self.position = cached  # tokens in this slot's cache row (while prefilling: the prompt tokens in it; it
        # starts at the prefix the row already held, prefix cache)
        self.written = written  # cache positions written since the row was last reset (reset refills these)
        self.failed = False  # a program failed on this row: it is reset when freed, never reused
        self.last = -1  # the sampled token the next decode feeds
        self.tokens: list[int] = []
        self.stream = _TextStream(decode_text) if decode_text is not None else None
        self.text = ""  # all text so far
        self.sent = 0  # characters of it handed out in events

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is not in the cache yet (chunked prefill); no token sampled yet."""
        return self.position < len(self.request.prompt)


@dataclass(frozen=True)
class StepStats:
    """What the last ``admit`` or ``step`` ran: prompt tokens prefilled and the seconds it took, decode rows
    and their seconds (the server's prefill and decode metrics); ``cached_tokens``: for an ``admit``, the
    prompt tokens its slot's row already held (the prefix cache), which are not prefilled."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_rows: int = 0
    decode_seconds: float = 0.0
    cached_tokens: int = 0


class SlotEngine:
    """N conversation slots over one cache of N rows (see the module docstring).

    ``programs``: name -> (ProgramSpec, callable) holding ``prefill`` and ``decode``, both slots programs over
    ``spec`` (or, for a one-slot engine, the ordinary programs of a batch-1 artifact). ``max_seq_len``: the
    most tokens (prompt + completion) a slot holds, at most the cache's (default: the cache's).
    ``decode_text``: token ids -> text (the tokenizer's decode), needed for text and stop strings.
    ``prefill_chunk``: at most this many prompt tokens per prefill call (chunked prefill, see the module
    docstring); None: a whole prompt at once. ``prefix_cache``: freed slots keep their rows for requests whose
    prompts begin alike (see the module docstring); False: freed slots are reset.
    """

    def __init__(self, spec: CacheSpec, programs: Mapping[str, tuple[ProgramSpec, Program]], *,
                 vocab_size: int | None = None, max_seq_len: int | None = None,
                 decode_text: Callable[[list[int]], str] | None = None, device: str = "cpu",
                 prefill_chunk: int | None = None, prefix_cache: bool = True):
        (pre_spec, self._prefill), (dec_spec, self._decode) = programs["prefill"], programs["decode"]
        self._pre_spec, self._dec_spec = pre_spec, dec_spec
        if pre_spec.slots != dec_spec.slots or (not pre_spec.slots and spec.batch_size != 1):
            raise UsageError(
                f"this artifact's programs take {spec.batch_size} rows at shared positions (prefill slots="
                f"{pre_spec.slots}, decode slots={dec_spec.slots}); a SlotEngine needs slot programs (export with "
                "slots=N / --slots N) or a batch-1 artifact (one slot)")
        if pre_spec.slots and spec.extra:
            raise UsageError(f"slot programs over a cache with extra state {[b.name for b in spec.extra]} are not "
                             "supported; export without slots")
        if max_seq_len is not None and not (isinstance(max_seq_len, int) and 1 < max_seq_len <= spec.max_seq_len):
            raise UsageError(f"max_seq_len must be a whole number in [2, {spec.max_seq_len}] (the artifact's cache), "
                             f"got {max_seq_len!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                          or prefill_chunk < 1):
            raise UsageError(f"prefill_chunk must be a whole number >= 1 (prompt tokens per prefill call) or None, "
                             f"got {prefill_chunk!r}")
        self.spec = spec
        self.max_seq_len = max_seq_len or spec.max_seq_len
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = bool(prefix_cache) and not spec.extra  # shared extra state: never kept (runtime.prefix)
        self.last_step = StepStats()  # what the last admit / step ran
        self._admitted = 0
        self.n_slots = spec.batch_size
        self._vocab = vocab_size
        self._decode_text = decode_text
        self._device = torch.device(device)
        self._state = spec.allocate(device)  # [N, H_kv, S, D] per k/v buffer: row i is slot i
        self._inits = [b.init for b in spec.buffers()]
        self._slots: dict[int, _Active] = {}
        n = self.n_slots
        self._held: list[list[int]] = [[] for _ in range(n)]  # a free row's tokens, whose K/V it holds (prefix cache)
        self._written = [0] * n  # a free row's positions written since it was last reset
        self._freed = [0] * n  # when each slot was last freed (a count of releases): the oldest is taken first
        self._releases = 0

    # --- what is running ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int | None:
        """Token ids a request may hold: [0, vocab_size) (None: not checked)."""
        return self._vocab

    @property
    def active(self) -> tuple[int, ...]:
        """Slots holding a request (decoding or still prefilling), in slot order."""
        return tuple(sorted(self._slots))

    @property
    def prefilling(self) -> tuple[int, ...]:
        """Active slots whose prompt is not all in the cache yet (chunked prefill), in slot order."""
        return tuple(s for s in sorted(self._slots) if self._slots[s].prefilling)

    @property
    def free(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_slots) if i not in self._slots)

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """The cache tensors (read-only view, for tests and inspection)."""
        return tuple(self._state)

    def position(self, slot: int) -> int:
        """Tokens in ``slot``'s cache row (0 for a free slot)."""
        a = self._slots.get(slot)
        return a.position if a is not None else 0

    def held(self, slot: int) -> tuple[int, ...]:
        """The tokens whose K/V a free ``slot``'s row holds for the prefix cache (empty: nothing reusable)."""
        return () if slot in self._slots else tuple(self._held[slot])

    def output(self, slot: int) -> tuple[list[int], str]:
        """The tokens and text an active slot generated so far."""
        a = self._slots[slot]
        return list(a.tokens), a.text

    # --- requests -------------------------------------------------------------------------------------
    def check(self, request: SlotRequest) -> int:
        """Validate ``request`` against this engine; return its new-token limit. Raises UsageError, or
        CacheOverflowError naming ``max_seq_len`` when prompt + max_tokens does not fit a slot."""
        if not isinstance(request, SlotRequest):
            raise UsageError(f"admit takes a kvtrace.SlotRequest, got {type(request).__name__}")
        prompt = request.prompt
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise UsageError(f"a request's prompt is a list of token ids, got {type(prompt).__name__}")
        for i in prompt:
            if isinstance(i, bool) or not hasattr(i, "__index__"):
                raise UsageError(f"a request's prompt holds integer token ids; got {type(i).__name__} {i!r}")
            i = operator.index(i)
            if i < 0 or (self._vocab is not None and i >= self._vocab):
                raise UsageError(f"token id {i} is outside the vocabulary [0, {self._vocab})")
        n, limit = len(prompt), self.max_seq_len
        if n == 0:
            raise UsageError("the prompt is empty; give at least one token")
        if n >= limit:
            raise CacheOverflowError(f"the prompt has {n} tokens; this model's context is max_seq_len={limit} tokens "
                                     "(prompt and completion together), so at most "
                                     f"{limit - 1} prompt tokens leave room for an answer. Shorten the prompt")
        m = request.max_tokens
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise UsageError(f"max_tokens must be a whole number >= 1, got {m!r}")
            if n + m > limit:
                raise CacheOverflowError(
                    f"the prompt ({n} tokens) plus max_tokens ({m}) is {n + m} tokens; this model's context is "
                    f"max_seq_len={limit} tokens. Lower max_tokens to at most {limit - n} or shorten the prompt")
        if not isinstance(request.sampling, Sampling):
            raise UsageError(f"sampling must be a kvtrace.Sampling, got {type(request.sampling).__name__}")
        bias = request.sampling.logit_bias
        if bias and self._vocab is not None and bias[-1][0] >= self._vocab:  # sorted: the largest id last
            raise UsageError(f"logit_bias names token id {bias[-1][0]}, outside the vocabulary [0, {self._vocab}); "
                             f"bias ids below {self._vocab} only")
        stops = request.stop
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            raise UsageError(f"stop must be a list of non-empty strings, got {stops!r}")
        if stops and self._decode_text is None:
            raise UsageError("stop strings need text: give the engine decode_text (the artifact's tokenizer)")
        k = request.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise UsageError(f"logprobs must be None or a whole number of alternatives in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {k!r}")
        checked_grammar(request.grammar, request.stop_ids)
        return m if m is not None else limit - n

    def admit(self, request: SlotRequest) -> tuple[int, SlotEvent | None]:
        """Prefill ``request`` into a free slot (after the prefix its row already holds, see ``prefix_cache``) and
        sample its first token: (slot, its first SlotEvent); the event is None while a chunked prefill has prompt
        left (a later ``step`` gives it). Raises UsageError when every slot is busy (nothing changes), or what
        ``check`` raises."""
        limit = self.check(request)
        if not self.free:
            raise UsageError(f"all {self.n_slots} slots are busy; wait for a request to finish (step) or cancel one")
        slot, keep = self._pick(request.prompt)
        self._slots[slot] = a = _Active(request, limit, self._decode_text, self._admitted, keep, self._written[slot])
        self._held[slot] = []  # the row's tokens are the request's from now on
        self._admitted += 1
        if self.prefill_chunk is not None:  # the next steps prefill it
            self.last_step = StepStats(cached_tokens=keep)
            return slot, None
        t0 = time.perf_counter()
        n = len(request.prompt) - keep
        ev = self._prefill_next(slot, a, n)
        self.last_step = StepStats(n, time.perf_counter() - t0, cached_tokens=keep)
        return slot, ev

    def step(self) -> list[SlotEvent]:
        """Decode one token for every decoding slot at once, then (chunked prefill) prefill up to
        ``prefill_chunk`` prompt tokens of the waiting requests, oldest first; one SlotEvent per decoded slot
        (finished ones are freed), plus the first token of each request whose prompt is now all prefilled."""
        rows = [s for s in self.active if not self._slots[s].prefilling]
        events: list[SlotEvent] = []
        t0 = time.perf_counter()
        if rows:
            acts = [self._slots[s] for s in rows]
            tokens = torch.tensor([[a.last] for a in acts], dtype=torch.int64, device=self._device)  # [R, 1]
            try:
                with torch.inference_mode():
                    logits = self._run(self._decode, self._dec_spec, tokens, [a.position for a in acts], rows, 1)[:, -1]
            except BaseException:
                for a in acts:  # what these rows hold is unknown now: reset them when they are freed
                    a.failed = True
                raise
            for a in acts:
                a.position += 1
                a.written = max(a.written, a.position)
            events = self._emit(rows, logits)
        t1 = time.perf_counter()
        budget = self.prefill_chunk or 0
        for slot in sorted(self.prefilling, key=lambda s: self._slots[s].order):
            if budget == 0:
                break
            a = self._slots[slot]
            t = min(budget, len(a.request.prompt) - a.position)
            budget -= t
            ev = self._prefill_next(slot, a, t)
            if ev is not None:
                events.append(ev)
        filled = (self.prefill_chunk or 0) - budget
        self.last_step = StepStats(filled, time.perf_counter() - t1 if filled else 0.0, len(rows), t1 - t0)
        return events

    def cancel(self, slot: int) -> SlotEvent | None:
        """Stop the request in ``slot`` and free it (reset); None if the slot was free."""
        a = self._slots.get(slot)
        if a is None:
            return None
        self._release(slot)
        return SlotEvent(slot, None, "", FinishReason.CANCELLED)

    def reset(self) -> None:
        """Cancel everything; every slot back to the declared initial state (the prefix cache emptied)."""
        for slot in self.active:
            self.cancel(slot)
        self.spec.reset_(self._state)
        self._held = [[] for _ in range(self.n_slots)]
        self._written = [0] * self.n_slots

    # --- internals ------------------------------------------------------------------------------------
    def _pick(self, prompt: Sequence[int]) -> tuple[int, int]:
        """The free slot to take for ``prompt`` and how many positions of its row to keep: the longest reusable
        prefix; without one the first empty slot, else the slot freed longest ago."""
        ranked = [(reusable(self.spec, self._held[s], prompt) if self.prefix_cache else 0,
                   not self._held[s], -self._freed[s] if self._held[s] else 0, -s) for s in self.free]
        keep, _, _, neg_slot = max(ranked)
        return -neg_slot, keep

    def _prefill_next(self, slot: int, a: _Active, t: int) -> SlotEvent | None:
        """Prefill the next ``t`` tokens of ``a``'s prompt into ``slot``; sample the first token once the prompt
        is all in (its event), else None. A failing program frees and resets the slot."""
        prompt = a.request.prompt
        start = a.position
        tokens = torch.tensor([list(prompt[start : start + t])], dtype=torch.int64, device=self._device)  # [1, T]
        try:
            with torch.inference_mode():
                logits = self._run(self._prefill, self._pre_spec, tokens, [start], [slot], t)[:, -1]  # [1, V]
        except BaseException:
            del self._slots[slot]
            self._reset(slot, max(a.written, start + t))
            raise
        a.position = a.written = start + t
        if a.prefilling:
            return None
        try:
            return self._emit([slot], logits)[0]
        except BaseException:  # never leave a slot behind that no caller knows was admitted
            a.failed = True
            self._release(slot)
            raise

    def _run(self, program: Program, spec: ProgramSpec, tokens: torch.Tensor, starts: list[int], rows: list[int],
             t: int) -> torch.Tensor:
        """tokens [R, T] into ``rows``, row r at positions starts[r] .. starts[r]+T-1 -> logits [R, 1 or T, V]."""
        dev = self._device
        end = max(starts) + t
        if end > self.spec.max_seq_len:  # guarded by check() and the per-slot limit; never run past the cache
            raise CacheOverflowError(f"a slot would need {end} cache positions; the cache holds {self.spec.max_seq_len}")
        pos = torch.tensor(starts, dtype=torch.int64, device=dev)[:, None] + torch.arange(t, device=dev)  # [R, T]
        keys = (torch.arange(end, dtype=torch.int64, device=dev),) if spec.key_pos else ()  # [L]
        if spec.slots:
            args = (tokens, pos, *keys, torch.tensor(rows, dtype=torch.int64, device=dev))
        else:  # a batch-1 artifact's own programs: input_pos [T]
            args = (tokens, pos[0], *keys)
        return program(*args, *self._state)

    def _emit(self, rows: list[int], logits: torch.Tensor) -> list[SlotEvent]:
        """Sample one token per row from logits [R, V]; finish, hold back or hand out text; free finished slots."""
        acts = [self._slots[s] for s in rows]
        greedy = [i for i, a in enumerate(acts) if a.greedy]
        picked: dict[int, int] = {}
        failed: dict[int, str] = {}  # a request's own sampling failed (its grammar allowed no token): it alone ends
        if greedy:
            ids = logits[greedy].argmax(-1).tolist() if len(greedy) < len(acts) else logits.argmax(-1).tolist()
            picked.update(zip(greedy, ids, strict=True))
        with torch.inference_mode():
            for i, a in enumerate(acts):
                if not a.greedy:
                    try:
                        picked[i] = int(sample(logits[i : i + 1], a.request.sampling, a.gen, a.penalties, a.grammar))
                    except KvtraceError as e:
                        failed[i] = str(e)
        events = []
        for i, (slot, a) in enumerate(zip(rows, acts, strict=True)):
            if i in failed:
                a.failed = True  # reset when freed, as after a failing program
                self._release(slot)
                events.append(SlotEvent(slot, None, "", FinishReason.ERROR, error=failed[i]))
                continue
            k = a.request.logprobs
            lp = None if k is None else _logprobs(logits[i], picked[i], k)
            events.append(self._advance(slot, a, picked[i], lp))
        return events

    def _advance(self, slot: int, a: _Active, tok: int, logprobs: TokenLogprobs | None = None) -> SlotEvent:
        if tok in a.stop_ids:
            text = a.text[a.sent :]  # whatever was held back is complete now
            self._release(slot)
            return SlotEvent(slot, None, text, FinishReason.EOS)
        a.tokens.append(tok)
        a.last = tok
        finish = None
        if a.stream is not None:
            a.text += a.stream.push(a.tokens)
            cut = _find_stop(a.text, a.request.stop, a.sent)
            if cut is not None:
                a.text = a.text[:cut]
                finish = FinishReason.STOP
        if finish is None and a.grammar is not None and a.grammar.done:
            finish = FinishReason.GRAMMAR
        if finish is None and len(a.tokens) >= a.limit:
            finish = FinishReason.MAX_TOKENS if a.request.max_tokens is not None else FinishReason.MAX_SEQ_LEN
        if finish is None and a.position >= self.max_seq_len:
            finish = FinishReason.MAX_SEQ_LEN
        upto = len(a.text) if finish is not None else len(a.text) - _held_back(a.text, a.request.stop)
        text = a.text[a.sent : upto] if upto > a.sent else ""
        a.sent = max(a.sent, upto)
        if finish is not None:
            self._release(slot)
        return SlotEvent(slot, tok, text, finish, logprobs)

    def _release(self, slot: int) -> None:
        """Free ``slot``: keep its row for the prefix cache (the tokens of its positions: the prompt and the
        output fed back), or reset it (``prefix_cache=False``, or a program failed on it)."""
        a = self._slots.pop(slot)
        self._releases += 1
        self._freed[slot] = self._releases
        if self.prefix_cache and not a.failed and a.position:
            self._held[slot] = [*a.request.prompt, *a.tokens][: a.position]
            self._written[slot] = a.written
        else:  # nothing to keep: the row back to its initial values (so an empty `held` means an initial row)
            self._reset(slot, a.written)

    def _reset(self, slot: int, written: int) -> None:
        """Refill the first ``written`` positions of ``slot``'s row with each buffer's initial value."""
        self._held[slot], self._written[slot] = [], 0
        if not self._pre_spec.slots:
            self.spec.reset_(self._state)
            return
        with torch.inference_mode():
            for t, init in zip(self._state, self._inits, strict=True):
                t[slot, :, :written].fill_(init)  # [H_kv, written, D] of row `slot`


def _logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """``token``'s log-probability under logits [V] and the ``k`` most likely tokens' (float32, most likely first;
    equal values: the lower id first, as a stable descending sort puts them)."""
    with torch.inference_mode():
        lp = torch.log_softmax(logits.float(), dim=-1)  # [V]
        top = torch.sort(lp, descending=True, stable=True).indices[:k].tolist() if k else []
        values = lp[top].tolist() if k else []
        return TokenLogprobs(float(lp[token]), tuple(zip(top, values, strict=True)))


def _find_stop(text: str, stops: Sequence[str], sent: int) -> int | None:
    """Where the first stop string in ``text`` begins (searching only text not yet handed out could miss one
    straddling it, so from ``sent`` minus the longest stop), or None."""
    if not stops:
        return None
    start = max(0, sent - max(map(len, stops)))
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string (kept until they are not)."""
    most = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), most, -1):
            if text.endswith(s[:k]):
                most = k
                break
    return most


class SlotSession:
    """One slot of a slots artifact driven like a Session (``prefill``, ``decode``, ``reset``, ``position``,
    ``state``), for tools that compare a Session's logits and cache step by step (``kvtrace verify``).

    It owns a cache of all N rows and runs the slot programs on row ``slot`` only (R = 1), so the other rows
    must stay at their initial values — which ``untouched()`` checks. ``state`` and ``spec`` show that row as a
    batch-1 cache ``[1, H_kv, S, D]``.
    """

    def __init__(self, spec: CacheSpec, programs: Mapping[str, tuple[ProgramSpec, Program]], slot: int | None = None,
                 vocab_size: int | None = None, device: str = "cpu", quant: Any = None):
        import dataclasses

        (self._pre_spec, self._prefill), (self._dec_spec, self._decode) = programs["prefill"], programs["decode"]
        if not (self._pre_spec.slots and self._dec_spec.slots):
            raise UsageError("a SlotSession runs slot programs (an artifact exported with slots=N); use a Session")
        self.slot = spec.batch_size - 1 if slot is None else slot
        if not 0 <= self.slot < spec.batch_size:
            raise UsageError(f"slot must be in [0, {spec.batch_size}), got {slot}")
        self._full = spec
        self.spec = dataclasses.replace(spec, batch_size=1)  # what `state` shows
        self.prefill_logits = self._pre_spec.logits
        self.filled: frozenset[str] = frozenset()
        self._vocab = vocab_size
        self._device = torch.device(device)
        self._state = spec.allocate(device)
        self._pos = 0
        self.quant = quant  # the programs' quantized weights (spec.quant.QuantSpec); verify's reference reads it

    @property
    def position(self) -> int:
        return self._pos

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        return tuple(t[self.slot : self.slot + 1] for t in self._state)  # [1, H_kv, S, D] views of the row

    def untouched(self) -> bool:
        """Whether every other row still holds its initial values."""
        return all(bool((t[i] == b.init).all()) for t, b in zip(self._state, self._full.buffers(), strict=True)
                   for i in range(self._full.batch_size) if i != self.slot)

    def reset(self) -> None:
        self._full.reset_(self._state)
        self._pos = 0

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._call(self._prefill, torch.as_tensor(tokens, dtype=torch.int64).reshape(1, -1))

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        return self._call(self._decode, torch.as_tensor(token, dtype=torch.int64).reshape(1, 1))

    def _call(self, program: Program, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        end = self._pos + t
        if t < 1 or end > self._full.max_seq_len:
            raise CacheOverflowError(f"{t} token(s) at position {self._pos} need {end} cache slots; the cache holds "
                                     f"max_seq_len={self._full.max_seq_len}")
        if self._vocab is not None and (int(tokens.min()) < 0 or int(tokens.max()) >= self._vocab):
            raise UsageError(f"token ids must be in [0, {self._vocab})")
        dev = self._device
        pos = torch.arange(self._pos, end, dtype=torch.int64, device=dev)[None]  # [1, T]
        keys = torch.arange(end, dtype=torch.int64, device=dev)  # [L]
        slots = torch.tensor([self.slot], dtype=torch.int64, device=dev)  # [1]
        logits = program(tokens.to(dev).contiguous(), pos, keys, slots, *self._state)
        self._pos = end
        return logits
