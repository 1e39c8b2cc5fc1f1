"""Decode replayed from CUDA graphs (``Session(..., cuda_graphs=True)``).

At batch 1 a decode step is a few hundred small kernels, and on a GPU launching them can cost as much as
running them. A CUDA graph records the launches once and replays them with one call. Replay is legal only
when every tensor the kernels touch stays at the same address with the same shape, which kvtrace's declared
state gives: the session's own state tensors (allocated once from the CacheSpec; programs, ``reset`` and
``restore`` update them in place, nothing reallocates them), a static token buffer ``[B, 1]`` and position
buffer ``[1]`` that each step fills in place, and ``key_pos`` of a fixed length.

``key_pos [L]`` (the live cache prefix, L = position + 1) grows every step, so the graph path rounds L up to
a bucket (``buckets``: 64, 128, 256, ... up to max_seq_len) and passes ``key_pos = 0 .. bucket-1``: the slots
past the position are masked by position, as ``forward`` masks all ``max_seq_len`` slots, so each step
computes the same attention over a few more masked keys. One graph per bucket, captured the first time a
step needs it: that step runs the program directly (on the capture stream, which also warms it up), then the
graph is recorded — recording runs nothing, so the state is written once. Prefill never uses graphs (its T
varies); rewind, snapshot, restore and reset need nothing here: they change the host position or the state's
values, never its tensors.

A program with ``fresh()`` (AOTInductor's, ``backends.aoti.CompiledProgram``) is captured through a fresh
instance per graph: an AOTInductor container queries a CUDA event of its previous run on the next, which
CUDA refuses for an event recorded inside a capture. The recording itself sits behind ``Capturer``, so the
bookkeeping runs without a GPU (``EagerCapturer``: a "replay" runs the program again over the same static
buffers, into one output tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

__all__ = ["Capturer", "CudaCapturer", "EagerCapturer", "GraphDecode", "GraphStats", "decode_buckets"]

T = TypeVar("T")
SMALLEST_BUCKET = 64  # below this, a longer masked prefix costs less than another graph


def decode_buckets(max_seq_len: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """The key_pos lengths decode graphs are captured for: ``smallest``, twice that, ... and max_seq_len."""
    out, b = [], max(1, smallest)
    while b < max_seq_len:
        out.append(b)
        b *= 2
    return (*out, max_seq_len)


class Capturer(Protocol):
    """How a step is run outside a graph and recorded into one."""

    def warm(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` for real (the step that precedes a capture), where the capture will run."""
        ...

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record ``fn`` without running it; returns ``replay() -> the captured output tensor`` (overwritten by
        every replay)."""
        ...


class CudaCapturer:
    """torch.cuda.CUDAGraph capture on one side stream and one memory pool per session (graphs of one session
    never run concurrently, so they may share it). Capture uses CUDA's relaxed mode: AOTInductor's container
    queries the event of its warm-up run (complete by then) when it starts, which the default mode forbids."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[Any] = []  # kept alive as long as the session: replays run them

    def warm(self, fn: Callable[[], T]) -> T:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        if isinstance(out, torch.Tensor):
            out.record_stream(current)  # made on the side stream, used (and freed) on the caller's
        return out

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="relaxed"):
            out = fn()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerCapturer:
    """A Capturer without a GPU (CPU sessions, tests): the same bookkeeping, no graphs. ``capture`` records
    nothing and runs nothing; each replay runs ``fn`` again — reading the static buffers as a graph would — and
    copies its result into one output tensor, as a graph's replay overwrites its captured output."""

    def __init__(self) -> None:
        self.captured = 0

    def warm(self, fn: Callable[[], T]) -> T:
        return fn()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.captured += 1
        out: list[torch.Tensor] = []

        def replay() -> torch.Tensor:
            result = fn()
            if out:
                out[0].copy_(result)
            else:
                out.append(result)
            return out[0]

        return replay


@dataclass
class GraphStats:
    captures: int = 0  # graphs recorded (one per bucket met)
    replays: int = 0  # decode steps served by a replay
    buckets: tuple[int, ...] = ()  # the key_pos lengths captured so far (empty for a program without key_pos)


class GraphDecode:
    """A decode program served from graphs over static buffers and the session's own state tensors.

    ``state`` is the session's list of state tensors (the same tensor objects for the session's life);
    ``key_pos``: the program takes key_pos [L] after input_pos (else it reads all slots: one graph);
    ``buckets``: the key_pos lengths (``decode_buckets``). Returns logits ``[B, 1, V]`` owned by the caller (a
    copy of the graph's output, which the next replay overwrites).
    """

    def __init__(self, program: Callable[..., torch.Tensor], state: Sequence[torch.Tensor], *, batch: int,
                 device: torch.device, key_pos: bool, buckets: Sequence[int], capturer: Capturer):
        self._program = program
        self._state = state
        self._key_pos = key_pos
        self._buckets = tuple(sorted(buckets)) if key_pos else ()
        self._capturer = capturer
        self._tokens = torch.zeros(batch, 1, dtype=torch.int64, device=device)  # [B, 1], filled each step
        self._input_pos = torch.zeros(1, dtype=torch.int64, device=device)  # [1], filled each step
        self._keys: dict[int, torch.Tensor] = {}  # bucket -> key_pos [bucket] = 0 .. bucket-1, made once
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}  # bucket (0: no key_pos) -> replay
        self._instances: list[Any] = []  # the program instances graphs were captured with (kept alive)
        self.stats = GraphStats()

    def bucket(self, end: int) -> int:
        """The key_pos length a step ending at ``end`` (= position + 1) runs with; 0 without key_pos."""
        if not self._key_pos:
            return 0
        for b in self._buckets:
            if b >= end:
                return b
        raise ValueError(f"position {end - 1} is past the largest decode bucket {self._buckets[-1]}")

    def __call__(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """One decode step of ``tokens [B, 1]`` at ``position``; the state is updated in place."""
        b = self.bucket(position + 1)
        self._tokens.copy_(tokens)
        self._input_pos.fill_(position)  # a kernel argument, no host round trip
        replay = self._replays.get(b)
        if replay is not None:
            self.stats.replays += 1
            return replay().clone()
        program = self._program.fresh() if hasattr(self._program, "fresh") else self._program
        self._instances.append(program)
        args = [self._tokens, self._input_pos, *((self._keys_for(b),) if self._key_pos else ()), *self._state]
        out = self._capturer.warm(lambda: program(*args))  # the real step: writes the state once
        self._replays[b] = self._capturer.capture(lambda: program(*args))  # records, runs nothing
        self.stats.captures += 1
        self.stats.buckets = tuple(sorted(k for k in self._replays if k))
        return out

    def _keys_for(self, bucket: int) -> torch.Tensor:
        if bucket not in self._keys:
            self._keys[bucket] = torch.arange(bucket, dtype=torch.int64, device=self._tokens.device)  # [bucket]
        return self._keys[bucket]

    def direct(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """The same step run without a graph, with the same inputs (bucketed key_pos): what a replay must equal
        bit for bit (``bench/gpu.py`` checks it on a GPU)."""
        b = self.bucket(position + 1)
        keys = (torch.arange(b, dtype=torch.int64, device=self._tokens.device),) if self._key_pos else ()
        pos = torch.full((1,), position, dtype=torch.int64, device=self._tokens.device)
        return self._program(tokens.to(self._tokens.device), pos, *keys, *self._state)
