"""kvtrace bench: side-by-side speed of HF eager, HF + torch.compile, kvtrace jit/exported/aoti.

Everything runs in one process on the same prompt, so ratios are fair. Decode is memory-bound at
batch 1, so each backend is also put against the machine's own bound: measured read bandwidth
divided by the bytes a decode step must read (all weights + the live cache).

Every backend computes what a generation needs and no more: HF backends are called with
``logits_to_keep=1`` (as HF ``generate`` does) and kvtrace artifacts are exported with
``prefill_logits="last"``, so prefill times compare like with like.

Artifact backends (exported, aoti, aoti-packed) are built in this process and *measured in a fresh
one* (``fresh_process=True``, the default): that is what a user gets from ``kvtrace run`` /
``generate``, which load an artifact in a new process. Measured in the process that had just compiled
it, a packed fp32 program decoded at 36 tokens/s against 45-46 in a fresh process (round 1's
bench notes). The worker process loads the artifact, warms up, runs the same greedy generations and
reports its own peak RSS. HF and jit backends run in this process (they need the model object).

On a GPU (``device="cuda"``) every backend runs there, the clock reads after the device has finished
(``sync``), and the bound uses the device's own bandwidth (``measure_bandwidth``: a device-to-device copy,
bytes read plus written); ``cuda_graphs`` adds, per artifact backend, a row with decode replayed from CUDA
graphs (``<backend>+graphs``, ``runtime.graphs``). A greedy step keeps the token on the device; only its id
comes back to the host (as ``kvtrace generate`` does).

The tables (rich, Markdown) and the plot of a result are in ``kvtrace.tools.bench_render``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import UsageError
from kvtrace.tools.bench_render import COLUMNS, plot, render, render_markdown

__all__ = ["COLUMNS", "BenchResult", "bytes_per_token", "hf_stepper", "measure", "measure_bandwidth", "plot", "render",
           "render_markdown", "run_bench", "session_stepper", "sync"]

BASELINE = "hf-eager"  # the yardstick for ratios and token identity


def _activations(backend: str, quant: str) -> str | None:
    """What ``backend``'s programs compute ``quant``'s weights with (None for the eager baseline)."""
    from kvtrace.backends import registry

    return None if backend == BASELINE else registry.get(backend).quant_activations(quant)


def _artifact_backends() -> tuple[str, ...]:
    """The registry's backends: exported here, measured in a fresh process by default."""
    from kvtrace.backends import registry

    return registry.names()


@dataclass
class BenchResult:
    backend: str
    dtype: str
    prompt_len: int
    new_tokens: int
    quant: str = "none"  # the artifact's quantized weights (``export``'s quant scheme), "none" for none
    kv_dtype: str = "auto"  # the artifact's KV cache storage (``export``'s kv_dtype): "auto" = the model's dtype
    load_s: float = 0.0
    compile_s: float = 0.0
    prefill_ms: float = 0.0  # median
    prefill_ms_range: tuple[float, float] = (0.0, 0.0)
    decode_tok_s: float = 0.0  # median
    decode_tok_s_range: tuple[float, float] = (0.0, 0.0)
    peak_rss_mib: float = 0.0
    recompiles: int = 0
    artifact_mib: float | None = None
    tokens_match_eager: bool | None = None
    first_mismatch: int | None = None
    bound_fraction: float | None = None  # decode tok/s x bytes/token / the row's own bandwidth
    # read bandwidth measured right before and right after this row's runs (GB/s): the row's bound uses their mean,
    # since a shared machine's bandwidth moves within one bench run (up to ~1.7x within an hour on these machines)
    bandwidth_gb_s: float | None = None
    bandwidth_gb_s_range: tuple[float, float] | None = None
    bytes_per_token: int | None = None  # what one decode step reads: every weight once (as stored) + live K/V
    vs_hf_eager: float | None = None
    position_sweep: list[tuple[int, float]] = field(default_factory=list)  # (context position, decode tok/s)
    measured_in: str = "this process"  # or "fresh process" (artifact backends, see the module docstring)
    tokens: list[int] = field(default_factory=list, repr=False)
    error: str = ""


