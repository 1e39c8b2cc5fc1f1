"""Backend "aoti" (AOTInductor: one compiled library per program, weights kept outside it), and the thin
glue over AOTInductor it shares with kvtrace.jit and "aoti-packed".

Members: ``programs/aoti.pt2``, an AOTInductor package with one model per program. Loading checks the
package's member list (``pt2``), every constant each library reads against the artifact's weights
(dtype and byte size, asked of the library itself) and makes one probe call with AOTInductor's runtime
input checks on, which then stay on for every call.

Glue, two ways in: ``aoti_compile``/``aoti_load`` for packages this process just compiled (kvtrace.jit), via
torch's package loader; ``load_library`` for a compiled model library taken out of an artifact: it
dlopens the one ``.so`` through ``AOTIModelContainerRunnerCpu`` and nothing else — none of torch's
package-loader paths that unpickle weights, constants or custom objects, and no compiler run.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace._errors import ArtifactError
from kvtrace.backends import pt2
from kvtrace.backends.base import Backend, Program

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtrace.spec.manifest import Manifest
    from kvtrace.spec.program import ProgramSpec

__all__ = ["AOTI", "CHECK_INPUTS_ENV", "PACKAGE", "AotiBackend", "aoti_compile", "aoti_load", "compiled_constants",
           "load_library", "weights_of"]

PACKAGE = "programs/aoti.pt2"  # the artifact member holding the package

# The generated run_impl checks every input's dtype, static sizes, symbolic-size bounds and static strides
# against what it was compiled for, and raises instead of reading out of bounds, when this variable is set
# at the library's *first* call (it is read once per library). load_library's probe call latches it on.
CHECK_INPUTS_ENV = "AOTI_RUNTIME_CHECK_INPUTS"


# Artifact compiles never come from Inductor's compile caches. Two cache hits returned programs built for
# another graph: a packed SmolLM2 bf16 program with wrong prepacked weights (logits off by 147), and a
# tiny Llama decode program taking key_pos [L] whose index bounds belonged to another max_seq_len
# (compiled for 24 slots, run with 40: "index out of bounds: 0 <= tmp7 < 24L"; heap corruption in
# another case). A fresh compile is right in both; an artifact is compiled once, then kvtrace's own
# artifact cache serves it.
EXPORT_NO_CACHE = {"force_disable_caches": True}


def inductor_options(packed: bool = False, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Inductor settings kvtrace compiles with (one place, reported by bench).

    Default: weights stay outside the .so; they are loaded from the model / artifact once.
    ``packed``: freezing — the weights are folded into the compiled library as constants, prepacked for
    the CPU matmul kernels, so one program holds its own weights and an artifact has exactly one copy.
    In bf16/fp16 also max-autotune over Inductor's CPU GEMM templates (AMX / AVX-512 micro-kernels) and
    ATen, per matmul: on SmolLM2 bf16 it doubles decode speed over frozen oneDNN matmuls (57-66 vs 40
    tokens/s) at ~4x the compile time. In fp32 the templates lose to the frozen MKL/oneDNN matmuls
    (decode 33.6 vs 37 tokens/s, prefill 137 vs 83 ms) and only cost compile time, so fp32 freezes only.
    ``dtype`` None: float32.
    """
    import torch

    if packed:
        opts: dict[str, Any] = {
            "freezing": True,
            "aot_inductor.package_constants_in_so": True,
        }
        if dtype in (torch.bfloat16, torch.float16):
            opts.update({
                "max_autotune": True,
                "max_autotune_gemm_backends": "CPP,ATEN",
                "autotune_num_choices_displayed": 0,  # no per-matmul benchmark tables on stderr
                "max_autotune_report_choices_stats": False,
            })
        return opts
    return {"aot_inductor.package_constants_in_so": False}


def export_options(packed: bool, dtype: torch.dtype) -> dict[str, Any]:
    """What an artifact's programs are compiled with: ``inductor_options`` without Inductor's caches."""
    # check_lowerbound off: export specializes sizes 0/1, so T and L get a compiled lower bound of 2 that
    # the runtime input checks (on for artifacts, see CHECK_INPUTS_ENV) would enforce on 1-token prefills.
    return {**inductor_options(packed, dtype), **EXPORT_NO_CACHE, "aot_inductor.check_lowerbound": False}


def aoti_compile(ep: torch.export.ExportedProgram, package_path: str | os.PathLike[str]) -> Callable[..., Any]:
    """Compile ``ep`` ahead of time and load it, with the ExportedProgram's own weights attached."""
    import torch

    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=os.fspath(package_path), inductor_configs=inductor_options()
    )
    return aoti_load(path, weights=weights_of(ep))


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


def compiled_constants(so_path: str | os.PathLike[str]) -> dict[str, tuple[torch.dtype | None, int]]:
    """What a compiled model library reads besides its inputs: original FQN -> (dtype, bytes), asked of the
    library itself through AOTInductor's C ABI (interface.h), not of any file next to it. Constants folded
    at compile time are left out (the library computes them). The dtype is None for one torch cannot name."""
    lib = ctypes.CDLL(os.fspath(so_path))
    size_t, handle = ctypes.c_size_t, ctypes.c_void_p()

    def call(fn: str, *args: Any) -> None:
        if getattr(lib, fn)(*args) != 0:
            raise RuntimeError(f"{fn} failed in {Path(so_path).name}")

    call("AOTInductorModelContainerCreateWithDevice", ctypes.byref(handle), size_t(1), b"cpu", None)
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


