"""Tiered start: answer at once with the eager decoder, switch to the compiled artifact when it is built.

On an artifact-cache miss ``start`` loads the model (the converted weights are cached), starts the
artifact's build (``store.cached_artifact``) in a child *process* at a lower priority (``os.nice``), and
returns a ``Tiered`` whose ``artifact`` is an in-memory artifact of the decoder's own eager programs over
the same CacheSpec. Sessions start on those; between two tokens the caller asks ``poll(session)``, which
— once the build has landed in the cache and been loaded (in a thread, so the stream does not stall) —
swaps the compiled programs into the session (``Session.swap``: same CacheSpec, the cache kept, copied once
into the programs' own buffers where they hold it (ExecuTorch); no re-prefill). The next run finds the
artifact in the cache.

Invariants:
- the build is the cache's own (one lock per entry, the file renamed into place only when complete), so
  a build killed at any moment leaves no entry a later run would load (``kvtrace cache clear`` removes
  its temp file and lock);
- the build process never outlives this one: ``close()`` (also at interpreter exit) terminates its whole
  process group, and the child asks the kernel for SIGTERM when its parent dies (Linux ``PR_SET_PDEATHSIG``);
  SIGTERM unwinds the child (temp folders and files removed);
- a build that fails or yields an artifact that does not load leaves the sessions on the eager programs,
  with the reason in ``error``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace._errors import KvtraceError, one_line

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.spec.quant import QuantSpec

__all__ = ["BackgroundBuild", "Tiered", "start"]

NICE = 10  # the build's priority below the answer's: CFS gives a nice-10 process ~1/10 of a contended core
_MARK = "kvtrace-build "  # prefix of the child's protocol lines on its stdout


@dataclass(frozen=True)
class BuildRequest:
    """What the child builds: ``store.cached_artifact``'s arguments (plain JSON)."""

    source: str | None
    backend: str
    max_seq_len: int
    dtype: str = "float32"
    batch_size: int = 1
    prefill_logits: str = "last"
    kv_dtype: str | None = None
    quant: str | None = None  # export's quant, quant_group_size, quant_head
    quant_group_size: int | None = None
    quant_head: bool = True

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


class BackgroundBuild:
    """A ``cached_artifact`` build in a child process (its own process group, niced), cleaned up with this one.

    ``poll()`` reads the child's progress without blocking: ``phase`` (what it is doing), then ``path`` and
    ``seconds`` when the artifact is in the cache, or ``error``. ``close()`` stops a running build.
    """

    def __init__(self, request: BuildRequest, *, nice: int = NICE, env: dict[str, str] | None = None):
        self.request = request
        self.phase = "starting"
        self.path: Path | None = None
        self.seconds: float | None = None  # the child's export + compile time
        self.error: str | None = None
        self.started = time.perf_counter()
        self._buf = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvtrace.artifact.tiered", request.to_json(), str(nice)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: Ctrl-C at the terminal is the foreground's to handle
            env=env,
        )
        os.set_blocking(self._proc.stdout.fileno(), False)
        atexit.register(self.close)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    @property
    def done(self) -> bool:
        """The child has exited (successfully or not) and everything it said has been read."""
        self.poll()
        return not self.running and self._proc.stdout.closed

    def poll(self) -> None:
        """Read what the child has said so far (never blocks)."""
        out = self._proc.stdout
        if out.closed:
            return
        exited = self._proc.poll() is not None  # read after this, so nothing written before exiting is missed
        while True:
            try:
                chunk = os.read(out.fileno(), 65536)
            except BlockingIOError:
                break
            if not chunk:
                exited = True
                break
            self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith(_MARK):
                self._said(json.loads(text[len(_MARK):]))
        if exited and self._proc.poll() is not None:
            out.close()
            if self.path is None and self.error is None:
                self.error = f"the build process exited with status {self._proc.returncode}"

    def _said(self, msg: dict[str, Any]) -> None:
        if "phase" in msg:
            self.phase = msg["phase"]
        if "done" in msg:
            self.path, self.seconds, self.phase = Path(msg["done"]), float(msg["seconds"]), "done"
        if "error" in msg:
            self.error, self.phase = msg["error"], "failed"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the child exits (True) or ``timeout`` seconds pass (False)."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.poll()
            return False
        self.poll()
        return True

    def close(self) -> None:
        """Stop the build if it still runs (SIGTERM to its process group, SIGKILL after 10 s); idempotent."""
        with contextlib.suppress(ProcessLookupError):
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGTERM)
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                    self._proc.wait()
                self.error = self.error or "cancelled"
        if not self._proc.stdout.closed:
            self._proc.stdout.close()
        atexit.unregister(self.close)


