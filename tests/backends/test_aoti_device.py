"""backends.aoti for a CUDA program, what can be checked without a GPU: the options it compiles with, what of
AOTInductor's output goes into the package, and the runner it asks for."""

from __future__ import annotations

import pytest
import torch

from kvtrace._errors import ArtifactError
from kvtrace.backends import aoti


def test_cuda_programs_embed_their_kernels_and_cpu_programs_are_unchanged(monkeypatch):
    assert aoti.inductor_options(device_type="cpu") == {"aot_inductor.package_constants_in_so": False}
    cuda = aoti.export_options(False, torch.bfloat16, "cuda")
    embed = [k for k in cuda if k.startswith("aot_inductor.embed_")]
    assert embed and all(cuda[k] is True for k in embed)
    assert cuda["aot_inductor.package_constants_in_so"] is False and cuda["force_disable_caches"] is True
    packed = aoti.inductor_options(True, torch.bfloat16, "cuda")
    assert packed["freezing"] and "max_autotune_gemm_backends" not in packed  # CPU GEMM templates are CPU-only
    monkeypatch.setenv(aoti.EMBED_KERNELS_ENV, "0")  # the fallback: kernels beside the library
    assert not [k for k in aoti.export_options(False, torch.bfloat16, "cuda") if k.startswith("aot_inductor.embed_")]


def test_the_package_keeps_only_what_loading_reads():
    files = ["/t/decode.wrapper.so", "/t/decode.wrapper.cpp", "/t/decode.wrapper_metadata.json",
             "/t/triton_abc.cubin", "/t/kernel.ptx", "/t/x.o", object()]
    assert aoti._package_files(files) == files[:3]
    assert aoti._package_files("/t/one.so") == ["/t/one.so"]


def test_a_cuda_library_on_a_torch_without_cuda_is_refused_clearly(monkeypatch):
    monkeypatch.delattr(torch._C._aoti, "AOTIModelContainerRunnerCuda", raising=False)
    with pytest.raises(ArtifactError, match="built without CUDA"):
        aoti._runner("/nonexistent.so", torch.device("cuda", 0))