def sync(device: torch.device | str = "cpu") -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; the CPU has none queued)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(mib: int = 512, reps: int = 5, device: torch.device | str = "cpu") -> float:
    """Sustained memory bandwidth in GB/s. CPU: read bandwidth, best of ``reps`` full reductions over a ``mib``
    MiB tensor. CUDA: a device-to-device copy of ``mib`` MiB (default 4 GiB there), bytes read plus written,
    best of ``reps``, timed with CUDA events."""
    if torch.device(device).type == "cuda":
        return _device_copy_bandwidth(device, mib if mib != 512 else 4096, reps)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()  # fault pages in
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def _row_bandwidth(device: torch.device, fallback: float) -> float:
    """The bandwidth measured next to one row; the run's first measurement (``fallback``) where the probe's
    buffers no longer fit beside the models a run holds (a GPU's 8 GiB copy with a large model loaded)."""
    try:
        return measure_bandwidth(device=device)
    except torch.OutOfMemoryError:
        return fallback


def _device_copy_bandwidth(device: torch.device | str, mib: int, reps: int) -> float:
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    n = 2 * src.numel() * 4  # read + written
    del src, dst
    return n / best / 1e9


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):  # Linux: "5" resets the peak RSS (VmHWM) of this process
        Path("/proc/self/clear_refs").write_text("5")


class _Stepper:
    """One backend as prefill/decode callables plus its own reset."""

    def __init__(self, prefill: Callable[[torch.Tensor], torch.Tensor],
                 decode: Callable[[torch.Tensor], torch.Tensor], reset: Callable[[], None],
                 recompiles: Callable[[], int] = lambda: 0, artifact: Path | None = None,
                 workdir: Any = None, device: torch.device | str = "cpu"):
        self.prefill, self.decode, self.reset = prefill, decode, reset
        self.recompiles = recompiles
        self.artifact = artifact
        self.workdir = workdir  # a TemporaryDirectory holding a freshly exported artifact, or None
        self.device = torch.device(device)  # where it runs: the clock waits for it (``sync``)

    def close(self) -> None:
        """Delete a freshly exported artifact (hundreds of MiB) once its numbers are taken."""
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None


def session_stepper(session: Any, artifact: Path | None = None, workdir: Any = None) -> _Stepper:
    """A kvtrace Session as bench runs it: a greedy step feeds the sampled token back on the device."""
    return _Stepper(session.prefill, session._decode_sampled, session.reset, artifact=artifact, workdir=workdir,
                    device=session.device)


def hf_stepper(model: torch.nn.Module, call: Callable[..., Any] | None = None,
               static_len: int | None = None) -> _Stepper:
    """An HF causal LM (or ``call``, e.g. its compiled form) stepped with a DynamicCache, or a StaticCache of
    ``static_len`` slots; on the model's device."""
    return _hf_stepper(model, call if call is not None else model, static_len)


