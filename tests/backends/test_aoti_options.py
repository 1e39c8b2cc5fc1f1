"""What AOTInductor compiles artifacts with (``backends/aoti.inductor_options``): a packed CPU program gets
Inductor's CPU GEMM templates in bf16/fp16 everywhere and in fp32 on AMD CPUs, where they beat MKL's fp32
matmuls (measured in the function's docstring); on Intel fp32 freezes only."""

from __future__ import annotations

import pytest
import torch

from kvtrace.backends import aoti


@pytest.mark.parametrize(("vendor", "dtype", "templates"), [
    ("AuthenticAMD", torch.float32, True), ("GenuineIntel", torch.float32, False), ("", torch.float32, False),
    ("GenuineIntel", torch.bfloat16, True), ("AuthenticAMD", torch.bfloat16, True),
])
def test_packed_cpu_programs_get_gemm_templates_where_they_win(vendor, dtype, templates, monkeypatch):
    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: vendor)
    opts = aoti.inductor_options(packed=True, dtype=dtype)
    assert opts["freezing"] is True
    assert opts.get("max_autotune", False) is templates and ("CPP" in opts.get("max_autotune_gemm_backends", "")) is templates
    assert "max_autotune" not in aoti.inductor_options(packed=False, dtype=dtype)  # weights outside: no templates
    assert "max_autotune" not in aoti.inductor_options(packed=True, dtype=dtype, device_type="cuda")


def test_cpu_vendor_is_read_from_the_machine():
    assert isinstance(aoti._cpu_vendor(), str)
