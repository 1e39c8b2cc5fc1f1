"""The model thread: one thread owns the SlotEngine (its programs and cache) and runs the serving loop.

    loop: cancel the slots whose clients left -> admit queued jobs into free slots (one prefill each; with
          --prefill-chunk C only the slot) -> one decode step for every decoding slot (then, chunked, up to
          C prompt tokens of the waiting prompts) -> hand each event to its job -> repeat; with nothing
          active, sleep until a job arrives

Which thread: the one that loaded the programs, when it can (``kvtrace serve`` runs this loop on its main
thread and uvicorn on another: ``serve.app.serve``). The compiled programs' kernels are OpenMP parallel
regions, and libgomp keeps one thread pool per thread that starts them: a second thread running them
(the artifact was loaded and probed on the main thread) makes a second pool, more OpenMP threads than CPUs,
and libgomp then puts idle workers to sleep at once instead of spinning — every kernel launch waits for a
wake-up. Measured on SmolLM2 (aoti-packed, 2 threads, 2 cores): a decode step of one slot 31.8 ms on the
loading thread, 37.7 ms on another (median of 4 runs each, interleaved); 31.8 vs 42.1 ms with
OMP_WAIT_POLICY=PASSIVE everywhere, which is the same sleep forced. ``start`` (a thread of its own) stays for
embedding the app elsewhere (tests, another ASGI server).

HTTP handlers never touch the engine: they ``submit`` a ``Job`` (refused with ``QueueFull`` when the
bounded queue is full), then read its events from ``Job.events``, an asyncio queue the model thread fills
through ``loop.call_soon_threadsafe``; ``Job.cancel()`` (a client that disconnected) asks the model thread
to free the slot at its next turn. Requests join and leave between decode steps: continuous batching.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvtrace._errors import KvtraceError, UsageError
from kvtrace.runtime.slots import FinishReason, SlotEngine, SlotEvent, SlotRequest
from kvtrace.serve.metrics import Metrics

__all__ = ["Done", "Job", "QueueFull", "Worker"]


class QueueFull(UsageError):
    """Every slot is busy and the waiting queue is at its bound (HTTP 429)."""


@dataclass(frozen=True)
class Done:
    """The last item of a job's events: how it ended and its token counts (``error``: a message, if it failed;
    ``cached_tokens``: prompt tokens its slot's cache already held, not prefilled)."""

    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str = ""
    cached_tokens: int = 0


@dataclass
class Job:
    """One request on its way through the model thread. ``events`` receives ``SlotEvent`` s, then one ``Done``."""

    request: SlotRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    received: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    first_token_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens its slot already held (the prefix cache)

    def cancel(self) -> None:
        """The client is gone: free the slot (or drop the job from the queue) at the model thread's next turn."""
        self.cancelled = True

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server shutting down): nobody is listening
            pass


