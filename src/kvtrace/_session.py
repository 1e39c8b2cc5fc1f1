"""Session: owns one cache for one conversation over a pair of compiled programs.

The position advances in exactly one place (``_run``). Every position handed to a program is a
tensor; the Session itself keeps a host-side int so it can refuse to run past ``max_seq_len``
*before* touching the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtrace._cache_spec import CacheSpec
from kvtrace._errors import CacheOverflowError, UnsupportedError, UsageError

__all__ = ["Session", "Snapshot"]

Program = Callable[..., torch.Tensor]  # (tokens [B, T], input_pos [T], *state) -> logits [B, T, V]


@dataclass(frozen=True)
class Snapshot:
    """A copy of a session's cache state and position (restore() copies it back)."""

    position: int
    state: tuple[torch.Tensor, ...]


class Session:
    """One conversation: ``prefill`` the prompt, ``decode`` one token at a time.

    Two sessions never share cache memory: each allocates its own state from the CacheSpec,
    holding the spec's declared initial values.
    """

    def __init__(self, spec: CacheSpec, prefill: Program, decode: Program, device: str = "cpu",
                 vocab_size: int | None = None):
        self.spec = spec
        self._prefill = prefill
        self._decode = decode
        self._vocab = vocab_size  # when known, token ids are checked against it before a program runs
        self._state = spec.allocate(device)  # [B, H_kv, S, D] per k/v buffer, then extras
        self._pos = 0

    @property
    def position(self) -> int:
        """Number of tokens in the cache (the absolute position of the next token)."""
        return self._pos

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """The live cache tensors (read-only view for inspection and verification)."""
        return tuple(self._state)

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run ``tokens [B, T]`` at positions ``position .. position+T-1``; returns logits ``[B, T, V]``."""
        return self._run(self._prefill, tokens, "prefill")

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Run one token ``[B, 1]``; returns logits ``[B, 1, V]``."""
        if token.dim() != 2 or token.shape[1] != 1:
            raise UsageError(f"decode takes one token per row, shape [B, 1]; got {list(token.shape)}")
        return self._run(self._decode, token, "decode")

    def _run(self, program: Program, tokens: torch.Tensor, what: str) -> torch.Tensor:
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
        logits = program(tokens.to(torch.int64).contiguous(), input_pos, *self._state)
        self._pos = end
        return logits

    def reset(self) -> None:
        """Back to the declared initial state (position 0)."""
        self.spec.reset_(self._state)
        self._pos = 0

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
        return Snapshot(self._pos, tuple(t.clone() for t in self._state))

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
