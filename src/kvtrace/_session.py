"""Session: owns one cache for one conversation over an artifact's compiled programs.

The position advances in exactly one place (``_run``). Every position handed to a program is a
tensor (``input_pos``, and ``key_pos = 0 .. end-1`` for programs that attend to the live cache
prefix only); the Session itself keeps a host-side int so it can refuse to run past ``max_seq_len``
*before* touching the cache. Extra programs (e.g. a vision decoder's ``prefill_image``) are picked
by the named inputs given to ``prefill`` and checked against their declared ``InputSpec`` first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvtrace._cache_spec import CacheSpec
from kvtrace._errors import CacheOverflowError, UnsupportedError, UsageError
from kvtrace._program_spec import InputSpec, ProgramSpec

__all__ = ["Session", "Snapshot"]

Program = Callable[..., torch.Tensor]  # (tokens [B, T], input_pos [T], *state) -> logits [B, T, V]


@dataclass(frozen=True)
class Snapshot:
    """A copy of a session's cache state and position (restore() copies it back)."""

    position: int
    state: tuple[torch.Tensor, ...]
    filled: frozenset[str] = frozenset()  # `once` programs that had run (e.g. the image prefill)


class Session:
    """One conversation: ``prefill`` the prompt, ``decode`` one token at a time.

    Two sessions never share cache memory: each allocates its own state from the CacheSpec,
    holding the spec's declared initial values.
    """

    def __init__(self, spec: CacheSpec, prefill: Program, decode: Program, device: str = "cpu",
                 vocab_size: int | None = None, extra: Mapping[str, tuple[ProgramSpec, Program]] | None = None,
                 prefill_logits: str = "all", key_pos: bool = False):
        self.spec = spec
        self._key_pos = key_pos  # prefill and decode take key_pos [L] after input_pos (ProgramSpec.key_pos)
        # "all": prefill returns logits [B, T, V]; "last": [B, 1, V] (the artifact's programs compute only that)
        self.prefill_logits = prefill_logits
        self._prefill = prefill
        self._decode = decode
        self._extra = dict(extra or {})  # name -> (spec, program), programs taking named inputs
        self._vocab = vocab_size  # when known, token ids are checked against it before a program runs
        self._state = spec.allocate(device)  # [B, H_kv, S, D] per k/v buffer, then extras
        self._pos = 0
        self._filled: set[str] = set()  # `once` programs run since reset()

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

    def prefill(self, tokens: torch.Tensor, **inputs: torch.Tensor | None) -> torch.Tensor:
        """Run ``tokens [B, T]`` at positions ``position .. position+T-1``; returns logits ``[B, T, V]``,
        or ``[B, 1, V]`` (the last position's) when ``prefill_logits == "last"``.

        ``inputs`` are the named extra inputs of a program the artifact declares, e.g. for a vision
        decoder ``cross_attention_states [B, N, dim]`` (and optionally ``cross_attention_mask [B, T, N]``).
        """
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
        args = [_check_input(i, inputs.get(i.name), self.spec.batch_size, t, name) for i in spec.inputs]
        logits = self._run(program, tokens, name, args, key_pos=spec.key_pos)
        if spec.once:
            self._filled.add(name)
        return logits

    def _pick(self, inputs: dict[str, torch.Tensor]) -> tuple[str, ProgramSpec, Program]:
        given = set(inputs)
        if not self._extra:
            raise UsageError(
                f"prefill got input(s) {sorted(given)}, but this artifact's programs take token ids only: it was "
                "exported from a text-only model. Image features need an artifact of a vision decoder "
                "(e.g. MllamaForCausalLM)"
            )
        for name, (spec, program) in self._extra.items():
            names = {i.name for i in spec.inputs}
            required = {i.name for i in spec.inputs if i.default is None}
            if required <= given <= names:
                return name, spec, program
        accepted = "; ".join(f"{n}: {', '.join(i.describe() for i in s.inputs)}" for n, (s, _) in self._extra.items())
        raise UsageError(f"prefill got input(s) {sorted(given)}; this artifact accepts {accepted}")

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Run one token ``[B, 1]``; returns logits ``[B, 1, V]``."""
        if token.dim() != 2 or token.shape[1] != 1:
            raise UsageError(f"decode takes one token per row, shape [B, 1]; got {list(token.shape)}")
        return self._run(self._decode, token, "decode", key_pos=self._key_pos)

    def _run(self, program: Program, tokens: torch.Tensor, what: str,
             inputs: list[torch.Tensor] | None = None, key_pos: bool = False) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise UsageError(f"{what} takes integer token ids of shape [B, T]; got {tokens.dtype} {list(tokens.shape)}")
        b, t = tokens.shape
        if b != self.spec.batch_size:
            raise UsageError(f"this artifact was exported for batch {self.spec.batch_size}; {what} got batch {b}")
        if t < 1:
            raise UsageError(f"{what} got 0 tokens; expected at least 1")
        if self._vocab is not None:
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self._vocab:
                bad = lo if lo < 0 else hi
                raise UsageError(f"{what} got token id {bad}, outside the vocabulary [0, {self._vocab})")
        end = self._pos + t
        if end > self.spec.max_seq_len:
            raise CacheOverflowError(
                f"{what} of {t} token(s) at position {self._pos} needs {end} cache slots, but the cache holds "
                f"max_seq_len={self.spec.max_seq_len}; reset(), rewind(), or export with a larger --max-seq-len"
            )
        input_pos = torch.arange(self._pos, end, dtype=torch.int64)  # [T] absolute positions
        keys = (torch.arange(end, dtype=torch.int64),) if key_pos else ()  # [L]: the live cache prefix
        logits = program(tokens.to(torch.int64).contiguous(), input_pos, *keys, *(inputs or ()), *self._state)
        self._pos = end
        return logits

    def reset(self) -> None:
        """Back to the declared initial state (position 0)."""
        self.spec.reset_(self._state)
        self._pos = 0
        self._filled.clear()

    def rewind(self, n: int) -> None:
        """Forget the last ``n`` tokens. Their slots are masked by position and overwritten later."""
        if self.spec.extra:
            raise UnsupportedError(
                f"rewind is undefined for caches with extra state {[b.name for b in self.spec.extra]}; "
                "use snapshot()/restore()"
            )
        if not 0 <= n <= self._pos:
            raise UsageError(f"rewind({n}): expected 0 <= n <= position ({self._pos})")
        self._pos -= n

    def snapshot(self) -> Snapshot:
        return Snapshot(self._pos, tuple(t.clone() for t in self._state), frozenset(self._filled))

    def restore(self, snap: Snapshot) -> None:
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
        self._filled = set(snap.filled)


def _check_input(spec: InputSpec, value: torch.Tensor | None, batch: int, t: int, program: str) -> torch.Tensor:
    """The tensor to hand the program for one declared input: shape and dtype checked, masks cast."""
    shape = spec.concrete(batch, t)
    if value is None:  # optional (the Session picked this program only if every required input is there)
        return torch.full(shape, spec.default, dtype=spec.torch_dtype)
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