class Worker:
    """Runs ``engine`` in its own thread (``start``/``stop``); at most ``max_queue`` jobs wait for a slot beyond
    those the free slots will take."""

    def __init__(self, engine: SlotEngine, metrics: Metrics, max_queue: int = 64):
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._waiting: collections.deque[Job] = collections.deque()
        self._jobs: dict[int, Job] = {}  # slot -> job
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._caller_runs = False  # ``hold``: the caller runs the loop (``run``), ``start`` starts no thread
        self.steps = 0

    # --- seen from the HTTP side (any thread) -------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._jobs)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stop:
                raise QueueFull("the server is shutting down")
            free = self.engine.n_slots - len(self._jobs)  # slots the queued jobs will take at the next turn
            if len(self._waiting) - max(free, 0) >= self.max_queue:
                raise QueueFull(f"the server is busy: all {self.engine.n_slots} conversation slots are generating and "
                                f"{self.max_queue} requests are waiting for one (the bound, --queue); retry later")
            self._waiting.append(job)
            self._cv.notify()

    def start(self) -> None:
        """Run the loop in a thread of its own, unless ``hold`` said the caller runs it."""
        if self._caller_runs:
            return
        self._thread = threading.Thread(target=self.run, name="kvtrace-model", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        """The calling thread will run the loop (``run``): ``start`` (the app's lifespan) starts no thread."""
        self._caller_runs = True

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def wake(self) -> None:
        """Have the model thread look at cancellations now (it sleeps while nothing is active)."""
        with self._cv:
            self._cv.notify()

    # --- the model thread -------------------------------------------------------------------------------
    def run(self) -> None:
        """The serving loop, in the calling thread, until ``stop`` (or an exception, e.g. KeyboardInterrupt);
        either way every running and waiting job is then answered "shutting down"."""
        import torch

        try:
            with torch.inference_mode():
                while True:
                    with self._cv:
                        while not self._stop and not self._waiting and not self._jobs:
                            self._cv.wait()
                        if self._stop:
                            break
                        dropped = [j for j in self._waiting if j.cancelled]
                        for j in dropped:
                            self._waiting.remove(j)
                    for j in dropped:
                        j._put(Done(FinishReason.CANCELLED, len(j.request.prompt), 0))
                    self._turn()
        finally:
            with self._cv:
                self._stop = True  # submit refuses from now on
            self._shutdown()

    def _turn(self) -> None:
        for slot, job in list(self._jobs.items()):
            if job.cancelled:
                self.engine.cancel(slot)
                self._finish(slot, FinishReason.CANCELLED)
        while self.engine.free:
            with self._cv:
                job = self._waiting.popleft() if self._waiting else None
            if job is None:
                break
            if job.cancelled:
                job._put(Done(FinishReason.CANCELLED, len(job.request.prompt), 0))
                continue
            self._admit(job)
        if self.engine.active:
            try:
                events = self.engine.step()
            except Exception as e:  # a program failed: fail every running job (they are reset), keep serving
                self._fail_all(f"generation failed: {type(e).__name__}: {e}")
                return
            st = self.engine.last_step
            if st.decode_rows:
                self.metrics.observe("decode_step_seconds", st.decode_seconds)
                self.metrics.observe("decode_batch_rows", st.decode_rows)
                self.steps += 1
            if st.prefill_tokens:
                self.metrics.observe("prefill_seconds", st.prefill_seconds)
            for ev in events:
                self._deliver(ev)
        # Let the HTTP thread take the GIL now, so it sends these tokens before the next step starts rather than
        # in the middle of it (AOTInductor's run releases the GIL: a Python thread spinning beside decode steps
        # ran at 52 % of its idle rate, stop 32 — but there it competes with the step's OpenMP threads for the cores).
        time.sleep(0)

    def _admit(self, job: Job) -> None:
        try:
            slot, ev = self.engine.admit(job.request)
        except KvtraceError as e:  # checked before queueing; a refusal here is answered, never raised
            job._put(Done(None, len(job.request.prompt), 0, error=str(e)))
            return
        except Exception as e:  # the prefill program failed: the engine reset the slot
            job._put(Done(None, len(job.request.prompt), 0, error=f"prefill failed: {type(e).__name__}: {e}"))
            return
        st = self.engine.last_step
        if st.prefill_tokens:  # with --prefill-chunk the steps prefill it
            self.metrics.observe("prefill_seconds", st.prefill_seconds)
        self.metrics.inc("prompt_tokens_total", len(job.request.prompt))
        self.metrics.inc("prompt_tokens_cached_total", st.cached_tokens)
        job.cached_tokens = st.cached_tokens
        self._jobs[slot] = job
        if ev is not None:  # None: a chunked prefill goes on in the next steps
            self._deliver(ev)

    def _deliver(self, ev: SlotEvent) -> None:
        job = self._jobs[ev.slot]
        if ev.token is not None:
            job.completion_tokens += 1
            self.metrics.inc("completion_tokens_total")
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
                self.metrics.observe("time_to_first_token_seconds", job.first_token_at - job.received)
        if ev.finish is FinishReason.ERROR:  # this request alone failed: answered as an error, the others go on
            self._finish(ev.slot, None, f"generation failed: {ev.error}")
            return
        job._put(ev)
        if ev.finish is not None:
            self._finish(ev.slot, ev.finish)

    def _finish(self, slot: int, finish: FinishReason | None, error: str = "") -> None:
        job = self._jobs.pop(slot)
        job._put(Done(finish, len(job.request.prompt), job.completion_tokens, error, job.cached_tokens))

    def _fail_all(self, message: str) -> None:
        for slot in list(self._jobs):
            self.engine.cancel(slot)
            self._finish(slot, None, message)

    def _shutdown(self) -> None:
        for slot in list(self._jobs):
            self.engine.cancel(slot)
            self._finish(slot, None, "the server is shutting down")
        with self._cv:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for job in waiting:
            job._put(Done(None, len(job.request.prompt), 0, error="the server is shutting down"))
