"""Session: owns one cache for one conversation over an artifact's compiled programs.

The position advances when a program runs (``_run``), and otherwise only where ``_replay`` takes back a
rewind over slots the last call wrote (speculative decoding). Every position handed to a program is a
tensor (``input_pos``, and ``key_pos = 0 .. end-1`` for programs that attend to the live cache
prefix only); the Session itself keeps a host-side int so it can refuse to run past ``max_seq_len``
*before* touching the cache. Extra programs (e.g. a vision decoder's ``prefill_image``) are picked
by the named inputs given to ``prefill`` and checked against their declared ``InputSpec`` first.

On a GPU (``device``) the state lives there and positions are made there (kernel arguments, no copy);
``cuda_graphs=True`` serves decode from CUDA graphs over the same state (``runtime.graphs``).

Invariants:
- the state tensors are allocated once and only ever updated in place (programs, reset, restore), so a CUDA
  graph captured over them stays valid; the one exception is ``swap`` to programs that hold their own cache,
  which moves the cache into theirs (one copy) and keeps theirs from then on;
- every public call validates its arguments before the cache is touched: a refused call leaves the
  position, the state and the ``once`` programs run exactly as they were;
- a ``Snapshot`` carries the identity of the artifact (or program pair) it was taken from and is
  restored only into a session of the same one;
- a Session is not thread-safe and says so: a call made while another thread is inside a call on the
  same session raises ``UsageError`` instead of interleaving two updates of one cache (use one session
  per thread, or serialize calls yourself);
- the cache belongs to the Session, not to its programs: ``swap`` replaces the programs between two calls
  (e.g. eager ones by the compiled ones of the same model once they are built) and keeps the cache and the
  position, refusing programs that declare another CacheSpec, vocabulary, logits layout or extra programs
  (programs holding their own cache, e.g. an ExecuTorch program's buffers, get this session's cache copied
  into those buffers; a session on such programs swaps to nothing else).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace._errors import CacheOverflowError, UnsupportedError, UsageError
from kvtrace.cache.kinds import kind_of
from kvtrace.runtime.graphs import Capturer, CudaCapturer, GraphDecode, GraphStats, decode_buckets
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.program import InputSpec, ProgramSpec

__all__ = ["ProgramSet", "Session", "Snapshot", "eager_programs"]

Program = Callable[..., torch.Tensor]  # (tokens [B, T], input_pos [T], *state) -> logits [B, T, V]
Tokens = torch.Tensor | Sequence[int] | Sequence[Sequence[int]]  # [B, T] ids; a flat list is one row


@dataclass(frozen=True)
class Snapshot:
    """A copy of a session's cache state and position (restore() copies it back).

    ``identity`` names what the state belongs to (an artifact's manifest digest, see ``Session``);
    ``restore`` refuses a snapshot of another identity even when the tensor shapes agree.
    """

    position: int
    state: tuple[torch.Tensor, ...]
    filled: frozenset[str] = frozenset()  # `once` programs that had run (e.g. the image prefill)
    identity: str = ""


@dataclass(frozen=True)
class ProgramSet:
    """What a Session runs over its cache: prefill and decode (and extra programs, by name), with what
    they declare — the CacheSpec they read and write, whether prefill returns the last position's logits
    only, whether they take ``key_pos`` — and a label for messages (e.g. the backend: "aoti", "eager").

    ``Artifact.program_set()`` makes one; ``Session.swap`` takes one."""

    spec: CacheSpec
    prefill: Program
    decode: Program
    extra: Mapping[str, tuple[ProgramSpec, Program]] = field(default_factory=dict)
    prefill_logits: str = "all"
    key_pos: bool = False
    vocab_size: int | None = None
    identity: str | None = None
    label: str = ""
    quant: Any = None  # the programs' quantized weights (spec.quant.QuantSpec), None: none
    state: Sequence[torch.Tensor] | None = None  # the cache, when the programs hold it (Backend.holds_state)


def eager_programs(decoder: torch.nn.Module, *, prefill_logits: str = "last", vocab_size: int | None = None,
                   identity: str | None = None) -> ProgramSet:
    """The Decoder's own (uncompiled) programs over its CacheSpec: what an artifact exported from it would run
    (the same methods, ``prefill_logits``, ``key_pos`` and extra programs), ready at once. ``kvtrace generate``
    starts on these while the compiled programs build, then swaps (``Session.swap``)."""
    from kvtrace.capture.export import method_module, with_prefill_logits
    from kvtrace.spec.program import program_specs

    specs = {p.name: p for p in with_prefill_logits(program_specs(decoder), prefill_logits, decoder)}
    run = {n: method_module(decoder, p) for n, p in specs.items()}
    extra = {n: (p, run[n]) for n, p in specs.items() if n not in ("prefill", "decode")}
    return ProgramSet(decoder.cache_spec, run["prefill"], run["decode"], extra=extra,
                      prefill_logits=specs["prefill"].logits, key_pos=specs["prefill"].key_pos,
                      vocab_size=vocab_size, identity=identity, label="eager")


class Session:
    """One conversation: ``prefill`` the prompt, ``decode`` one token at a time.

    Two sessions never share cache memory: each allocates its own state from the CacheSpec,
    holding the spec's declared initial values.

    ``identity`` ties snapshots to the programs they were taken with: ``Artifact.session()`` passes the
    artifact's manifest digest (so a snapshot restores into any session of the same artifact file, also
    after reloading it); by default it names this prefill/decode program pair.

    Not thread-safe: a call while another thread is inside a call on the same session raises
    ``UsageError`` (nothing is serialized silently; use one session per thread).

    ``device``: where the state is allocated and every tensor a program gets is made (the programs' device).
    ``cuda_graphs``: decode is served from CUDA graphs (``runtime.graphs``; a CUDA session), one per key_pos
    bucket (``graph_buckets``, default ``decode_buckets(max_seq_len)``); ``capturer`` replaces the CUDA
    capture (``EagerCapturer``: the same static buffers and buckets without graphs, on any device).
    ``state``: the cache of programs that hold it themselves (``Backend.holds_state``, e.g. views of an
    ExecuTorch program's mutable buffers), laid out as ``spec.buffers()``; the programs are then called
    without cache arguments, and reset / rewind / snapshot / restore / ``state`` act on those tensors.
    """

    def __init__(self, spec: CacheSpec, prefill: Program, decode: Program, device: str | torch.device = "cpu",
                 vocab_size: int | None = None, extra: Mapping[str, tuple[ProgramSpec, Program]] | None = None,
                 prefill_logits: str = "all", key_pos: bool = False, identity: str | None = None,
                 cuda_graphs: bool = False, capturer: Capturer | None = None,
                 graph_buckets: Sequence[int] | None = None, quant: Any = None,
                 state: Sequence[torch.Tensor] | None = None):
        self.spec = spec
        self.quant = quant  # the programs' quantized weights (spec.quant.QuantSpec), None: none; verify reads it
        self.identity = identity if identity is not None else f"programs:{id(prefill):x}:{id(decode):x}"
        self._busy = threading.Lock()  # held for the duration of every call that reads or writes the cache
        self._key_pos = key_pos  # prefill and decode take key_pos [L] after input_pos (ProgramSpec.key_pos)
        # "all": prefill returns logits [B, T, V]; "last": [B, 1, V] (the artifact's programs compute only that)
        self.prefill_logits = prefill_logits
        self._prefill = prefill
        self._decode = decode
        self._extra = dict(extra or {})  # name -> (spec, program), programs taking named inputs
        self._vocab = vocab_size  # when known, token ids are checked against it before a program runs
        self._device = torch.device(device)  # where the state lives, and so every tensor a program gets
        self._held = state is not None  # the programs hold the cache; they take no cache arguments
        # [B, H_kv, S, D] per k/v buffer, then extras; never reallocated
        self._state = list(state) if state is not None else spec.allocate(self._device)
        if self._held:
            _check_state(spec, self._state)
        self._pos = 0
        self._replayable = 0  # slots the last program call wrote that a rewind since has handed back (_replay)
        self._ahead = 0  # slots written past the position (rewound, not yet overwritten): what a ring lost to them
        self._filled: set[str] = set()  # `once` programs run since reset()
        self._graphs = self._graph_decode(cuda_graphs, capturer, graph_buckets)
        if self._held:  # last: a construction refused above leaves the programs free for another session
            _claim(self._state, "a new Session")
        self.label = ""  # what runs now (ProgramSet.label), for messages

    def _graph_decode(self, cuda_graphs: bool, capturer: Capturer | None,
                      buckets: Sequence[int] | None) -> GraphDecode | None:
        """Decode through graphs (``runtime.graphs``) when asked: CUDA graphs on a CUDA session, or the same
        bookkeeping through ``capturer`` (e.g. ``EagerCapturer`` on CPU, to check it without a GPU)."""
        if not cuda_graphs:
            return None
        if self._held:
            raise UsageError("cuda_graphs=True replays decode over the session's own state tensors; these programs "
                             "hold their cache themselves (e.g. an ExecuTorch program), so they cannot be captured")
        if capturer is None:
            if self._device.type != "cuda":
                raise UsageError(f"cuda_graphs=True needs a session on a CUDA device; this one is on {self._device} "
                                 "(load a CUDA artifact: kvtrace.load(path, device='cuda'))")
            capturer = CudaCapturer(self._device)
        buckets = tuple(buckets) if buckets is not None else decode_buckets(self.spec.max_seq_len)
        if self._key_pos and (not buckets or any(not 1 <= b <= self.spec.max_seq_len for b in buckets)
                              or max(buckets) != self.spec.max_seq_len):
            raise UsageError(f"graph_buckets must be key_pos lengths in 1 .. max_seq_len={self.spec.max_seq_len} "
                             f"ending at max_seq_len; got {list(buckets)}")
        return GraphDecode(self._decode, self._state, batch=self.spec.batch_size, device=self._device,
                           key_pos=self._key_pos, buckets=buckets, capturer=capturer)

    @property
    def device(self) -> torch.device:
        """Where the state lives and the programs run."""
        return self._device

    @property
    def graphs(self) -> GraphStats | None:
        """Graph captures and replays of decode (None without ``cuda_graphs``)."""
        return None if self._graphs is None else self._graphs.stats

    @classmethod
    def of(cls, programs: ProgramSet, device: str | torch.device = "cpu", *, cuda_graphs: bool = False,
           capturer: Capturer | None = None) -> Session:
        """A new Session (its own cache, holding the declared initial values) running ``programs`` on ``device``
        (``cuda_graphs`` / ``capturer``: as for the constructor)."""
        s = cls(programs.spec, programs.prefill, programs.decode, device=device, vocab_size=programs.vocab_size,
                extra=programs.extra, prefill_logits=programs.prefill_logits, key_pos=programs.key_pos,
                identity=programs.identity, cuda_graphs=cuda_graphs, capturer=capturer, quant=programs.quant,
                state=programs.state)
        s.label = programs.label
        return s

    def swap(self, programs: ProgramSet) -> None:
        """Run ``programs`` from the next call on, keeping this session's cache, position and ``once`` state.

        The cache is the Session's, so programs that declare the same CacheSpec (and the same vocabulary,
        prefill logits and extra programs) continue a conversation exactly where the old ones left it — e.g.
        the eager decoder's programs replaced by the AOTInductor-compiled ones of the same model once their
        build lands (``kvtrace generate``'s tiered start). Programs that hold their own cache (``programs.state``:
        e.g. an ExecuTorch program's buffers, one program instance per ``program_set()``) get this session's
        cache copied into their buffers, which are the session's state from then on (``state`` returns them;
        tensors taken from ``state`` before are no longer the cache). Refused with ``UsageError``, the session
        untouched, for programs that declare anything else, and for a session whose own programs hold its cache
        (it cannot be carried out of them). Snapshots are tied to ``programs.identity`` from now on (one taken
        before the swap restores into sessions of the old programs only).
        """
        if not isinstance(programs, ProgramSet):
            raise UsageError(f"swap takes a ProgramSet (e.g. artifact.program_set()); got {type(programs).__name__}")
        with self._exclusive("swap"):
            what = f"swap to {programs.label or 'new programs'}"
            if self._graphs is not None:
                raise UsageError(f"{what} refused: this session decodes from captured graphs of its programs "
                                 "(cuda_graphs=True); start a new session on the new programs instead")
            if self._held:
                raise UsageError(f"{what} refused: this session's programs hold its cache (e.g. an ExecuTorch "
                                 "program's buffers), so it cannot carry over; start a new session on the new "
                                 "programs instead")
            if programs.spec != self.spec:
                raise UsageError(
                    f"{what} refused: they declare the cache {programs.spec.describe()}, this session holds "
                    f"{self.spec.describe()}; a session keeps its cache, so it only runs programs of the same CacheSpec"
                )
            if programs.prefill_logits != self.prefill_logits:
                raise UsageError(f"{what} refused: their prefill returns {programs.prefill_logits!r} logits, this "
                                 f"session's {self.prefill_logits!r}; export them with the same prefill_logits")
            if None not in (programs.vocab_size, self._vocab) and programs.vocab_size != self._vocab:
                raise UsageError(f"{what} refused: vocabulary of {programs.vocab_size} tokens, this session's "
                                 f"is {self._vocab}; they belong to another model")
            mine = {n: (s.inputs, s.once, s.logits) for n, (s, _) in self._extra.items()}
            theirs = {n: (s.inputs, s.once, s.logits) for n, (s, _) in programs.extra.items()}
            if mine != theirs:
                raise UsageError(f"{what} refused: extra programs {sorted(theirs)}, this session runs "
                                 f"{sorted(mine)} (or they declare other inputs); they belong to another model")
            if programs.state is not None:  # their buffers become the cache: this session's copied in, once
                theirs = list(programs.state)
                try:
                    _check_state(self.spec, theirs)
                except UsageError as e:
                    raise UsageError(f"{what} refused: {e}") from None
                where = {t.device for t in theirs}
                if where != {self._device}:
                    raise UsageError(f"{what} refused: their cache is on {sorted(map(str, where))}, this session's on "
                                     f"{self._device}; start a new session on them instead")
                _claim(theirs, what)
                for dst, src in zip(theirs, self._state, strict=True):
                    dst.copy_(src)
                self._state, self._held = theirs, True
            self._prefill, self._decode = programs.prefill, programs.decode
            self._extra = dict(programs.extra)
            self._key_pos = programs.key_pos
            self.quant = programs.quant
            if programs.identity is not None:
                self.identity = programs.identity
            self.label = programs.label

    @property
    def position(self) -> int:
        """Number of tokens in the cache (the absolute position of the next token)."""
        return self._pos

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """The live cache tensors (read-only view for inspection and verification)."""
        return tuple(self._state)

    @property
    def filled(self) -> frozenset[str]:
        """Names of the ``once`` programs run since reset (e.g. ``{"prefill_image"}``: image K/V cached)."""
        return frozenset(self._filled)

    def input_specs(self) -> dict[str, tuple[InputSpec, ...]]:
        """Named inputs ``prefill`` accepts, per extra program (empty for a text-only artifact)."""
        return {name: spec.inputs for name, (spec, _) in self._extra.items()}

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """One call at a time: a second thread gets an error, not an interleaved cache."""
        if not self._busy.acquire(blocking=False):
            raise UsageError(
                f"{what}: this Session is already running a call in another thread; a Session owns one cache "
                "and is not thread-safe. Use one session per thread (artifact.session()) or serialize the calls"
            )
        try:
            yield
        finally:
            self._busy.release()

    def prefill(self, tokens: Tokens, **inputs: torch.Tensor | None) -> torch.Tensor:
        """Run ``tokens [B, T]`` at positions ``position .. position+T-1``; returns logits ``[B, T, V]``,
        or ``[B, 1, V]`` (the last position's) when ``prefill_logits == "last"``.

        ``tokens`` is an integer tensor ``[B, T]``, or a list of ids (one row) or of rows.
        ``inputs`` are the named extra inputs of a program the artifact declares, e.g. for a vision
        decoder ``cross_attention_states [B, N, dim]`` (and optionally ``cross_attention_mask [B, T, N]``).
        """
        with self._exclusive("prefill"):
            return self._prefill_locked(_as_tokens(tokens, "prefill"), inputs)

    def _prefill_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        """``prefill`` of ids this session's generation already holds (a speculative draft: sampled tokens and
        the prompt's, checked when prefilled), so the vocabulary check is skipped, as ``_decode_sampled`` does."""
        with self._exclusive("prefill"):
            return self._run(self._prefill, tokens, "prefill", key_pos=self._key_pos, sampled=True)

    def _prefill_locked(self, tokens: torch.Tensor, inputs: dict[str, torch.Tensor | None]) -> torch.Tensor:
        inputs = {k: v for k, v in inputs.items() if v is not None}
        if not inputs:
            return self._run(self._prefill, tokens, "prefill", key_pos=self._key_pos)
        name, spec, program = self._pick(inputs)
        if spec.once and name in self._filled:
            raise UsageError(
                f"this session already ran {name} (its state, e.g. the image's cross-attention K/V, stays until "
                f"reset()); call reset() to start a conversation with new {sorted(inputs)}, or prefill text only"
            )
        t = tokens.shape[1] if tokens.dim() == 2 else 0
        args = [_check_input(i, inputs.get(i.name), self.spec.batch_size, t, name, self._device) for i in spec.inputs]
        logits = self._run(program, tokens, name, args, key_pos=spec.key_pos)
        if spec.once:
            self._filled.add(name)
        return logits

    def _pick(self, inputs: dict[str, torch.Tensor]) -> tuple[str, ProgramSpec, Program]:
        given = set(inputs)
        hint = (" (no attention_mask is needed: the session tracks positions, and every row is one unpadded "
                "sequence)" if "attention_mask" in given else "")
        if not self._extra:
            raise UsageError(
                f"prefill got input(s) {sorted(given)}; this artifact's prefill takes token ids only "
                f"(accepted named inputs: none; it was exported from a text-only model){hint}"
            )
        for name, (spec, program) in self._extra.items():
            names = {i.name for i in spec.inputs}
            required = {i.name for i in spec.inputs if i.default is None}
            if required <= given <= names:
                return name, spec, program
        accepted = "; ".join(f"{n}: {', '.join(i.describe() for i in s.inputs)}" for n, (s, _) in self._extra.items())
        raise UsageError(f"prefill got input(s) {sorted(given)}; this artifact accepts {accepted}{hint}")

    def decode(self, token: Tokens) -> torch.Tensor:
        """Run one token ``[B, 1]`` (a tensor, or ``[[id], ...]``); returns logits ``[B, 1, V]``."""
        token = _as_tokens(token, "decode")
        if token.dim() != 2 or token.shape[1] != 1:
            raise UsageError(f"decode takes one token per row, shape [B, 1]; got {list(token.shape)}")
        with self._exclusive("decode"):
            return self._run(self._decode, token, "decode", key_pos=self._key_pos, graphs=True)

    def _decode_sampled(self, token: torch.Tensor) -> torch.Tensor:
        """``decode`` of a token sampled from this session's own logits (``runtime.generate``): ids in
        [0, V) by construction, on the session's device, so the vocabulary check — a host round trip for a
        device tensor — is skipped. Not for ids from anywhere else."""
        with self._exclusive("decode"):
            return self._run(self._decode, token, "decode", key_pos=self._key_pos, graphs=True, sampled=True)

    def _run(self, program: Program, tokens: torch.Tensor, what: str,
             inputs: list[torch.Tensor] | None = None, key_pos: bool = False, graphs: bool = False,
             sampled: bool = False) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise UsageError(f"{what} takes integer token ids of shape [B, T]; got {tokens.dtype} {list(tokens.shape)}")
        b, t = tokens.shape
        if b != self.spec.batch_size:
            raise UsageError(f"this artifact was exported for batch {self.spec.batch_size}; {what} got batch {b}")
        if t < 1:
            raise UsageError(f"{what} got 0 tokens; expected at least 1")
        if self._vocab is not None and not sampled:
            if tokens.device.type == "cpu":
                lo, hi = int(tokens.min()), int(tokens.max())
            else:  # one host round trip for both bounds
                lo, hi = torch.stack([tokens.min(), tokens.max()]).tolist()
            if lo < 0 or hi >= self._vocab:
                bad = lo if lo < 0 else hi
                raise UsageError(f"{what} got token id {bad}, outside the vocabulary [0, {self._vocab})")
        end = self._pos + t
        if end > self.spec.max_seq_len:
            raise CacheOverflowError(
                f"{what} of {t} token(s) at position {self._pos} needs {end} cache slots, but the cache holds "
                f"max_seq_len={self.spec.max_seq_len}; reset(), rewind(), or export with a larger --max-seq-len"
            )
        dev = self._device
        tokens = tokens.to(device=dev, dtype=torch.int64).contiguous()
        if graphs and self._graphs is not None:  # static buffers, bucketed key_pos: runtime.graphs
            logits = self._graphs(tokens, self._pos)
        else:  # positions made on the device from host ints: kernel arguments, no copy
            input_pos = torch.arange(self._pos, end, dtype=torch.int64, device=dev)  # [T] absolute positions
            keys = (torch.arange(end, dtype=torch.int64, device=dev),) if key_pos else ()  # [L]: the live prefix
            cache = () if self._held else self._state  # programs holding their cache take none
            logits = program(tokens, input_pos, *keys, *(i.to(dev) for i in inputs or ()), *cache)
        self._pos = end
        self._ahead = max(0, self._ahead - t)  # the call rewrote the first t of them
        self._replayable = 0
        return logits

    def reset(self) -> None:
        """Back to the declared initial state (position 0)."""
        with self._exclusive("reset"):
            self.spec.reset_(self._state)
            self._pos = 0
            self._replayable = self._ahead = 0
            self._filled.clear()

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` tokens (an int, 0 <= n <= position). Their slots are masked by position
        and overwritten later. A sliding-window layer allows it only while it still holds the window the
        rewound-to position reads (``KindOps.max_rewind``: 1 token past the window, any number before it)."""
        try:  # ints and int-like objects (numpy ints, 0-dim integer tensors) only; never 1.5 or True
            if isinstance(n, bool):
                raise TypeError
            n = operator.index(n)
        except TypeError:
            raise UsageError(f"rewind takes a whole number of tokens; got {type(n).__name__} {n!r}") from None
        if self.spec.extra:
            raise UnsupportedError(
                f"rewind is undefined for caches with extra state {[b.name for b in self.spec.extra]}; "
                "use snapshot()/restore()"
            )
        with self._exclusive("rewind"):
            if not 0 <= n <= self._pos:
                raise UsageError(f"rewind({n}): expected 0 <= n <= position ({self._pos})")
            if 0 < n < self._pos:  # rewinding everything needs nothing kept
                self._check_kept(n)
            self._pos -= n
            self._replayable += n
            # at position 0 nothing before it is read: positions 0.. are rewritten in order from here
            self._ahead = 0 if self._pos == 0 else self._ahead + n

    def _replay(self, n: int) -> None:
        """Take back ``n`` tokens of a ``rewind`` made since the last program call: their slots still hold what
        that call wrote for them (speculative decoding yields a verify call's accepted tokens one at a time,
        the session at the tokens before each). Not for anything else."""
        with self._exclusive("replay"):
            if not 0 <= n <= self._replayable:
                raise UsageError(f"_replay({n}): only {self._replayable} rewound token(s) since the last call can be "
                                 "taken back")
            self._pos += n
            self._replayable -= n
            self._ahead = max(0, self._ahead - n)

    def _kept(self, layer: Any, after: int = 0) -> int:
        """The most tokens ``rewind`` may drop from ``layer`` now, or after a call of ``after`` more tokens
        (``KindOps.max_rewind``). Slots written past the position by an earlier call and rewound since
        (``_ahead``: a rejected speculative draft, a rewind after a rewind) count as dropped too: a ring
        overwrote older positions with them."""
        ahead = max(0, self._ahead - after)  # a call rewrites the first of them
        return max(0, kind_of(layer).max_rewind(layer, self._pos + after + ahead) - ahead)

    def _check_kept(self, n: int) -> None:
        """Refuse rewind(n) when a layer no longer holds what the rewound-to position must read (``_kept``)."""
        for i, layer in enumerate(self.spec.layers):
            most = self._kept(layer)
            if n > most:
                slots = f" of {layer.max_len} slots" if layer.window else ""
                raise UsageError(
                    f"rewind({n}) at position {self._pos}: cache layer {i} ({layer.kind.value}{slots}) no longer "
                    f"holds what position {self._pos - n} reads, so at most {most} token(s) can be rewound here; "
                    f"take session.snapshot() before the tokens you may drop and restore() it instead"
                )

    def snapshot(self) -> Snapshot:
        """A copy of the cache state, position and ``once`` programs run, tagged with this session's identity."""
        with self._exclusive("snapshot"):
            return Snapshot(self._pos, tuple(t.clone() for t in self._state), frozenset(self._filled),
                            self.identity)

    def restore(self, snap: Snapshot) -> None:
        """Copy ``snap`` back into this session's own buffers (in place: programs keep their inputs).

        Refused, with the session untouched, when the snapshot comes from another artifact (identity),
        holds tensors of other shapes or dtypes, or a position outside ``0 .. max_seq_len``.
        """
        with self._exclusive("restore"):
            self._restore_locked(snap)

    def _restore_locked(self, snap: Snapshot) -> None:
        if not isinstance(snap, Snapshot):
            raise UsageError(f"restore takes a Snapshot from session.snapshot(); got {type(snap).__name__}")
        if snap.identity != self.identity:
            raise UsageError(
                f"snapshot was taken from {snap.identity or 'an unnamed session'!r}, this session runs "
                f"{self.identity!r}; restore a snapshot taken from a session of the same artifact"
            )
        if isinstance(snap.position, bool) or not isinstance(snap.position, int) or not (
                0 <= snap.position <= self.spec.max_seq_len):
            raise UsageError(
                f"snapshot position {snap.position!r} is not an int in 0 .. max_seq_len={self.spec.max_seq_len}; "
                "it was not made by snapshot()"
            )
        if not isinstance(snap.filled, (set, frozenset)) or not all(isinstance(t, torch.Tensor) for t in snap.state):
            raise UsageError("snapshot is malformed (state must be tensors, filled a set of names); take it with "
                             "session.snapshot()")
        unknown = set(snap.filled) - {n for n, (p, _) in self._extra.items() if p.once}
        if unknown:
            raise UsageError(f"snapshot says programs {sorted(unknown)} ran, which this artifact does not have")
        if len(snap.state) != len(self._state):
            raise UsageError(f"snapshot holds {len(snap.state)} tensors, this session {len(self._state)}")
        for b, src in zip(self.spec.buffers(), snap.state, strict=True):
            if tuple(src.shape) != b.shape or src.dtype != b.torch_dtype:
                raise UsageError(
                    f"snapshot tensor for {b.name} is {src.dtype} {list(src.shape)}; this session holds "
                    f"{b.torch_dtype} {list(b.shape)}. Restore a snapshot taken from a session of the same artifact"
                )
        for dst, src in zip(self._state, snap.state, strict=True):
            dst.copy_(src)
        self._pos = snap.position
        self._replayable = self._ahead = 0
        self._filled = set(snap.filled)


# id() of the first state tensor of every program instance a session runs on (programs holding their cache); an
# entry goes when that tensor does
_CLAIMED: set[int] = set()


def _claim(state: list[torch.Tensor], what: str) -> None:
    """Programs holding their cache serve one session: a second one on the same instance (the same ProgramSet,
    e.g. made once and given to two sessions) would write the first one's cache. ``Artifact.program_set()``
    makes a new instance each call."""
    key = id(state[0])
    if key in _CLAIMED:
        raise UsageError(f"{what} refused: these programs hold their cache and another session already runs on "
                         "them; take a new program set for each session (artifact.program_set() or "
                         "artifact.session())")
    _CLAIMED.add(key)
    weakref.finalize(state[0], _CLAIMED.discard, key)


def _check_state(spec: CacheSpec, state: list[torch.Tensor]) -> None:
    """State handed in by a program that holds it: one tensor per declared buffer, of its shape and dtype."""
    bufs = spec.buffers()
    if len(state) != len(bufs):
        raise UsageError(f"a Session over programs holding their cache needs {len(bufs)} state tensors (the "
                         f"CacheSpec's buffers), got {len(state)}")
    for b, t in zip(bufs, state, strict=True):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != b.shape or t.dtype != b.torch_dtype:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise UsageError(f"state tensor for {b.name} is {got}; the CacheSpec declares {b.dtype} {list(b.shape)}")


def _as_tokens(tokens: Any, what: str) -> torch.Tensor:
    """Token ids as given -> a tensor; a list of ints is one row ``[1, T]``, a list of rows ``[B, T]``.

    Tensors pass through unchanged (their dtype and shape are checked by ``Session._run``).
    """
    if isinstance(tokens, torch.Tensor):
        return tokens
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise UsageError(
            f"{what} takes token ids: an integer tensor [B, T] or a list of ints; got {type(tokens).__name__}"
            + (" (encode text with the artifact's tokenizer first)" if isinstance(tokens, str) else "")
        )
    rows = list(tokens) if tokens and isinstance(tokens[0], Sequence) else [tokens]
    if any(not isinstance(r, Sequence) or isinstance(r, (str, bytes)) for r in rows):
        raise UsageError(f"{what} takes a list of ints or a list of rows of ints; got a mix")
    if len({len(r) for r in rows}) > 1:
        raise UsageError(f"{what} got rows of different lengths {[len(r) for r in rows]}; every row needs the same T")
    for r in rows:
        for i in r:
            if isinstance(i, bool) or not hasattr(i, "__index__"):
                raise UsageError(f"{what} takes integer token ids; got {type(i).__name__} {i!r}")
            i = operator.index(i)
            if not -(2**63) <= i < 2**63:
                raise UsageError(f"{what} got token id {i}, which does not fit in int64")
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1)  # [B, T]


def _check_input(spec: InputSpec, value: torch.Tensor | None, batch: int, t: int, program: str,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The tensor to hand the program for one declared input: shape and dtype checked, masks cast.
    An omitted optional input is built on ``device`` (the session's); given ones are moved there by ``_run``."""
    shape = spec.concrete(batch, t)
    if value is None:  # optional (the Session picked this program only if every required input is there)
        return torch.full(shape, spec.default, dtype=spec.torch_dtype, device=device)
    if not isinstance(value, torch.Tensor):
        raise UsageError(f"{program} input {spec.name} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise UsageError(
            f"{program} input {spec.name} has shape {list(value.shape)}; this artifact expects {list(shape)} "
            f"({spec.describe()}, B = batch {batch}, T = {t} prompt tokens). {spec.doc}".rstrip()
        )
    if spec.binary:
        if value.dtype is not torch.bool and not bool(((value == 0) | (value == 1)).all()):
            raise UsageError(f"{program} input {spec.name} must hold 0/1 values (1 = attend); found others")
        return value.to(spec.torch_dtype).contiguous()
    if value.dtype != spec.torch_dtype:
        raise UsageError(
            f"{program} input {spec.name} is {str(value.dtype).removeprefix('torch.')}; this artifact was exported "
            f"for {spec.dtype}. Convert it with .to(torch.{spec.dtype})"
        )
    if not bool(torch.isfinite(value).all()):
        raise UsageError(f"{program} input {spec.name} holds NaN or infinite values")
    return value.contiguous()