def _hf_stepper(model: torch.nn.Module, call: Callable[..., Any], static_len: int | None) -> _Stepper:
    from transformers import DynamicCache, StaticCache

    from kvtrace.cache.hf import cache_kwarg_name

    st: dict[str, Any] = {}
    cache_kw = cache_kwarg_name(model)  # transformers 5 spells it cache=; past_key_values= is deprecated
    device = next(model.parameters()).device

    def reset() -> None:
        st["cache"] = StaticCache(config=model.config, max_cache_len=static_len) if static_len else DynamicCache()
        st["pos"] = 0

    def step(ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        ids = ids.to(device)
        pos = torch.arange(st["pos"], st["pos"] + t, device=device).unsqueeze(0)
        # logits_to_keep=1: the last position's logits only, as HF generate computes them
        out = call(input_ids=ids, position_ids=pos, **{cache_kw: st["cache"]}, use_cache=True, return_dict=True,
                   logits_to_keep=1)
        st["pos"] += t
        return out.logits

    reset()
    return _Stepper(step, step, reset, device=device)


def _in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype`` without touching the caller's model (``Module.to`` converts in place)."""
    if all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        return model
    return copy.deepcopy(model).to(dtype)


def _hf_eager(model: torch.nn.Module, max_seq_len: int) -> _Stepper:
    return _hf_stepper(model, model, None)


def _hf_compile(model: torch.nn.Module, max_seq_len: int) -> _Stepper:
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(model)
    s = _hf_stepper(model, compiled, max_seq_len)
    s.recompiles = lambda: max(torch._dynamo.utils.counters["stats"]["unique_graphs"] - 1, 0)
    return s


def _jit(model: torch.nn.Module, max_seq_len: int) -> _Stepper:
    from kvtrace.runtime.jit import jit

    jm = jit(model)
    s = _hf_stepper(model, jm, None)
    s.recompiles = lambda: max(jm.stats.captures - 2, 0)
    return s


# bench's own backends, run on the model object in this process; then every artifact backend (kvtrace.backends)
IN_PROCESS: dict[str, Callable[[torch.nn.Module, int], _Stepper]] = {
    BASELINE: _hf_eager, "hf-compile": _hf_compile, "jit": _jit,
}


def _make(backend: str, model: torch.nn.Module, source: Any, max_seq_len: int, dtype: str,
          load_session: bool = True, device: torch.device | None = None, cuda_graphs: bool = False,
          huge_pages: bool = False,
          artifact: Path | None = None, quant: str = "none", quant_opts: dict[str, Any] | None = None,
          kv_dtype: str = "auto") -> _Stepper:
    """The backend ready to run; for artifact backends with ``load_session=False``, only the built file.
    ``cuda_graphs``: the artifact's session decodes from CUDA graphs; ``artifact``: one already built;
    ``quant``: the artifact's quantized weights (``export``'s ``quant``; ``quant_opts``: its ``quant_group_size``
    and ``quant_head``); ``kv_dtype``: its KV cache storage (``export``'s)."""
    quant_opts = quant_opts or {}
    if backend in IN_PROCESS:
        return IN_PROCESS[backend](model, max_seq_len)
    device = device if device is not None else torch.device("cpu")
    from kvtrace.artifact.archive import load
    from kvtrace.artifact.export import export

    workdir = None
    if artifact is not None:
        path = artifact
    elif source is None:
        import tempfile

        workdir = tempfile.TemporaryDirectory(prefix="kvtrace-bench-")
        path = Path(workdir.name) / f"{backend}.kvt"
        export(model, path, max_seq_len=max_seq_len, dtype=dtype, backend=backend, prefill_logits="last",
               device=device, quant=quant, kv_dtype=kv_dtype, **quant_opts)
    else:
        from kvtrace.artifact.store import cached_artifact

        # load=True: a cached entry that fails its integrity check is rebuilt, as for generate
        path = cached_artifact(source, backend=backend, max_seq_len=max_seq_len, dtype=dtype, load=True,
                               device=device.type, quant=quant, kv_dtype=kv_dtype, **quant_opts).path
    if not load_session:
        def unloaded(*_: Any) -> Any:
            raise RuntimeError("this artifact is measured in another process")

        return _Stepper(unloaded, unloaded, unloaded, artifact=path, workdir=workdir, device=device)
    sess = load(path, device=device, huge_pages=huge_pages).session(cuda_graphs=cuda_graphs)
    return session_stepper(sess, artifact=path, workdir=workdir)


def _generate(s: _Stepper, ids: torch.Tensor, n: int) -> tuple[float, float, list[int]]:
    """Greedy: (prefill seconds, decode tokens/s, new tokens). Each token's id comes back to the host, as in a
    generation (its stop check); on a GPU the clock reads after the device has finished."""
    s.reset()
    sync(s.device)
    t0 = time.perf_counter()
    logits = s.prefill(ids)
    tok = logits[:, -1:].argmax(-1)  # [B, 1] on the device
    toks = [int(tok)]  # waits for prefill
    t1 = time.perf_counter()
    for _ in range(n - 1):
        tok = s.decode(tok)[:, -1:].argmax(-1)
        toks.append(int(tok))
    sync(s.device)
    t2 = time.perf_counter()
    return t1 - t0, (n - 1) / max(t2 - t1, 1e-9), toks


def measure(s: _Stepper, ids: torch.Tensor, new_tokens: int, runs: int, vocab: int = 0,
            sweep: tuple[int, ...] = ()) -> dict[str, Any]:
    """Warm up, then ``runs`` greedy generations of ``new_tokens`` after ``ids`` [1, T]: prefill seconds, decode
    tokens/s per run, the last run's tokens, peak RSS (and the position sweep, when asked)."""
    return _measure(s, ids, new_tokens, runs, vocab, sweep)


def _measure(s: _Stepper, ids: torch.Tensor, new_tokens: int, runs: int, vocab: int,
             sweep: tuple[int, ...]) -> dict[str, Any]:
    """Warm up, then ``runs`` greedy generations (and the position sweep): the numbers of one backend."""
    t0 = time.perf_counter()
    _generate(s, ids, 2)  # warm-up: first call captures/compiles/loads pages
    warm_s = time.perf_counter() - t0
    runs_out = [_generate(s, ids, new_tokens) for _ in range(runs)]
    out = {"warm_s": warm_s, "prefill_s": [x[0] for x in runs_out], "decode_tok_s": [x[1] for x in runs_out],
           "tokens": runs_out[-1][2], "peak_rss_mib": round(_rss_mib(), 1)}
    out["position_sweep"] = _position_sweep(s, vocab, sweep) if sweep else []
    return out


def _worker_main() -> None:
    """Entry point of the measuring process: ``python -c '...; _worker_main()' JOB.json OUT.json``."""
    job = json.loads(Path(sys.argv[1]).read_text())
    from kvtrace.artifact.archive import load

    torch.set_num_threads(job["threads"])
    with torch.inference_mode():
        t0 = time.perf_counter()
        sess = load(job["artifact"], device=job.get("device"), huge_pages=job.get("huge_pages", False)).session(
            cuda_graphs=job.get("cuda_graphs", False))
        s = session_stepper(sess)
        load_s = time.perf_counter() - t0
        res = _measure(s, torch.tensor(job["ids"]), job["new_tokens"], job["runs"], job["vocab"],
                       tuple(job["sweep"]))
    res["warm_s"] += load_s  # a cold start: load + the first generation
    Path(sys.argv[2]).write_text(json.dumps(res))


def _measure_fresh(artifact: Path, ids: torch.Tensor, new_tokens: int, runs: int, vocab: int,
                   sweep: tuple[int, ...], threads: int, device: torch.device | None = None,
                   cuda_graphs: bool = False, huge_pages: bool = False) -> dict[str, Any]:
    """``_measure`` of an artifact's Session in a new Python process (nothing compiled in it before)."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-job-") as d:
        job, out = Path(d) / "job.json", Path(d) / "out.json"
        job.write_text(json.dumps({"artifact": str(artifact), "ids": ids.tolist(), "new_tokens": new_tokens,
                                   "runs": runs, "vocab": vocab, "sweep": list(sweep), "threads": threads,
                                   "device": None if device is None else str(device), "cuda_graphs": cuda_graphs,
                                   "huge_pages": huge_pages}))
        proc = subprocess.run(
            [sys.executable, "-c", "from kvtrace.tools.bench import _worker_main; _worker_main()", str(job), str(out)],
            capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"measuring process exited with {proc.returncode}: {tail}")
        return json.loads(out.read_text())


def _random_ids(vocab: int, n: int, seed: int) -> torch.Tensor:
    """[1, n] token ids away from the special ids at the ends of the vocabulary (when it is big enough)."""
    lo = 10 if vocab > 40 else 0
    return torch.randint(lo, vocab - lo, (1, n), generator=torch.Generator().manual_seed(seed))


def _position_sweep(s: _Stepper, vocab: int, positions: tuple[int, ...], n: int = 16) -> list[tuple[int, float]]:
    """Decode tokens/s over ``n`` steps starting at each context position (prefill brings it there)."""
    out = []
    for pos in positions:
        ids = _random_ids(vocab, pos, seed=pos)
        s.reset()
        tok = s.prefill(ids)[:, -1:].argmax(-1)
        sync(s.device)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = s.decode(tok)[:, -1:].argmax(-1)
            int(tok)  # the id comes back to the host every step, as in a generation
        sync(s.device)
        out.append((pos, round(n / (time.perf_counter() - t0), 2)))
    return out


def sweep_positions(max_seq_len: int, n: int = 16) -> tuple[int, ...]:
    """32, 64, 128, ... up to the last position that leaves room for ``n`` decode steps."""
    last = max_seq_len - n
    pos = [p for p in (32, 64, 128, 256, 512, 1024, 2048, 4096) if p < last]
    return (*pos, last) if last >= 32 else tuple(pos)


def bytes_per_token(model: torch.nn.Module, ctx: int, kv_dtype: str = "auto") -> int:
    """What one decode step must read at context ``ctx``: every weight once plus the live K/V (stored as
    ``kv_dtype`` says)."""
    return _bytes_per_token(model, ctx, kv_dtype)


def _bytes_per_token(model: torch.nn.Module, ctx: int, kv_dtype: str = "auto") -> int:
    return _stored_bytes(model.parameters()) + _kv_bytes(model, ctx, kv_dtype)  # weights + live K/V


def _stored_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` as stored, each storage counted once (tied weights share one)."""
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _kv_bytes(model: torch.nn.Module, ctx: int, kv_dtype: str) -> int:
    """The live K and V of ``ctx`` positions in every layer: [H_kv, ctx, D] each in the model's dtype, or for an
    int8 cache one byte per value plus a scale per token and head ([H_kv, ctx, 1] of ``SCALE_DTYPE``), as the
    CacheSpec declares them."""
    from kvtrace.cache.hf import kv_geometry
    from kvtrace.spec.cache import SCALE_DTYPE

    n_layers, n_kv, head_dim = kv_geometry(model.config)
    if kv_dtype == "int8":
        per_head_token = head_dim * torch.int8.itemsize + getattr(torch, SCALE_DTYPE).itemsize
    else:
        per_head_token = head_dim * next(model.parameters()).element_size()
    return 2 * n_layers * n_kv * ctx * per_head_token


def _quant_bytes_per_token(model: torch.nn.Module, source: Any, quant: str, max_seq_len: int, ctx: int,
                           group_size: int | None = None, head: bool = True, kv_dtype: str = "auto",
                           act: str | None = None) -> int:
    """``_bytes_per_token`` of the model with ``quant``'s weights: every weight of its quantized decoder once, as
    stored (int8 / packed int4 / GGUF blocks and their scales; norms and unquantized tensors in their dtype).
    ``act``: the backend's activations for the scheme (``Backend.quant_activations``); with "int8-asym" the
    linears are ``DynQuantLinear``, counted as XNNPACK stores them (``_xnnpack_bytes``)."""
    from kvtrace.models import quant as q
    from kvtrace.models.registry import make_decoder
    from kvtrace.spec.quant import parse_quant

    decoder = make_decoder(model, max_seq_len=max_seq_len)
    blocks = None
    if quant == "gguf":
        from kvtrace.sources.gguf_blocks import GGUFBlocks
        from kvtrace.sources.resolve import resolve_source

        blocks = GGUFBlocks(resolve_source(source).path)
    spec = parse_quant(quant, group_size, head)
    q.quantize_decoder(decoder, spec if spec is None or act is None else spec.computed_with(act), gguf=blocks)
    kinds = (q.Int8Linear, q.Int4Linear, q.GGUFLinear, q.Int8Embedding, q.GGUFEmbedding)
    tensors = [*decoder.parameters(), *(b for m in decoder.modules() if isinstance(m, kinds) for b in m.buffers())]
    counted = {t.data_ptr() for t in tensors}  # a tied head's int8 table is the embedding's, counted with it
    xnn = sum(_xnnpack_bytes(m) for m in decoder.modules()
              if isinstance(m, q.DynQuantLinear) and m.weight.data_ptr() not in counted)
    return _stored_bytes(tensors) + xnn + _kv_bytes(model, ctx, kv_dtype)


def _xnnpack_bytes(lin: Any) -> int:
    """What XNNPACK reads of a ``DynQuantLinear`` per call: its weights at their bit width (4-bit packed two a byte)
    and scales as its serializer stores them (bf16 per group, float32 per channel); the zero points are not read
    (symmetric); a bias is a parameter, counted with the others."""
    n, k = lin.weight.shape
    return n * k * lin.bits // 8 + lin.scale.numel() * (2 if lin.group_size != k else 4)


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_bench(*, model_source: Any = None, model: torch.nn.Module | None = None,
              backends: tuple[str, ...] = ("hf-eager", "exported", "aoti"), prompt_lens: tuple[int, ...] = (37,),
              new_tokens: int = 128, dtypes: tuple[str, ...] = ("float32",), runs: int = 3,
              max_seq_len: int = 1024, threads: int | None = None, sweep: bool = False,
              fresh_process: bool = True, device: str | torch.device = "cpu", cuda_graphs: bool = False,
              quants: tuple[str, ...] = ("none",), quant_group_size: int | None = None, quant_head: bool = True,
              kv_dtypes: tuple[str, ...] = ("auto",), huge_pages: bool = False,
              progress: Callable[[str], Any] = lambda s: contextlib.nullcontext()) -> dict[str, Any]:
    """Run every (dtype, prompt length, backend, quantization) and return a JSON-able dict with a ``results``
    list.

    ``fresh_process``: measure artifact backends in a new process (see the module docstring).
    ``device``: where every backend runs (the model is moved there on a copy; artifacts are compiled for it).
    ``cuda_graphs``: each artifact backend is measured again with decode replayed from CUDA graphs, from the
    same artifact (rows ``<backend>+graphs``). ``quants``: weight quantizations (``export``'s ``quant``; "none"
    for none) of the artifact backends, one row each, with ``quant_group_size`` / ``quant_head`` as ``export``
    takes them; ``kv_dtypes``: KV cache storages (``export``'s ``kv_dtype``: "auto", "int8") of the artifact
    backends, one row each for every quantization; HF and jit rows run unquantized, with the model's cache,
    only. Each row's bandwidth bound counts the bytes its weights and live K/V take as stored.
    """
    from kvtrace.artifact.export import DTYPES
    from kvtrace.sources.resolve import DEFAULT_MODEL
    from kvtrace.spec.cache import KV_DTYPES
    from kvtrace.spec.device import check_available, concrete

    if model is None and model_source is None:  # the default model, by name: built through the artifact cache
        model_source = DEFAULT_MODEL
    from kvtrace.spec.device import resolve as resolve_device
    from kvtrace.spec.quant import SCHEMES

    quant_opts = {"quant_group_size": quant_group_size, "quant_head": quant_head}
    bad_q = sorted(set(quants) - {"none", *SCHEMES})
    if bad_q:
        raise UsageError(f"unknown quantizations {bad_q}; choose from {['none', *SCHEMES]}")
    bad_kv = sorted(set(kv_dtypes) - {"auto", *KV_DTYPES})
    if bad_kv:
        raise UsageError(f"unknown KV cache storages {bad_kv}; choose from {['auto', *KV_DTYPES]}")

    known = (*IN_PROCESS, *_artifact_backends())
    bad = sorted(set(backends) - set(known))
    if bad:
        raise UsageError(f"unknown backends {bad}; choose from {list(known)}")
    dev = resolve_device(device, what="bench device")
    check_available(dev, f"bench --device {dev}")
    dev = concrete(dev)
    if cuda_graphs and dev.type != "cuda":
        raise UsageError(f"--cuda-graphs needs --device cuda; this bench runs on {dev}")
    if BASELINE not in backends:
        backends = (BASELINE, *backends)
    results: list[BenchResult] = []
    with _threads(threads), torch.inference_mode():
        bw = measure_bandwidth(device=dev)
        for dtype in dtypes:
            if dtype not in DTYPES:
                raise UsageError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
            t0 = time.perf_counter()
            if model is None:
                from kvtrace.sources.load import load_model

                m = load_model(model_source, dtype=DTYPES[dtype]).model.to(dev)
            else:
                m = _on(model, DTYPES[dtype], dev)
            load_s = time.perf_counter() - t0
            for plen in prompt_lens:
                if plen + new_tokens > max_seq_len:
                    raise UsageError(f"prompt {plen} + new tokens {new_tokens} exceed --max-seq-len {max_seq_len}")
                ids = _random_ids(m.config.vocab_size, plen, seed=0)
                ref_tokens: list[int] | None = None
                per_quant: dict[tuple[str, str], int] = {}
                runs_of = [(b, qn, kv) for b in backends
                           for qn in (quants if b in _artifact_backends() else ("none",))
                           for kv in (kv_dtypes if b in _artifact_backends() else ("auto",))]
                for b, qn, kv in runs_of:
                    gc.collect()
                    _reset_peak_rss()
                    s = None
                    fresh = fresh_process and b in _artifact_backends()
                    graph_rows = (False, True) if cuda_graphs and b in _artifact_backends() else (False,)
                    positions = sweep_positions(max_seq_len) if sweep else ()
                    try:
                        label = (f"{b} {dtype}{'' if qn == 'none' else ' ' + qn}{'' if kv == 'auto' else ' kv ' + kv}"
                                 f" prompt {plen}")
                        with progress(f"{label}: build"):
                            t0 = time.perf_counter()
                            s = _make(b, m, model_source if model is None else None, max_seq_len, dtype,
                                      load_session=not fresh, device=dev, quant=qn, quant_opts=quant_opts,
                                      kv_dtype=kv, huge_pages=huge_pages)
                            build_s = time.perf_counter() - t0
                    except Exception as e:  # one backend failing must not hide the others' numbers
                        for graphs in graph_rows:
                            results.append(BenchResult(b + ("+graphs" if graphs else ""), dtype, plen, new_tokens,
                                                       quant=qn, kv_dtype=kv, load_s=round(load_s, 2),
                                                       error=f"{type(e).__name__}: {e}"[:300]))
                        continue
                    for graphs in graph_rows:
                        r = BenchResult(b + ("+graphs" if graphs else ""), dtype, plen, new_tokens, quant=qn,
                                        kv_dtype=kv, load_s=round(load_s, 2))
                        where = "a fresh process" if fresh else "this process"
                        try:
                            with progress(f"{label}{' +graphs' if graphs else ''}: {runs} runs x {new_tokens} "
                                          f"tokens in {where}"):
                                bw_row = [_row_bandwidth(dev, bw)]
                                if fresh:
                                    got = _measure_fresh(s.artifact, ids, new_tokens, runs, m.config.vocab_size,
                                                         positions, torch.get_num_threads(), dev, graphs,
                                                         huge_pages)
                                    r.measured_in = "fresh process"
                                else:
                                    step = s if not graphs else _make(b, m, None, max_seq_len, dtype, device=dev,
                                                                      cuda_graphs=True, artifact=s.artifact,
                                                                      kv_dtype=kv)
                                    got = _measure(step, ids, new_tokens, runs, m.config.vocab_size, positions)
                                bw_row.append(_row_bandwidth(dev, bw))
                            r.compile_s = round(build_s + got["warm_s"], 2)
                        except Exception as e:
                            r.error = f"{type(e).__name__}: {e}"[:300]
                            results.append(r)
                            continue
                        ctx = plen + new_tokens // 2
                        if qn == "none":
                            per_tok = _bytes_per_token(m, ctx, kv)
                        else:
                            act = _activations(b, qn)
                            if (qn, kv, act) not in per_quant:
                                per_quant[qn, kv, act] = _quant_bytes_per_token(m, model_source, qn, max_seq_len, ctx,
                                                                                quant_group_size, quant_head, kv, act)
                            per_tok = per_quant[qn, kv, act]
                        _fill(r, got, fresh, s, bw_row, per_tok)
                        if b == BASELINE:
                            ref_tokens = r.tokens
                        if ref_tokens is not None:
                            mism = [i for i, (a, c) in enumerate(zip(r.tokens, ref_tokens, strict=False)) if a != c]
                            r.tokens_match_eager = not mism
                            r.first_mismatch = mism[0] if mism else None
                        results.append(r)
                    s.close()
                eager = next((x for x in results if x.backend == BASELINE and x.dtype == dtype
                              and x.prompt_len == plen and not x.error), None)
                for x in results:
                    if eager and x.dtype == dtype and x.prompt_len == plen and not x.error:
                        x.vs_hf_eager = round(x.decode_tok_s / eager.decode_tok_s, 2)
    return {
        "bandwidth_gb_s": round(bw, 2),
        "threads": threads or torch.get_num_threads(),
        "huge_pages": huge_pages,
        "torch": torch.__version__,
        "device": str(dev),
        "results": [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in results],
    }


def _fill(r: BenchResult, got: dict[str, Any], fresh: bool, s: _Stepper, bw: list[float], per_tok: int) -> None:
    """A measured row's numbers (``got`` from ``_measure``) and its fraction of the bandwidth bound, reading
    ``per_tok`` bytes per decoded token at the mean of ``bw`` (GB/s, measured before and after the row)."""
    pre = [x * 1e3 for x in got["prefill_s"]]
    dec = got["decode_tok_s"]
    r.prefill_ms, r.prefill_ms_range = statistics.median(pre), (min(pre), max(pre))
    r.decode_tok_s, r.decode_tok_s_range = statistics.median(dec), (min(dec), max(dec))
    r.tokens = got["tokens"]
    r.peak_rss_mib = got["peak_rss_mib"] if fresh else round(_rss_mib(), 1)
    r.position_sweep = [tuple(x) for x in got["position_sweep"]]
    r.recompiles = s.recompiles()
    if s.artifact is not None:
        r.artifact_mib = round(s.artifact.stat().st_size / 2**20, 1)
    r.bytes_per_token = per_tok
    r.bandwidth_gb_s, r.bandwidth_gb_s_range = round(statistics.fmean(bw), 2), (round(min(bw), 2), round(max(bw), 2))
    r.bound_fraction = round(r.decode_tok_s * per_tok / (r.bandwidth_gb_s * 1e9), 3)


def _on(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """``model`` in ``dtype`` on ``device``, converted on a copy when it is not (the caller's stays as it is)."""
    m = _in_dtype(model, dtype)
    if next(m.parameters()).device == device:
        return m
    return (copy.deepcopy(m) if m is model else m).to(device)


def run_cli_bench(args: Any, ui: Any) -> int:
    data = run_bench(
        model_source=args.model,
        backends=tuple(b.strip() for b in args.backends.split(",") if b.strip()),
        prompt_lens=tuple(int(x) for x in str(args.prompt_len).split(",")),
        new_tokens=args.new_tokens,
        dtypes=tuple(d.strip() for d in args.dtype.split(",")),
        quants=tuple(q.strip() for q in args.quant.split(",")),
        quant_group_size=args.quant_group_size,
        quant_head=args.quant_head,
        kv_dtypes=tuple(k.strip() for k in args.kv_dtype.split(",")),
        runs=args.runs,
        max_seq_len=args.max_seq_len,
        threads=args.threads,
        sweep=args.plot is not None,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
        huge_pages=args.huge_pages,
        progress=ui.step,
    )
    if args.plot:
        plot(data, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))
    if ui.out.is_terminal:
        ui.out.print(render(data))
    else:  # piped or logged: rich would squeeze every header into 80 columns ("bac…")
        ui.out.print(render_markdown(data), markup=False, highlight=False, soft_wrap=True)
    return 0 if all(not r["error"] for r in data["results"]) else 1