class Tiered:
    """An artifact to start sessions on now (``artifact``: eager programs, or the cached artifact on a hit)
    and, on a miss, the background build that ``poll`` swaps in when it lands."""

    def __init__(self, artifact: Any, build: BackgroundBuild | None, backend: str, huge_pages: bool = False):
        self.artifact = artifact  # kvtrace Artifact: eager (manifest.backend "eager") until the compiled one loads
        self.build = build
        self.backend = backend
        self.huge_pages = huge_pages  # the built artifact loaded with its weights in huge pages
        self.error: str | None = None  # why the compiled programs never arrived
        self._loading: threading.Thread | None = None
        self._loaded: Any = None
        self._load_error: str | None = None
        self._switched: set[int] = set()  # id() of the sessions swapped already

    @property
    def compiled(self) -> bool:
        """True once sessions run the compiled programs (a cache hit, or after the swap)."""
        return self.artifact.manifest.backend != "eager"

    @property
    def pending(self) -> bool:
        """The build still runs or its artifact is still loading."""
        return self.build is not None and not self.compiled and self.error is None

    def phase(self) -> str:
        if self.build is None:
            return "compiled" if self.compiled else "eager"
        self.build.poll()
        if self._loading is not None and self._loaded is None:
            return f"loading the {self.backend} artifact"
        return self.build.phase

    def poll(self, *sessions: Any, wait: bool = False, finish_loading: bool = False) -> bool:
        """Between two tokens: if the compiled artifact is ready, swap its programs into ``sessions``
        (their caches kept); True when that happened now. ``wait``: block until the build has landed
        (or failed) first; ``finish_loading``: once it has landed, block until it is loaded (a second or
        two, e.g. before a chat turn) instead of answering on the eager programs meanwhile. Never raises
        for a failed build: ``error`` says what happened."""
        if not self.pending:
            return self._swap(sessions) if self.compiled else False
        assert self.build is not None
        if wait:
            self.build.wait()
        self.build.poll()
        if self.build.error is not None:
            self.error = f"the background {self.backend} build failed: {self.build.error}"
            return False
        if self.build.path is None:
            return False
        if self._loading is None:
            self._loading = threading.Thread(target=self._load, args=(self.build.path,), daemon=True)
            self._loading.start()
        if wait or finish_loading:
            self._loading.join()
        if self._loading.is_alive():
            return False
        if self._load_error is not None:
            self.error = self._load_error
            return False
        self.artifact, self._loaded = self._loaded, None
        return self._swap(sessions)

    def _load(self, path: Path) -> None:
        from kvtrace.artifact.archive import load

        try:
            self._loaded = load(path, huge_pages=self.huge_pages)
        except KvtraceError as e:
            self._load_error = f"the {self.backend} artifact built in the background does not load: {e}"

    def _swap(self, sessions: tuple[Any, ...]) -> bool:
        """Swap the compiled programs into every session still on the eager ones. ``poll`` runs between every two
        tokens, also after the switch, so a session already switched costs nothing here: building a program set
        each token (3.5 ms for SmolLM2's aoti artifact) made the compiled decode of a tiered answer 33.6 tokens/s
        against 38-40 for the same artifact from a cache hit (stop 36)."""
        todo = [s for s in sessions if id(s) not in self._switched and s.label == "eager"]
        for s in todo:
            s.swap(self.artifact.program_set())  # one set per session: a set may carry its own state
            self._switched.add(id(s))
        return bool(todo)

    def close(self) -> None:
        """Stop a build that still runs (its artifact is then not cached)."""
        if self.build is not None:
            self.build.close()

    def __enter__(self) -> Tiered:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start(source: str | None, *, backend: str, max_seq_len: int, dtype: str = "float32", batch_size: int = 1,
          prefill_logits: str = "last", kv_dtype: str | None = None, quant: str | None = None,
          quant_group_size: int | None = None, quant_head: bool = True,
          progress: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
          notice: Callable[[str], None] | None = None, nice: int = NICE, huge_pages: bool = False) -> Tiered:
    """The cached artifact (a hit: ``Tiered.build`` None), else the eager programs of the model with the
    artifact's build started in the background (CPU). ``progress``/``notice`` as ``cached_artifact`` takes them;
    ``quant``: quantized weights, the eager programs computing with the same quantized modules (for GGUF blocks,
    the plain decoder over their dequantized values: the same numbers); ``huge_pages``: the compiled artifact
    (a hit, or the build's once it lands) loaded with its weights in transparent huge pages (``kvtrace.load``)."""
    from kvtrace.artifact.export import DTYPES, backend_quant
    from kvtrace.artifact.store import cached_artifact
    from kvtrace.backends import registry
    from kvtrace.sources.resolve import resolve_source
    from kvtrace.spec.quant import parse_quant

    # the eager programs compute the quantized weights as the backend's kernels will (its activations); a scheme
    # or dtype the backend does not offer is refused now, not by the build minutes into the answer
    qspec = backend_quant(backend, parse_quant(quant, quant_group_size, quant_head))
    if dtype in DTYPES:
        registry.get(backend).check_dtype(DTYPES[dtype])
    progress = progress or (lambda what: contextlib.nullcontext())
    src = resolve_source(source)
    found = cached_artifact(source, backend=backend, max_seq_len=max_seq_len, dtype=dtype, batch_size=batch_size,
                            prefill_logits=prefill_logits, load=True, notice=notice, kv_dtype=kv_dtype, build=False,
                            quant=quant, quant_group_size=quant_group_size, quant_head=quant_head, huge_pages=huge_pages)
    if found is not None:
        return Tiered(found.artifact, None, backend, huge_pages)
    # GGUF blocks compute with exactly the dequantized weights the plain decoder holds (gguf's dequantize, bit for
    # bit), so the plain decoder answers meanwhile: GGUFLinear is written for Inductor to fuse, and run eagerly it
    # took 9.1 s to prefill SmolLM2's 37-token prompt and decoded at 0.1 tokens/s beside the build
    eager_quant = None if qspec is not None and qspec.scheme == "gguf" else qspec
    with progress("loading model (GGUF is converted once, then cached)"):
        art = eager_artifact(src, max_seq_len=max_seq_len, dtype=dtype, batch_size=batch_size,
                             prefill_logits=prefill_logits, kv_dtype=kv_dtype, quant=eager_quant)
    # started after the model is loaded: a GGUF is then converted once, here, and the child reads the cache
    build = BackgroundBuild(BuildRequest(source, backend, max_seq_len, dtype, batch_size, prefill_logits, kv_dtype,
                                         quant, quant_group_size, quant_head),
                            nice=nice)
    return Tiered(art, build, backend, huge_pages)


