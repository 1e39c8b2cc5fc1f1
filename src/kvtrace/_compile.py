"""Thin glue over AOTInductor: an ExportedProgram -> a loaded, guard-free compiled callable."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["aoti_compile", "aoti_load", "aoti_load_packed", "weights_of"]


# Artifact compiles never come from Inductor's compile caches. Two cache hits returned programs built for
# another graph: a packed SmolLM2 bf16 program with wrong prepacked weights (logits off by 147), and a
# tiny Llama decode program taking key_pos [L] whose index bounds belonged to another max_seq_len
# (compiled for 24 slots, run with 40: "index out of bounds: 0 <= tmp7 < 24L"; heap corruption in
# another case). A fresh compile is right in both; an artifact is compiled once, then kvtrace's own
# artifact cache serves it.
EXPORT_NO_CACHE = {"force_disable_caches": True}


def inductor_options(packed: bool = False, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Inductor settings kvtrace compiles with (one place, reported by bench).

    Default: weights stay outside the .so; they are loaded from the model / artifact once.
    ``packed``: freezing — the weights are folded into the compiled library as constants, prepacked for
    the CPU matmul kernels, so one program holds its own weights and an artifact has exactly one copy.
    In bf16/fp16 also max-autotune over Inductor's CPU GEMM templates (AMX / AVX-512 micro-kernels) and
    ATen, per matmul: on SmolLM2 bf16 it doubles decode speed over frozen oneDNN matmuls (57-66 vs 40
    tokens/s) at ~4x the compile time. In fp32 the templates lose to the frozen MKL/oneDNN matmuls
    (decode 33.6 vs 37 tokens/s, prefill 137 vs 83 ms) and only cost compile time, so fp32 freezes only.
    """
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
    return {**inductor_options(packed, dtype), **EXPORT_NO_CACHE}


def aoti_compile(ep: torch.export.ExportedProgram, package_path: str | os.PathLike[str]) -> Callable[..., Any]:
    """Compile ``ep`` ahead of time and load it, with the ExportedProgram's own weights attached."""
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=os.fspath(package_path), inductor_configs=inductor_options()
    )
    return aoti_load(path, weights=weights_of(ep))


def weights_of(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Every tensor a program reads besides its inputs: parameters, buffers and lifted constants, by name."""
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


def aoti_load_packed(path: str | os.PathLike[str], model_name: str) -> Callable[..., Any]:
    """Load a compiled package that carries its own (frozen, prepacked) weights."""
    from torch._inductor.package import load_package

    return _FlatRunner(load_package(os.fspath(path), model_name))


class _FlatRunner:
    """Calls the compiled model with a flat list of tensors (skips pytree work on the hot path)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self._run = runner.loader.boxed_run

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
