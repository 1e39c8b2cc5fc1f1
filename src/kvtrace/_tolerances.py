"""Per-dtype tolerances: the one place that says how close "equal to eager" is.

A compared tensor passes when ``max|a - b| <= atol + rtol * max|b|`` (b = the eager reference).
Every verify report prints the tolerance it used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tolerance", "close", "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def limit(self, ref_max: float) -> float:
        return self.atol + self.rtol * ref_max

    def __str__(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g} (of max|ref|)"


_TOLERANCES = {
    # fp32: compiled kernels reorder reductions; differences stay around 1e-6 relative.
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    # bf16 has 8 mantissa bits: one ulp at 1.0 is 7.8e-3; fused vs unfused rounding differs by a few ulps.
    torch.bfloat16: Tolerance(atol=2e-2, rtol=3e-2),
    torch.float16: Tolerance(atol=1e-2, rtol=1e-2),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    return _TOLERANCES.get(dtype, _TOLERANCES[torch.float32])


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item()


def close(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> tuple[bool, float, float]:
    """(passes, max abs diff, limit used) for candidate ``a`` against reference ``b``."""
    diff = max_abs_diff(a, b)
    ref_max = b.float().abs().max().item() if b.numel() else 0.0
    limit = tol.limit(ref_max)
    return diff <= limit, diff, limit