def load_library(so_path: str | os.PathLike[str], weights: dict[str, torch.Tensor] | None,
                 probe: Sequence[torch.Tensor]) -> tuple[Callable[..., list[torch.Tensor]], list[torch.Tensor]]:
    """Load one compiled model library; hand it ``weights`` by reference (None: its weights are frozen
    inside), then call it once on ``probe`` with the runtime input checks on (CHECK_INPUTS_ENV), which
    stay on for every later call. The caller has checked ``weights`` against ``compiled_constants``.
    Returns (the callable, the probe's outputs). Raises RuntimeError (the library's own message) when the
    probe's inputs are not what it was compiled for.
    """
    import torch

    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(os.fspath(so_path), 1)
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


# --- the backend ----------------------------------------------------------------------------------
class AotiBackend(Backend):
    """One AOTInductor model per compiled program, in one package; ``packs_weights``: frozen weights."""

    @property
    def compile_label(self) -> str:
        return f"compiling with AOTInductor ({self.name})"

    def compile(self, eps: dict[str, torch.export.ExportedProgram], dtype: torch.dtype) -> dict[str, bytes]:
        import torch
        from torch._inductor.package import package_aoti

        from kvtrace.capture.export import _example_args

        def no_cache() -> contextlib.AbstractContextManager[Any]:  # see EXPORT_NO_CACHE
            return torch.compiler.config.patch(**EXPORT_NO_CACHE) if self.no_compile_cache else contextlib.nullcontext()

        with tempfile.TemporaryDirectory(prefix="kvtrace-export-") as tmp:
            files = {}
            for name, ep in eps.items():
                opts = {**export_options(self.packs_weights, dtype), "aot_inductor.package": True,
                        "aot_inductor.model_name_for_generated_files": name}
                with no_cache():
                    files[name] = torch._inductor.aot_compile(ep.module(), _example_args(ep), options=opts)
            pkg = Path(tmp) / "aoti.pt2"
            package_aoti(str(pkg), files)
            return {PACKAGE: pkg.read_bytes()}

    def members(self, programs: Iterable[str]) -> set[str]:
        return {PACKAGE}

    def load(self, path: Path, manifest: Manifest, blobs: dict[str, bytes],
             weights: dict[str, torch.Tensor]) -> dict[str, Program]:
        from kvtrace.spec.manifest import clip

        compiled = self.compiled(manifest.programs)
        libraries = pt2.libraries(f"{path}: {PACKAGE}", blobs[PACKAGE], set(compiled))
        pt2.remove_stale_dirs()
        tmp = Path(tempfile.mkdtemp(prefix=f"{pt2.TEMP_PREFIX}{os.getpid()}-"))
        cache = manifest.cache_spec.allocate()  # one scratch cache for every probe
        try:
            loaded = {}
            for name, program in compiled.items():
                so = tmp / f"{name}.so"  # our own names: nothing from the package picks a path
                so.write_bytes(libraries[name][".so"])
                if ".json" in libraries[name]:  # extern kernel nodes, read by the library's proxy executor
                    (tmp / f"{name}.json").write_bytes(libraries[name][".json"])
                if not self.packs_weights:
                    _check_constants(path, name, compiled_constants(so), weights)
                try:
                    run, out = load_library(so, None if self.packs_weights else weights,
                                            _probe_inputs(manifest, program, cache))
                except RuntimeError as e:
                    raise ArtifactError(
                        f"{path}: program {name} refuses the inputs its manifest declares ({clip(str(e), 200)}): "
                        "the CacheSpec or program specs do not match the compiled program; the artifact is "
                        "inconsistent, re-export it") from e
                if len(out) != 1 or out[0].dim() != 3 or out[0].shape[-1] != manifest.vocab_size:
                    raise ArtifactError(f"{path}: program {name} returns {[tuple(o.shape) for o in out]}, the "
                                        f"manifest declares logits [B, T, {manifest.vocab_size}]; the artifact is "
                                        "inconsistent, re-export it")
                loaded[name] = _logits_only(run)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the libraries stay mapped; their files are not needed
        return self.serve(loaded, manifest)

    def serve(self, loaded: dict[str, Program], manifest: Manifest) -> dict[str, Program]:
        """Compiled program name -> callable, as ProgramSpec name -> callable (the inverse of ``compiled``)."""
        return loaded


AOTI = AotiBackend("aoti", "AOTInductor-compiled programs (native code), weights stored once outside them",
                   native_code=True, no_compile_cache=True)


def _probe_inputs(manifest: Manifest, program: ProgramSpec, cache: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call's inputs at position 0 with T = L = 1 (and R = 1), over ``cache`` (allocated from the CacheSpec)."""
    import torch

    spec = manifest.cache_spec
    # tokens, input_pos (, key_pos, slots): T = L = R = 1, every id and position 0
    flat = [torch.zeros(shape, dtype=torch.int64) for _, shape, _ in program.spine(spec.batch_size, 1, 1, 1)]
    for i in program.inputs:
        flat.append(torch.full(i.concrete(spec.batch_size, 1), i.default or 0.0, dtype=i.torch_dtype))
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


def _logits_only(runner: Callable[..., list[torch.Tensor]]) -> Program:
    """AOTInductor returns a list of outputs; a Decoder program has exactly one (logits [B, T, V])."""

    def run(*flat: torch.Tensor) -> torch.Tensor:
        return runner(*flat)[0]

    return run
