"""Backend "aoti" (AOTInductor: one compiled library per program, weights kept outside it; prefill's library,
T symbolic, also serves decode where that is the same computation: ``shares_decode``), and the thin glue over
AOTInductor it shares with kvtrace.jit and "aoti-packed".

Members: ``programs/aoti.pt2``, an AOTInductor package with one model per program. Loading checks the
package's member list (``pt2``), every constant each library reads against the artifact's weights
(dtype and byte size, asked of the library itself) and makes one probe call with AOTInductor's runtime
input checks on, which then stay on for every call.

Glue, two ways in: ``aoti_compile``/``aoti_load`` for packages this process just compiled (kvtrace.jit), via
torch's package loader; ``load_library`` for a compiled model library taken out of an artifact: it
dlopens the one ``.so`` through ``AOTIModelContainerRunnerCpu`` (``...Cuda`` for a library compiled for
CUDA) and nothing else — none of torch's package-loader paths that unpickle weights, constants or custom
objects, and no compiler run.

CUDA: programs captured on a CUDA device compile to CUDA kernels, embedded in the library
(``aot_inductor.embed_kernel_binary``: no kernel files beside it to extract or trust); the weights are
handed over on the device, once. A loaded program (``CompiledProgram``) can make a ``fresh()`` instance of
itself — the same library in its own model container over the same weights — which CUDA-graph capture
uses (``runtime.graphs``): a container records a CUDA event per run and queries it on the next, which is
illegal on an event recorded inside a graph capture, so a captured container is never run directly again.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvtrace._errors import ArtifactError, CaptureError
from kvtrace.backends import one_row, pt2, tempcopy
from kvtrace.backends.base import Backend, FileMember, Program

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtrace.spec.manifest import Manifest
    from kvtrace.spec.program import ProgramSpec

__all__ = ["AOTI", "CHECK_INPUTS_ENV", "PACKAGE", "AotiBackend", "CompiledProgram", "aoti_compile", "aoti_load",
           "compiled_constants", "load_library", "shares_decode", "weights_of"]

T = TypeVar("T")

PACKAGE = "programs/aoti.pt2"  # the artifact member holding the package

# The generated run_impl checks every input's dtype, static sizes, symbolic-size bounds and static strides
# against what it was compiled for, and raises instead of reading out of bounds, when this variable is set
# at the library's *first* call (it is read once per library). load_library's probe call latches it on.
CHECK_INPUTS_ENV = "AOTI_RUNTIME_CHECK_INPUTS"
# "0": a CUDA program's kernel binaries stay beside its library instead of inside it. They are then not in the
# artifact: the library loads them from where this process compiled them, so such an artifact runs only on this
# machine while Inductor's output folder exists — a fallback for measuring on a torch whose embedding fails.
EMBED_KERNELS_ENV = "KVTRACE_AOTI_EMBED_KERNELS"


# Artifact compiles never come from Inductor's compile caches. Two cache hits returned programs built for
# another graph: a packed SmolLM2 bf16 program with wrong prepacked weights (logits off by 147), and a
# tiny Llama decode program taking key_pos [L] whose index bounds belonged to another max_seq_len
# (compiled for 24 slots, run with 40: "index out of bounds: 0 <= tmp7 < 24L"; heap corruption in
# another case). A fresh compile is right in both; an artifact is compiled once, then kvtrace's own
# artifact cache serves it.
EXPORT_NO_CACHE = {"force_disable_caches": True}


def inductor_options(packed: bool = False, dtype: torch.dtype | None = None, device_type: str = "cpu",
                     rows: bool = False, quantized: bool = False) -> dict[str, Any]:
    """Inductor settings kvtrace compiles with (one place, reported by bench).

    Default: weights stay outside the .so; they are loaded from the model / artifact once.
    ``packed``: the weights are embedded in the compiled library (one program holds its own weights) and,
    but for one-row fp32 on Intel, frozen: folded as constants and prepacked for the matmul kernels
    (compiled under ``no_grad``, see ``_aot_compile``: else Inductor does not freeze).
    How its CPU matmuls run, measured on SmolLM2 on a 2-vCPU Intel (AMX) machine, each pair in one process,
    alternated (stop 33):

    - bf16/fp16: max-autotune over Inductor's CPU GEMM templates (AMX micro-kernels on frozen, prepacked
      weights) and ATen, per matmul: decode 85.3 tokens/s vs 55.2 for the same templates unfrozen (62.6-64.5
      unfrozen with the originals' copies pruned by hand: two alternated pairs).
    - fp32, one row (``rows`` False: a batch-1 program): not frozen, the weights embedded as they are and
      ATen's MKL matmuls over them: 44.7 tokens/s, prefill 55.2 ms (frozen without prepacking 45.4 / 56.9);
      oneDNN-prepacked 38.5 / 53.6 ms; the frozen templates 46.4 / 84.6 ms (their prefill loses).
    - fp32, ``rows`` (a program over several cache rows: ``--slots``, ``batch_size`` > 1): frozen and
      oneDNN-prepacked. A decode step over R rows: 26.5 ms at R=1, 35.3 ms at R=8, vs 22.7 / 51.5 ms for MKL on
      unpacked weights (MKL's fp32 GEMM at M >= 4 rows runs at half the bandwidth) and 22.2 / 42.8 ms for
      the templates: 8 conversations decode 1.5x faster than without packing, one 15 % slower, so aoti-packed
      packages such a program also compiled as for one row and runs its one-row calls on that
      (``aoti_packed.ONE_ROW``).
    - fp32 on AMD CPUs (``_cpu_vendor()``), whatever the rows: the templates, where MKL's fp32 GEMV streams
      ~11-13 GB/s of a 36 GB/s machine (the 49152x576 head: 10.4 ms vs the template's 3.6 ms): decode
      54.7-61.9 tokens/s vs `aoti` 23.1-24.6 (measured unfrozen, stop 2x; frozen unmeasured on AMD).

    - quantized weights (``quantized``: the program calls torch's CPU weight-only matmuls, ``woq_program``),
      whatever the dtype: frozen and compiled over the templates alone, so ``_weight_int8pack_mm`` (int8, and the
      int8 head of int4 / 8da4w) runs on their AMX / VNNI micro-kernels over prepacked int8 weights. SmolLM2
      on the same Intel machine, fresh processes, alternated (stop 35), decode tokens/s / prefill ms of 37
      tokens: int8 93.3 / 19.0 vs 74.6 / 71.4 unfrozen; int4 129.1 / 60.3 vs 112.1 / 61.3 (its int4 matmuls
      stay ``quantized.int4mm_packed_weight_cpu``: Inductor's int4 template, over the aten op, measured
      109.2 / 78.1). fp32 ``aoti`` in that run: 44.2 / 57.7.

    ``dtype`` None: float32. ``device_type`` "cuda": the kernels are embedded in the library (packed CUDA
    programs freeze only: no GPU autotuning is set up, and none is measured).
    """
    import torch

    if packed:
        opts: dict[str, Any] = {
            "freezing": True,
            "aot_inductor.package_constants_in_so": True,
        }
        low_precision = dtype in (torch.bfloat16, torch.float16)
        if device_type == "cpu" and (low_precision or quantized or _cpu_vendor() == "AuthenticAMD"):
            opts.update({
                "max_autotune": True,
                # quantized: the templates only. Autotuning picks by timing, and a build on a busy machine (its
                # programs compile side by side) let ATen's weight-only kernels win some of SmolLM2's int8
                # matmuls: prefill 68-134 ms and decode 55-61 tokens/s against 25-35 ms and 90-99 with the
                # templates (stop 39, alternated in one process).
                "max_autotune_gemm_backends": "CPP" if quantized else "CPP,ATEN",
                "autotune_num_choices_displayed": 0,  # no per-matmul benchmark tables on stderr
                "max_autotune_report_choices_stats": False,
            })
        elif device_type == "cpu" and not rows:
            # Not frozen: the weights embedded as they are, ATen's MKL matmuls over them. (Freezing with
            # cpp.weight_prepack off measured the same, but that flag is read once per process, when Inductor
            # first registers its freezing patterns: after it, a later compile in the process could not prepack,
            # and the bench's slots artifact, built after the batch-1 one, came out unpacked.)
            opts["freezing"] = False
    else:
        opts = {"aot_inductor.package_constants_in_so": False}
    if device_type == "cuda" and os.environ.get(EMBED_KERNELS_ENV, "1") != "0":
        opts[_embed_kernels_option()] = True
    return opts


@functools.cache
def _cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _embed_kernels_option() -> str:
    """The Inductor option that puts a CUDA program's kernel binaries inside its library (torch renamed it)."""
    import torch
    import torch._inductor.config as cfg

    for name in ("embed_kernel_binary", "embed_cubin"):
        if hasattr(cfg.aot_inductor, name):
            return f"aot_inductor.{name}"
    raise CaptureError(f"this torch ({torch.__version__}) has no aot_inductor.embed_kernel_binary option; kvtrace "
                       "needs it to keep CUDA kernels inside the compiled library")


def export_options(packed: bool, dtype: torch.dtype, device_type: str = "cpu", int8_cache: bool = False,
                   rows: bool = False, quantized: bool = False, exact_casts: bool = False) -> dict[str, Any]:
    """What an artifact's programs are compiled with: ``inductor_options`` without Inductor's caches.

    ``rows``: the program runs over several cache rows; ``quantized``: over quantized weights (``inductor_options``).
    ``int8_cache`` (the program takes int8 state: an int8 KV cache) adds ``emulate_precision_casts``: the
    cache stores each scale rounded to its dtype and eager divides by that rounded scale, but Inductor, fusing
    the quantize, divides by the unrounded one unless it emulates the cast. Measured on a 4-layer tiny Llama
    (40-token prefill, aoti vs eager, both int8): without it 0.55-0.94 % of the int8 K values and up to 3.75 %
    of the scales differ from eager's, from layer 0 on; with it none in any layer, logits within 1.5e-7. Deeper
    layers of a deep model still see ulp-level differences of their inputs, which flip a rounding now and then
    (the 30-layer SmolLM2: logits 0.2-0.5 from eager int8; README, int8 KV cache).

    ``exact_casts`` (a weight-only-quantized program whose one-row int8 matmuls become reductions,
    ``one_row.rewrite``) adds it too: the kernel takes its input rounded to bf16 and rounds its output, and so does
    eager's reference, but Inductor, fusing the casts into the reduction, dropped both round trips (float32 all
    through: a silent difference from what the prefill kernel and the reference compute)."""
    # check_lowerbound off: export specializes sizes 0/1, so T and L get a compiled lower bound of 2 that
    # the runtime input checks (on for artifacts, see CHECK_INPUTS_ENV) would enforce on 1-token prefills.
    # The wrapper (the ~600 KB of C++ that calls the kernels, one per program) at -O0: g++ takes ~40 % less
    # time on it (SmolLM2 decode: 62 -> 37 s with other jobs on the machine) and decode is as fast (8.4 vs 8.5
    # tokens/s, one thread, the same run); the kernels keep Inductor's -O3.
    # (CPU programs; a CUDA program's wrapper keeps Inductor's default, unmeasured on a GPU.)
    opts = {**inductor_options(packed, dtype, device_type, rows, quantized), **EXPORT_NO_CACHE, "aot_inductor.check_lowerbound": False}
    if device_type == "cpu":
        opts["aot_inductor.compile_wrapper_opt_level"] = "O0"
    if int8_cache or exact_casts:
        opts["emulate_precision_casts"] = True
    return opts


@contextlib.contextmanager
def uncached(enabled: bool, scratch: Path) -> Iterator[None]:
    """Inductor's compile caches off (``EXPORT_NO_CACHE``), its files written under ``scratch`` (the caller's temp
    dir, which it removes) — nothing if not ``enabled``. With the caches off, Inductor writes each compile into a
    fresh directory under its cache dir and never deletes it: every artifact compile left ~4.5 MB per program in
    /tmp/torchinductor_$USER, ~530 MB for packed SmolLM2 (its weights inside the library) — 4.5 GB on this
    machine after a day of tests. The vector-ISA probe (``probe_vec_isa``) and precompiled headers stay in the
    real cache dir: they describe the machine, not a graph."""
    if not enabled:
        yield
        return
    import torch
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with temporary_cache_dir(str(scratch)), torch.compiler.config.patch(**EXPORT_NO_CACHE):
        yield


def _aot_compile(ep: torch.export.ExportedProgram, options: dict[str, Any], one_rows: bool = False) -> list[str] | str:
    """``torch._inductor.aot_compile`` of ``ep`` with ``options``, under ``torch.no_grad()``: Inductor freezes
    (folds the weights as constants, prepacks them for oneDNN, prunes the originals) only when grad mode is
    off (``compile_fx``: ``config.freezing and not torch.is_grad_enabled()``); with it on, ``freezing`` did
    nothing but embed the weights (``package_constants_in_so``), and every matmul ran ATen's plain mm.
    ``one_rows``: its one-row linears compiled as reductions (``one_row.rewrite``)."""
    import torch

    from kvtrace.capture.export import _example_args

    gm = ep.module()
    if one_rows:
        one_row.rewrite(gm)
    if options.get("freezing") and options.get("aot_inductor.package_constants_in_so"):
        _flatten_constant_names(gm)
    with torch.no_grad():
        return torch._inductor.aot_compile(gm, _example_args(ep), options=options)


def _flatten_constant_names(gm: torch.fx.GraphModule) -> None:
    """Every ``get_attr`` of a submodule's tensor (``layers.0.wqkv.weight``) re-pointed at the same tensor held by
    ``gm`` itself under the name Inductor gives it (``layers_0_wqkv_weight``), in place.

    Why: a frozen program's GEMM templates prepack each constant weight into a new constant and then drop the
    original (``cpp_gemm_template.prune_tensors``) only if a ``get_attr`` node's target equals the constant's
    name. Parameters are renamed by freezing and match; buffers keep their dotted targets and never do, so
    the library kept every original beside its packed copy: the quantized modules' int8 / int4 weights are
    buffers, and SmolLM2 int8 aoti-packed (templates) came out at 274 MB of library for 128 MB of weights,
    with this 147 MB. Only for programs whose weights are embedded (the names then stay inside the library;
    an unembedded one's constants are matched to the artifact's weights by their dotted names)."""
    import torch

    for node in gm.graph.find_nodes(op="get_attr"):
        target = str(node.target)
        if "." not in target:
            continue
        flat = target.replace(".", "_")
        owner, _, leaf = target.rpartition(".")
        value = getattr(gm.get_submodule(owner), leaf)
        if hasattr(gm, flat) and getattr(gm, flat) is not value:
            raise CaptureError(f"cannot flatten constant {target!r}: the program already has another {flat!r}")
        if isinstance(value, torch.nn.Parameter):
            gm.register_parameter(flat, value)
        else:
            gm.register_buffer(flat, value)
        node.target = flat
    gm.recompile()


def probe_vec_isa() -> None:
    """Which vector ISAs this machine's compiler builds and loads (Inductor asks once per process): asked
    *with* Inductor's on-disk cache, before a compile that runs without it (EXPORT_NO_CACHE), so the probe
    builds (six g++ runs and dlopen probes, ~20 % of a cold compile on a busy machine) are made once per
    machine, not once per program. They describe the machine and compiler, never a graph."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list()


def aoti_compile(ep: torch.export.ExportedProgram, package_path: str | os.PathLike[str]) -> Callable[..., Any]:
    """Compile ``ep`` ahead of time into a package at ``package_path`` and load it, with the ExportedProgram's own
    weights attached. Where ``one_row.wanted`` says so for the dtype holding most of its weight bytes (a CPU
    program on AMD: kvtrace.jit's decode programs), its one-row linears are compiled as reductions."""
    import torch
    from torch._inductor.package import package_aoti

    weights = weights_of(ep)
    devices = {t.device.type for t in weights.values()}
    if not one_row.wanted(one_row.dominant_dtype(weights.values()), devices.pop() if len(devices) == 1 else "",
                          _cpu_vendor()):
        path = torch._inductor.aoti_compile_and_package(
            ep, package_path=os.fspath(package_path), inductor_configs=inductor_options()
        )
        return aoti_load(path, weights=weights)
    files = _aot_compile(ep, {**inductor_options(), "aot_inductor.package": True}, one_rows=True)
    package_aoti(os.fspath(package_path), {"model": _package_files(files)})
    return aoti_load(package_path, weights=weights)


def weights_of(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Every tensor a program reads besides its inputs: parameters, buffers and lifted constants, by name."""
    import torch

    out: dict[str, torch.Tensor] = dict(ep.state_dict)
    out.update({k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)})
    return out


def aoti_load(path: str | os.PathLike[str], weights: dict[str, torch.Tensor], model_name: str = "model") -> Callable[..., Any]:
    """Load a compiled package and hand it the weights by reference (no copy)."""
    from torch._inductor.package import load_package

    runner = load_package(os.fspath(path), model_name)
    missing = [k for k in runner.get_constant_fqns() if k not in weights]
    if missing:
        raise KeyError(f"compiled program needs weights the caller did not provide: {missing[:5]}")
    runner.load_constants(
        {k: weights[k] for k in runner.get_constant_fqns()}, check_full_update=True, user_managed=True
    )
    return _FlatRunner(runner)


def compiled_constants(so_path: str | os.PathLike[str],
                       device: str = "cpu") -> dict[str, tuple[torch.dtype | None, int]]:
    """What a compiled model library reads besides its inputs: original FQN -> (dtype, bytes), asked of the
    library itself through AOTInductor's C ABI (interface.h), not of any file next to it. Constants folded
    at compile time are left out (the library computes them). The dtype is None for one torch cannot name.
    ``device``: the device its container is created on (``"cuda:0"`` for a library compiled for CUDA)."""
    lib = ctypes.CDLL(os.fspath(so_path))
    size_t, handle = ctypes.c_size_t, ctypes.c_void_p()

    def call(fn: str, *args: Any) -> None:
        if getattr(lib, fn)(*args) != 0:
            raise RuntimeError(f"{fn} failed in {Path(so_path).name}")

    call("AOTInductorModelContainerCreateWithDevice", ctypes.byref(handle), size_t(1), str(device).encode(), None)
    try:
        n = size_t()
        call("AOTInductorModelContainerGetNumConstants", handle, ctypes.byref(n))
        codes = _dtype_codes()
        out: dict[str, tuple[torch.dtype | None, int]] = {}
        for i in range(n.value):
            fqn, code, nbytes, folded = ctypes.c_char_p(), ctypes.c_int32(), size_t(), ctypes.c_bool()
            call("AOTInductorModelContainerGetConstantFromFolded", handle, size_t(i), ctypes.byref(folded))
            if folded.value:
                continue
            call("AOTInductorModelContainerGetConstantOriginalFQN", handle, size_t(i), ctypes.byref(fqn))
            call("AOTInductorModelContainerGetConstantDtype", handle, size_t(i), ctypes.byref(code))
            call("AOTInductorModelContainerGetConstantDataSize", handle, size_t(i), ctypes.byref(nbytes))
            out[(fqn.value or b"").decode(errors="replace")] = (codes.get(code.value), nbytes.value)
        return out
    finally:
        lib.AOTInductorModelContainerDelete(handle)
        _ctypes.dlclose(lib._handle)  # ctypes never unloads; the runner holds its own reference


@functools.cache
def _dtype_codes() -> dict[int, torch.dtype]:
    """AOTInductor's dtype codes (``aoti_torch_dtype_<name>()`` of libtorch's C shim) -> torch dtypes."""
    import torch

    shim = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    names = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
    return {getattr(shim, f"aoti_torch_dtype_{n}")(): getattr(torch, n) for n in names}


def _runner(so_path: str | os.PathLike[str], device: torch.device) -> Any:
    """torch's container runner for a library compiled for ``device``'s type."""
    import torch

    if device.type == "cuda":
        cls = getattr(torch._C._aoti, "AOTIModelContainerRunnerCuda", None)
        if cls is None:
            raise ArtifactError(f"this torch ({torch.__version__}) was built without CUDA, so it cannot run a program "
                                "compiled for CUDA; install a CUDA build of torch")
        return cls(os.fspath(so_path), 1, str(device))
    # A frozen bf16 program's GEMM templates may use AMX tiles, which Linux lets a process use only once it
    # asked (arch_prctl XCOMP_PERM); Inductor asks in the process that compiles, not in one that loads, and an
    # AMX instruction there dies of SIGILL (measured: SmolLM2 bf16 aoti-packed, frozen, in a fresh process).
    # torch's own request; False (nothing done) on a CPU without AMX.
    torch._C._cpu._init_amx()
    return torch._C._aoti.AOTIModelContainerRunnerCpu(os.fspath(so_path), 1)


MADV_PAGEOUT = 21  # linux/mman.h (Linux >= 5.4)


def _page_out(so_path: str | os.PathLike[str]) -> int:
    """Ask Linux to reclaim the resident pages of ``so_path``'s mappings in this process; the bytes asked for.

    An AOTInductor CPU container copies the constants a library embeds (aoti-packed: every weight, prepacked) into
    its own buffer when it is created, reading the library's mapped section once: those pages would stay resident,
    as much again as the weights, never read again. MADV_PAGEOUT is reclaim, not discard: a page read later comes
    back from the file (a clean one) or from where reclaim wrote it (one written since), so no mapping changes
    contents. Best effort: 0 where it is not available (not Linux, an older kernel)."""
    target = os.path.realpath(so_path)
    try:
        with open("/proc/self/maps") as f:
            spans = [tuple(int(x, 16) for x in line.split(None, 1)[0].split("-"))
                     for line in f if line.rstrip("\n").endswith(" " + target)]
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return sum(end - start for start, end in spans if madvise(start, end - start, MADV_PAGEOUT) == 0)


def load_library(so_path: str | os.PathLike[str], weights: dict[str, torch.Tensor] | None,
                 probe: Sequence[torch.Tensor], device: torch.device | None = None
                 ) -> tuple[Callable[..., list[torch.Tensor]], list[torch.Tensor]]:
    """Load one compiled model library; hand it ``weights`` by reference (None: its weights are frozen
    inside), then call it once on ``probe`` with the runtime input checks on (CHECK_INPUTS_ENV), which
    stay on for every later call. The caller has checked ``weights`` against ``compiled_constants``.
    ``device``: what the library was compiled for (default CPU); weights and probe live there.
    Returns (the callable, the probe's outputs). Raises RuntimeError (the library's own message) when the
    probe's inputs are not what it was compiled for.
    """
    import torch

    runner = _runner(so_path, device if device is not None else torch.device("cpu"))
    _page_out(so_path)  # the runner copied the library's frozen weights out of it: their pages are read no more
    if weights is not None:
        names = runner.get_constant_names_to_original_fqns()  # internal name -> FQN
        runner.update_constant_buffer({n: weights[f] for n, f in names.items()}, False, True, True)
    flat = _FlatRunner(runner, runner.run)
    previous = os.environ.get(CHECK_INPUTS_ENV)
    os.environ[CHECK_INPUTS_ENV] = "1"  # read by this library's first call only; restored right after
    try:
        outputs = flat(*probe)
    finally:
        if previous is None:
            os.environ.pop(CHECK_INPUTS_ENV, None)
        else:
            os.environ[CHECK_INPUTS_ENV] = previous
    return flat, outputs


class _FlatRunner:
    """Calls the compiled model with a flat list of tensors (skips pytree work on the hot path)."""

    def __init__(self, runner: Any, run: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None):
        self.runner = runner
        self._run = run if run is not None else runner.loader.boxed_run

    def __call__(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        # The compiled kernels index inputs with the strides of the (contiguous) example tensors and
        # do not check them: a strided view (a sliced position_ids, a cropped cache) gives wrong numbers.
        for i, t in enumerate(flat):
            if not t.is_contiguous():
                raise ValueError(
                    f"compiled program argument {i} (shape {tuple(t.shape)}, strides {t.stride()}) is not "
                    "contiguous; pass .contiguous() tensors"
                )
        return self._run(list(flat))


class CompiledProgram:
    """A loaded compiled program as the Session calls it: ``(*flat inputs) -> logits [B, T, V]``.

    ``fresh()`` loads the same library again, into its own model container over the same weights, and
    probes it like the first (CUDA-graph capture runs one per graph; see the module docstring)."""

    def __init__(self, run: Callable[..., list[torch.Tensor]],
                 reload: Callable[[], Callable[..., list[torch.Tensor]]] | None = None):
        self._run = run
        self._reload = reload  # another ``run`` over a new container (None: the library cannot be loaded again)

    def __call__(self, *flat: torch.Tensor) -> torch.Tensor:
        return self._run(*flat)[0]  # AOTInductor returns a list; a Decoder program has exactly one output

    def fresh(self) -> CompiledProgram:
        if self._reload is None:
            raise ArtifactError("this compiled program cannot be loaded again (its library was not kept)")
        return CompiledProgram(self._reload(), self._reload)

# --- compiling several programs at once ----------------------------------------------------------
# Each program compiles in its own process (spawned, not forked: the parent's OpenMP state is not
# fork-safe), so prefill and decode share the cores: Inductor's code generation is single-threaded
# Python and each program's C++ compile one g++ process. The captured program travels through a temp
# file (torch.export.save/load; written and read by this build only).
PARALLEL_COMPILE = True


def _compile_in_processes(eps: dict[str, torch.export.ExportedProgram], opts: dict[str, dict[str, Any]],
                          no_cache: bool, tmp: Path, one_rows: bool = False) -> dict[str, list[str]]:
    """Program name -> the files ``aot_compile`` wrote, each program compiled in a child process at once.

    The programs share their weights: those are written once (safetensors, memory-mapped by every child:
    one copy in the page cache), each program's graph and example inputs on their own (torch's serializer,
    as the ``exported`` backend stores programs)."""
    import subprocess
    import sys

    import torch
    from safetensors.torch import save_file
    from torch._export.serde.serialize import serialize

    weights: dict[str, torch.Tensor] = {}
    for ep in eps.values():
        weights.update(weights_of(ep))
    stored: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    unique, aliases = {}, {}
    for name, t in sorted(weights.items()):  # tied weights once (safetensors refuses shared storage)
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key in stored:
            aliases[name] = stored[key]
        else:
            stored[key] = name
            unique[name] = t.detach().contiguous()
    save_file(unique, str(tmp / "weights.safetensors"))
    procs = {}
    try:
        for name, ep in eps.items():
            art = serialize(ep, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=True)
            (tmp / f"{name}.json").write_bytes(art.exported_program)
            (tmp / f"{name}.inputs").write_bytes(art.example_inputs)
            job = tmp / f"{name}.job.json"
            job.write_text(json.dumps({"program": str(tmp / f"{name}.json"), "inputs": str(tmp / f"{name}.inputs"),
                                       "weights": str(tmp / "weights.safetensors"), "aliases": aliases,
                                       "options": opts[name], "no_cache": no_cache, "one_rows": one_rows,
                                       "threads": torch.get_num_threads(),
                                       "out": str(tmp / f"{name}.files.json")}))
            procs[name] = subprocess.Popen(  # started at once: it loads while the next program is written
                [sys.executable, "-c", "from kvtrace.backends.aoti import _compile_worker; _compile_worker()",
                 str(job)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        files = {}
        for name, proc in procs.items():
            _, err = proc.communicate()
            out = tmp / f"{name}.files.json"
            if proc.returncode != 0 or not out.is_file():
                tail = (err.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"compiling program {name} in a child process failed ({proc.returncode}): {tail}")
            files[name] = json.loads(out.read_text())
        return files
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _compile_worker() -> None:
    """A child of ``_compile_in_processes``: ``python -c '...; _compile_worker()' JOB.json``."""
    import sys

    import torch
    from safetensors.torch import load_file
    from torch._export.serde.serialize import SerializedArtifact, deserialize

    from kvtrace.backends.exported import _program_weight_names

    job = json.loads(Path(sys.argv[1]).read_text())
    # Inductor specializes each CPU kernel's OpenMP loop for torch.get_num_threads() at code generation (unless
    # cpp.dynamic_threads): the child takes the parent's count, so its programs use as many threads as the
    # serial compile's would. (It set 1 here once: every Inductor kernel of an artifact built in parallel was
    # single-threaded; the matmuls, ATen's, kept their threads, so SmolLM2 fp32 decode barely moved.)
    torch.set_num_threads(job["threads"])
    blob = Path(job["program"]).read_bytes()
    weights = load_file(job["weights"])
    weights.update({alias: weights[name] for alias, name in job["aliases"].items()})
    names = _program_weight_names(json.loads(blob))
    state_dict: dict[str, torch.Tensor] = {n: weights[n] for n in names["buffers"]}
    state_dict.update({n: torch.nn.Parameter(weights[n], requires_grad=False) for n in names["params"]})
    constants = {n: weights[n] for n in names["constants"]}
    ep = deserialize(SerializedArtifact(blob, state_dict, constants, Path(job["inputs"]).read_bytes()))
    probe_vec_isa()
    out = Path(job["out"])
    with uncached(job["no_cache"], out.parent / f"{out.name}.inductor"):  # under the parent's temp dir
        files = _aot_compile(ep, job["options"], job.get("one_rows", False))
    out.write_text(json.dumps(files))


# --- the backend ----------------------------------------------------------------------------------
_LOADED_SUFFIXES = (".so", ".cpp", ".json")  # what kvtrace keeps of aot_compile's files (``pt2.libraries``)

# Backend "aoti" compiles one program, prefill's (T symbolic), and serves decode with it at T = 1, for every
# decoder where that is the same computation (``shares_decode``): decode's ProgramSpec says
# ``served_by="prefill"`` and the manifest signs one program. Measured on SmolLM2 fp32 (2 vCPU AMD, 2 threads,
# alternated in one session): cold export 52.8 / 54.2 s vs 63.8 / 65.0 s for two programs compiled in parallel
# processes (capture 5.3 vs 8.0 s, compile 42-43 vs 51 s; 53 vs 96 CPU-s: a tiered start's background compile
# leaves the streaming decode a core), decode median 15.5 vs 15.7 tokens/s over 8 alternations in one process
# (within the noise), logits bit-identical over a prefill and 64 decodes. False: every program compiled on its own (artifacts of
# kvtrace <= 0.4 were; they load as they are).
SHARED_DECODE = True


def _rows(ep: torch.export.ExportedProgram) -> bool:
    """Whether ``ep`` runs over several cache rows: its tokens (the first input, [B or R, T]) have a first
    dimension other than a static 1 (a slots program's symbolic R, a batch_size > 1 program's B)."""
    first = ep.graph_signature.user_inputs[0]
    [node] = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name == first]
    b = node.meta["val"].shape[0]
    return not (isinstance(b, int) and b == 1)


# torch's CPU weight-only-quantized matmuls (kvtrace.models.quant's Int8Linear, Int4Linear, the int8 head)
WOQ_OPS = ("aten._weight_int8pack_mm", "aten._weight_int4pack_mm_for_cpu", "quantized.int4mm_packed_weight_cpu")


def woq_program(ep: torch.export.ExportedProgram) -> bool:
    """Whether ``ep`` calls one of torch's CPU weight-only-quantized matmuls (``WOQ_OPS``)."""
    return any(n.op == "call_function" and any(str(n.target).startswith(op + ".") for op in WOQ_OPS)
               for n in ep.graph.nodes)


def _same_call(a: ProgramSpec, b: ProgramSpec) -> bool:
    """Whether two programs take the same inputs the same way (all but their token count): one library can run both."""
    return (a.method, a.inputs, a.key_pos, a.slots) == (b.method, b.inputs, b.key_pos, b.slots)


# The share of a decoder's weight bytes in one_row.reducible modules from which its decode gets a program of its own
# with its one-row linears as reductions (where one_row.wanted): SmolLM2 int4 weights, whose int8 head is 28 % of the
# bytes, decode at 155 tokens/s so against 124.7 on the shared program (stop 47, alternated).
OWN_DECODE_SHARE = 0.2


def shares_decode(programs: Sequence[ProgramSpec], decoder: torch.nn.Module) -> bool:
    """Whether ``decoder``'s one-token decode can run on its prefill program: exactly a T-symbolic prefill and a
    one-token decode that agree on method, inputs, key_pos and slots (not slot programs: unmeasured), on a
    CPU, over plain tensors, with no module whose computation changes at one token (``one_token_path``: e.g.
    GGUF-native linears, whose decode is a fused pass over the blocks). A quantized tensor subclass (torchao)
    or a CUDA decoder keeps two programs: their kernels may be chosen by the token count, and it is unmeasured."""
    import torch

    from kvtrace.capture.export import device_of

    by_name = {p.name: p for p in programs}
    if sorted(by_name) != ["decode", "prefill"]:
        return False
    pre, dec = by_name["prefill"], by_name["decode"]
    if (pre.single_token or not dec.single_token or pre.once or dec.once or pre.slots or pre.served_by
            or not _same_call(pre, dec)):
        return False
    if device_of(decoder).type != "cpu" or any(getattr(m, "one_token_path", False) for m in decoder.modules()):
        return False
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(type(t) in plain for t in (*decoder.parameters(), *decoder.buffers()))


class AotiBackend(Backend):
    """One AOTInductor model per compiled program, in one package; ``packs_weights``: frozen weights."""

    @property
    def compile_label(self) -> str:
        return f"compiling with AOTInductor ({self.name})"

    def program_specs(self, programs: tuple[ProgramSpec, ...], decoder: torch.nn.Module) -> tuple[ProgramSpec, ...]:
        """As declared; decode ``served_by="prefill"`` where prefill's program serves it (``shares_decode``) and
        its one-row linears are not compiled as reductions of their own (``one_row``: on a CPU where
        ``one_row.wanted``, a decoder with at least ``OWN_DECODE_SHARE`` of its weight bytes in modules
        ``one_row.reducible``: plain ``nn.Linear``, int8 linears, e.g. the int8 head of int4 weights)."""

        from kvtrace.capture.export import device_of

        reductions = (self.one_row_reductions(decoder.cache_spec.torch_dtype, {device_of(decoder).type})
                      and one_row.weight_share(decoder, one_row.reducible) >= OWN_DECODE_SHARE)
        if not SHARED_DECODE or reductions or not shares_decode(programs, decoder):
            return programs
        return tuple(dataclasses.replace(p, served_by="prefill") if p.name == "decode" else p for p in programs)

    def compiled(self, programs: Mapping[str, T], signed: Collection[str] | None = None) -> dict[str, T]:
        """Every program served by no other (``ProgramSpec.served_by``), by its name."""
        return {n: p for n, p in programs.items() if getattr(p, "served_by", None) is None}

    def check_manifest(self, path: Path, manifest: Manifest) -> None:
        """A program served by another: that one exists, is T-symbolic, is served by none, and agrees with it."""
        programs = manifest.programs
        for name, p in programs.items():
            if p.served_by is None:
                continue
            host = programs.get(p.served_by)
            if (host is None or host.served_by is not None or host.single_token or not p.single_token
                    or not _same_call(host, p)):
                raise ArtifactError(f"{path}: program {name} is served by {p.served_by!r}, which the manifest does "
                                    "not declare as a T-symbolic program agreeing with it (method, inputs, key_pos, "
                                    "slots); the artifact is inconsistent, re-export it")

    def compile(self, eps: dict[str, torch.export.ExportedProgram], dtype: torch.dtype) -> dict[str, bytes]:
        import torch
        from torch._inductor.package import package_aoti

        from kvtrace.capture.export import _example_args

        device_types = {_example_args(ep)[0].device.type for ep in eps.values()}  # tokens: where captured
        one_rows = self.one_row_reductions(dtype, device_types)

        def options(name: str, ep: torch.export.ExportedProgram, rows: bool) -> dict[str, Any]:
            args = _example_args(ep)  # tokens first: where the program was captured; int8 state: an int8 cache
            woq = woq_program(ep)
            return {**export_options(self.packs_weights, dtype, args[0].device.type,
                                     int8_cache=any(a.dtype == torch.int8 for a in args), rows=rows,
                                     quantized=woq, exact_casts=one_rows and woq),
                    "aot_inductor.package": True, "aot_inductor.model_name_for_generated_files": name}

        opts = {name: options(name, ep, _rows(ep)) for name, ep in eps.items()}
        for name, of in self.one_row_variants.items():
            one = options(name, eps[of], rows=False)
            if {**one, "aot_inductor.model_name_for_generated_files": of} != opts[of]:  # compiled differently
                eps, opts = {**eps, name: eps[of]}, {**opts, name: one}
        with tempfile.TemporaryDirectory(prefix="kvtrace-export-") as tmp:
            if len(eps) > 1 and PARALLEL_COMPILE and (os.cpu_count() or 1) > 1 and device_types == {"cpu"}:
                files = _compile_in_processes(eps, opts, self.no_compile_cache, Path(tmp), one_rows)
            else:  # one after another (CUDA programs too: a child would get the weights on the CPU)
                probe_vec_isa()
                files = {}
                for name, ep in eps.items():
                    with uncached(self.no_compile_cache, Path(tmp) / f"{name}.inductor"):
                        files[name] = _aot_compile(ep, opts[name], one_rows)
            files = {name: _package_files(out) for name, out in files.items()}
            pkg = Path(tmp) / "aoti.pt2"
            package_aoti(str(pkg), files)
            return {PACKAGE: pkg.read_bytes()}

    def one_row_reductions(self, dtype: torch.dtype, device_types: Collection[str]) -> bool:
        """Whether this backend compiles its programs' one-row linears as reductions (``one_row.rewrite``): weights
        not frozen (a packed backend's GEMM templates are fast already), on a CPU where ``one_row.wanted``."""
        return (not self.packs_weights and set(device_types) == {"cpu"}
                and one_row.wanted(dtype, "cpu", _cpu_vendor()))

    # Extra library name -> the compiled program it is a variant of: that program compiled as for one cache row,
    # packaged beside it where its options differ, and loaded where the package holds it (``AotiPackedBackend``).
    one_row_variants: ClassVar[Mapping[str, str]] = {}
    # Likewise, but captured on its own for one row (``capture`` returns it beside the programs; ``compile`` gets
    # it as one more program), loaded where the package holds it and probed with that program's one-row inputs.
    captured_variants: ClassVar[Mapping[str, str]] = {}

    @property
    def variants(self) -> dict[str, str]:
        """Every optional library: name -> the compiled program it stands in for (its signature and probe)."""
        return {**self.one_row_variants, **self.captured_variants}

    def members(self, programs: Iterable[str]) -> set[str]:
        return {PACKAGE}

    def file_members(self, programs: Iterable[str]) -> set[str]:
        return {PACKAGE}  # copied to disk and its libraries out of it: a packed library embeds the weights

    def load(self, path: Path, manifest: Manifest, blobs: Mapping[str, Any],
             weights: dict[str, torch.Tensor], device: torch.device | None = None) -> dict[str, Program]:
        import torch

        device = device if device is not None else torch.device("cpu")
        compiled = self.compiled(manifest.programs, set(manifest.signatures))
        optional = frozenset(n for n, of in self.variants.items() if of in compiled)
        package: FileMember = blobs[PACKAGE]
        tempcopy.remove_stale_dirs(pt2.TEMP_PREFIX)
        cache = manifest.cache_spec.allocate(device)  # one scratch cache for every probe
        loaded = {}
        with _libraries(path, package, set(compiled), optional) as libraries:
            variants = {n: self.variants[n] for n in optional if n in libraries}  # those this package holds
            for name, program in [*compiled.items(), *((n, compiled[of]) for n, of in variants.items())]:
                so = libraries[name][".so"]
                if not self.packs_weights:
                    _check_constants(path, name, compiled_constants(so, str(device)), weights)
                run = self._load_one(path, manifest, name, program, so, weights, device, cache)
                loaded[name] = CompiledProgram(run, functools.partial(
                    self._load_again, path, manifest, package, set(compiled), optional, name, program, weights, device))
        return self.serve(loaded, manifest)

    def _load_again(self, path: Path, manifest: Manifest, package: FileMember, models: set[str],
                    optional: frozenset[str], name: str, program: ProgramSpec, weights: dict[str, torch.Tensor],
                    device: torch.device) -> Callable[..., list[torch.Tensor]]:
        """``fresh()``: the library copied out of the artifact again (checked again: nothing is kept meanwhile)."""
        with _libraries(path, package, models, optional, wanted={name}, again=True) as libs:
            return self._load_one(path, manifest, name, program, libs[name][".so"], weights, device)

    def _load_one(self, path: Path, manifest: Manifest, name: str, program: ProgramSpec, so: Path,
                  weights: dict[str, torch.Tensor], device: torch.device,
                  cache: list[torch.Tensor] | None = None) -> Callable[..., list[torch.Tensor]]:
        """Load one program's library (checked by ``load``) and probe it; its flat runner."""
        from kvtrace.spec.manifest import clip

        scratch = cache if cache is not None else manifest.cache_spec.allocate(device)
        try:
            run, out = load_library(so, None if self.packs_weights else weights,
                                    _probe_inputs(manifest, program, scratch, device), device)
        except RuntimeError as e:
            raise ArtifactError(
                f"{path}: program {name} refuses the inputs its manifest declares ({clip(str(e), 200)}): "
                "the CacheSpec or program specs do not match the compiled program; the artifact is "
                "inconsistent, re-export it") from e
        if len(out) != 1 or out[0].dim() != 3 or out[0].shape[-1] != manifest.vocab_size:
            raise ArtifactError(f"{path}: program {name} returns {[tuple(o.shape) for o in out]}, the "
                                f"manifest declares logits [B, T, {manifest.vocab_size}]; the artifact is "
                                "inconsistent, re-export it")
        return run

    def serve(self, loaded: dict[str, Program], manifest: Manifest) -> dict[str, Program]:
        """Compiled program name -> callable, as ProgramSpec name -> callable (the inverse of ``compiled``)."""
        return {n: loaded[p.served_by or n] for n, p in manifest.programs.items()}


AOTI = AotiBackend("aoti", "AOTInductor-compiled programs (native code), weights stored once outside them",
                   native_code=True, no_compile_cache=True)


@contextlib.contextmanager
def _libraries(path: Path, package: FileMember, models: set[str], optional: frozenset[str],
               wanted: Collection[str] | None = None, again: bool = False) -> Iterator[dict[str, dict[str, Path]]]:
    """The package copied out of the artifact (hash-checked) into a fresh temp dir and its libraries out of that
    (``pt2.libraries``: model -> {".so", ".json"} paths), the dir removed on exit: a loaded library stays mapped
    without its file. Nothing of it passes through memory whole."""
    tmp = tempcopy.new_dir(pt2.TEMP_PREFIX)
    try:
        copy = package.spill(tmp / "package.pt2", again=again)
        files = pt2.libraries(f"{path}: {PACKAGE}", copy, tmp, models, optional, wanted)
        copy.unlink()
        yield files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _package_files(files: Any) -> list[str]:
    """What of ``aot_compile``'s output goes into the package: the library, its sources and node files — what
    ``pt2.libraries`` accepts. The rest is left out: kernel binaries are embedded in a CUDA library
    (``inductor_options``), and a file the library did need would make loading fail, loudly, not wrongly."""
    paths = [os.fspath(f) for f in (files if isinstance(files, (list, tuple)) else [files])
             if isinstance(f, (str, os.PathLike))]
    return [f for f in paths if f.endswith(_LOADED_SUFFIXES)]


def _probe_inputs(manifest: Manifest, program: ProgramSpec, cache: list[torch.Tensor],
                  device: torch.device | None = None) -> list[torch.Tensor]:
    """One call's inputs at position 0 with T = L = 1 (and R = 1), over ``cache`` (allocated from the CacheSpec),
    on ``device``."""
    import torch

    spec, kw = manifest.cache_spec, {"dtype": torch.int64, "device": device}
    # tokens, input_pos (, key_pos, slots): T = L = R = 1, every id and position 0
    flat = [torch.zeros(shape, **kw) for _, shape, _ in program.spine(spec.batch_size, 1, 1, 1)]
    for i in program.inputs:
        flat.append(torch.full(i.concrete(spec.batch_size, 1), i.default or 0.0, dtype=i.torch_dtype, device=device))
    return [*flat, *cache]


def _check_constants(path: Path, name: str, table: dict[str, tuple[torch.dtype | None, int]],
                     weights: dict[str, torch.Tensor]) -> None:
    """Every weight a compiled library reads, against what the artifact hands it (dtype, bytes).

    The library records each constant's storage size at compile time rounded up to 64 bytes (Inductor's
    ALIGN_BYTES), not its shape; kvtrace's weights own their storage, so a weight that fits is one whose
    rounded size is exactly that: fewer bytes would be read past their end, more would be misread.
    """
    from kvtrace.spec.manifest import describe

    for fqn, (dtype, nbytes) in table.items():
        w = weights.get(fqn)
        if w is None:
            raise ArtifactError(f"{path}: program {name} reads weight {fqn}, which weights.safetensors does not "
                                "hold; the artifact is inconsistent, re-export it")
        if w.dtype != dtype or (w.nbytes + 63) // 64 * 64 != nbytes or not w.is_contiguous():
            raise ArtifactError(
                f"{path}: program {name} was compiled for weight {fqn} as {str(dtype).removeprefix('torch.')} of "
                f"{nbytes} bytes (64-byte aligned), but weights.safetensors holds {describe(w)} ({w.nbytes} bytes); "
                "the artifact is inconsistent, re-export it")