def eager_artifact(source: Any, *, max_seq_len: int, dtype: str = "float32", batch_size: int = 1,
                   prefill_logits: str = "last", kv_dtype: str | None = None, quant: str | QuantSpec | None = None,
                   quant_group_size: int | None = None, quant_head: bool = True) -> Any:
    """An in-memory Artifact (manifest backend "eager") of a model source's decoder running its own programs
    uncompiled: what ``export`` would capture, ready at once. Nothing is written."""
    from kvtrace.artifact.archive import Artifact
    from kvtrace.artifact.export import from_source, make_manifest
    from kvtrace.capture.export import with_prefill_logits
    from kvtrace.runtime.session import eager_programs
    from kvtrace.spec.program import program_specs

    decoder, vocab, info, tokenizer_json, qspec = from_source(source, dtype=dtype, max_seq_len=max_seq_len,
                                                       batch_size=batch_size, kv_dtype=kv_dtype, quant=quant,
                                                       quant_group_size=quant_group_size, quant_head=quant_head)
    specs = with_prefill_logits(program_specs(decoder), prefill_logits, decoder)
    manifest = dataclasses.replace(make_manifest("eager", decoder, info, specs, vocab), quant=qspec)
    eager = eager_programs(decoder, prefill_logits=prefill_logits, vocab_size=vocab)
    programs = {"prefill": eager.prefill, "decode": eager.decode, **{n: p for n, (_, p) in eager.extra.items()}}
    name = getattr(source, "name", None) or str(source)
    return Artifact(Path(f"<{name}: eager>"), manifest, programs, tokenizer_json, keepalive=decoder)


# --- the child -------------------------------------------------------------------------------------
def _say(**msg: Any) -> None:
    sys.stdout.write(_MARK + json.dumps(msg) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def _phase(what: str) -> Iterator[None]:
    _say(phase=what)
    yield


def _die_with_parent() -> None:
    """Ask the kernel to send SIGTERM when the parent dies (Linux); elsewhere close() is the only guard."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl took effect
        sys.exit(143)


def _child(argv: list[str]) -> int:
    def terminated(*_: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGTERM)  # this build's own process group: the compiler processes it started
        raise SystemExit(143)  # unwinds: temp folders and files of the build are removed

    signal.signal(signal.SIGTERM, terminated)
    _die_with_parent()
    request = BuildRequest(**json.loads(argv[0]))
    with contextlib.suppress(OSError):
        os.nice(int(argv[1]))
    import warnings

    from kvtrace.sources.quiet import quiet_libraries

    quiet_libraries()
    warnings.filterwarnings("ignore")  # all of them: nobody reads this process's stderr
    from kvtrace.artifact.store import cached_artifact

    try:
        built = cached_artifact(request.source, backend=request.backend, max_seq_len=request.max_seq_len,
                                dtype=request.dtype, batch_size=request.batch_size,
                                prefill_logits=request.prefill_logits, kv_dtype=request.kv_dtype, progress=_phase,
                                quant=request.quant, quant_group_size=request.quant_group_size,
                                quant_head=request.quant_head)
    except KvtraceError as e:
        _say(error=str(e))
        return 1
    except Exception as e:
        _say(error=one_line(e))
        return 1
    assert built is not None
    _say(done=str(built.path), seconds=round(built.seconds, 2))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
