"""Per-dtype tolerances: the one place that says how close "equal to eager" is.

A compared tensor passes when ``max|a - b| <= atol + rtol * max|b|`` (b = the eager reference).
Every verify report prints the tolerance it used.

Reduced precision (bf16, fp16) has a second route, because eager in that dtype is not exact either: on
a 30-layer model, eager bf16 misses the fp32 result by more than the bf16 tolerance, and a compiled
program that rounds in a different order can be *closer* to fp32 than eager bf16 is yet further from
eager bf16 than the tolerance. When verify is given an fp32 reference f (the same weights, upcast),
a candidate a that misses eager b still passes if it is at least as accurate as b, give or take the
tolerance::

    max|a - f| <= max|b - f| + atol + rtol * max|f|

Both errors are reported. fp32 has no second route (its reference is the truth).

int8 KV caches (``CacheSpec.kv_dtype == "int8"``) are judged against the same decoder run eagerly with the
same quantized cache (``tools.runners.DecoderRunner``): logits with the dtype's tolerance, cache contents
(dequantized) with ``kv_tolerance``, which allows one int8 step: a compiled kernel that rounds K a few ulps
differently flips ``round(x / scale)`` where x / scale is near a .5 tie (seen on AOTI: 0.0025 on a tiny
model's layer-0 K, exactly one step), and one step of any row is at most ``max|ref| / 127`` (times the
float16 scale's rounding, 1 + 2**-11). Anything a stale or skipped scale does is far larger.

Quantized weights (``kvtrace export --quant``) are judged the same way, against the same quantized weights
run eagerly (dequantized, plain matmuls): ``quant_tolerance``. The int8/int4/8da4w kernels compute with bf16
activations, so those get the bf16 tolerance and its second route, whose fp32 reference is the same
quantized weights with float32 activations; a GGUF's blocks, computed in float32, get the float32 tolerance.

Lossy-quantized programs on deep models have a third route, the **noise floor**. An int8 cache
(``round(x / scale)`` on every write) and 8da4w (``round(x / scale)`` on every activation row) compute with
rounding steps: an ulp-level difference of a step's input (a compiled kernel summing a matmul in another
order) flips a rounding now and then, the flipped value moves by a whole step, and over 30 layers the flips
compound. Eager itself is that sensitive: the same eager reference, only with its linear layers summed in
float64 (or split in two parts), is as far from itself as the compiled program is (SmolLM2-135M: int8 cache
logits 0.59 / 0.85 over every prompt position, 0.58 on the last ones verify compares, vs the aoti program's
0.44; 8da4w 5.5 vs the aoti program's 4.5 and the ATen kernel run eagerly, no compiler involved, 5.7). So verify measures that sensitivity in the same run (``tools.noise``: the reference re-run under
``PERTURBATIONS``, fed the same tokens) and takes, per compared tensor (the logits; each layer's K and V),
the floor ``n`` = the largest difference any perturbed run shows over the whole run. A candidate ``a`` that
misses the other routes still passes a tensor when::

    max|a - b| <= atol + rtol * max|b| + NOISE_MULTIPLE * n

i.e. it is no further from the reference than twice the reference is from itself under an exact-equivalent
change of summation order. A greedy token can then differ only where the reference's own top two logits are
within twice that limit. A tensor whose floor is float32 rounding (a 2-layer tiny test model, where the
perturbations flip nothing) keeps the plain tolerance in effect, so faults on tiny models are judged as before; a fault (a stale scale, a wrong
group size, a dropped zero point or GGUF min) shows from layer 0 on, where the floor is at most one rounding
step. Only verify's lossy-quantized groups whose programs round to a step at run time get a floor (an int8
cache; int8 / int4 / 8da4w weights, whose kernels round activations to bf16 or int8); fp32 and bf16 programs, and
GGUF blocks computed in float32, keep the first two routes.

The int8 cache vs the unquantized cache (the HF model's own, eager) is reported, not judged. What bounds
it: a layer's K/V whose inputs are exact (layer 0) is within half a step, ``INT8_HALF_STEP * max|x|``, of
the unquantized value; later layers add the propagated attention error.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

__all__ = ["INT8_HALF_STEP", "NOISE_MULTIPLE", "Judgement", "Tolerance", "close", "judge", "kv_tolerance", "quant_tolerance",
           "tolerance_for"]


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


_INT8_STEP = (1 + 2**-11) / 127  # one int8 step of a row, relative to the row's max |x| (float16 scale rounding)
INT8_HALF_STEP = _INT8_STEP / 2  # round-to-nearest: |x - q * scale| <= scale / 2


def kv_tolerance(dtype: torch.dtype, kv_dtype: str | None = None, base: Tolerance | None = None) -> Tolerance:
    """What cache contents are judged with: the dtype's tolerance (or ``base``), or for an int8 cache (compared
    dequantized, against the same decoder's eager int8 cache) that plus one int8 step of max|ref|."""
    base = base or tolerance_for(dtype)
    return base if kv_dtype is None else Tolerance(atol=base.atol, rtol=base.rtol + _INT8_STEP)


def quant_tolerance(dtype: torch.dtype, activations: str) -> Tolerance:
    """Quantized weights (``spec.quant``), judged against the same quantized weights run eagerly: their kernels
    take bf16 activations ("bfloat16", "int8-dynamic"), so the bf16 tolerance with the second route (an fp32
    reference: the same quantized weights with float32 activations); a GGUF's blocks computed in float32
    ("float32") get the dtype's own tolerance. XNNPACK's dynamically quantized GEMMs ("int8-asym": each row int8,
    float32 otherwise) compute the reference's formula, but an input one ulp off a rounding tie (XNNPACK's norms are
    not ATen's) lands one int8 step away, and the steps compound through the layers: a step is max|row| / 255, as
    coarse as a bf16 ulp of the row's largest value, so the bf16 tolerance (a tiny Llama: two such rows put a
    layer-1 K 2.6e-3 of max|K| off, past the float32 tolerance plus one int8 step), without a second route."""
    return tolerance_for(dtype) if activations == "float32" else tolerance_for(torch.bfloat16)


# the noise-floor route: a candidate may be this many times further from the reference than the reference is
# from itself under an exact-equivalent perturbation (two samples of the same rounding noise; measured on SmolLM2,
# `kvtrace verify --artifact`: the aoti int8-cache program at 0.76x the logits' floor and at most 1.44x a layer's
# K/V floor, aoti 8da4w at 0.81x the logits' floor; the 2 leaves room for a sample that lands above the floor's)
NOISE_MULTIPLE = 2.0


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


@dataclass(frozen=True)
class Judgement:
    """How candidate ``a`` compares with eager ``b`` (and, when given, the fp32 reference ``f``)."""

    passed: bool
    diff: float  # max|a - b|
    limit: float  # atol + rtol * max|b|
    vs_fp32: float | None = None  # max|a - f|
    eager_vs_fp32: float | None = None  # max|b - f|: eager's own error in its dtype
    fp32_limit: float | None = None  # eager_vs_fp32 + atol + rtol * max|f|
    floor: float | None = None  # the reference's own noise floor for this tensor (lossy-quantized runs)
    floor_limit: float | None = None  # limit + NOISE_MULTIPLE * floor
    route: str = ""  # what passed it: "tolerance", "fp32" or "noise floor"; "" when it failed

    def describe(self, what: str) -> str:
        """Why it failed, e.g. ``"logits max abs 2.1 > 1.2, vs fp32 3.4 > 2.6 (eager's own 1.5 + tolerance)"``
        or ``"layer 3 K max abs 0.9 > 0.15, > 0.45 (tolerance + 2 x noise floor 0.15)"``."""
        text = f"{what} max abs {self.diff:.3g} > {self.limit:.3g}"
        if self.vs_fp32 is not None:
            text += f", vs fp32 {self.vs_fp32:.3g} > {self.fp32_limit:.3g} (eager's own {self.eager_vs_fp32:.3g} + tolerance)"
        if self.floor_limit is not None:
            text += f", > {self.floor_limit:.3g} (tolerance + {NOISE_MULTIPLE:g} x noise floor {self.floor:.3g})"
        return text

    @property
    def loosest_limit(self) -> float:
        """The largest limit among the routes tried (what per-position reports compare with)."""
        return max(x for x in (self.limit, self.floor_limit) if x is not None)


def judge(a: torch.Tensor, b: torch.Tensor, tol: Tolerance, fp32: torch.Tensor | None = None,
          floor: float | None = None) -> Judgement:
    """Candidate ``a`` against eager ``b``; with ``fp32`` (reduced-precision runs) the second route above; with
    ``floor`` (the reference's own noise floor for this tensor, lossy-quantized runs) the third.

    A NaN in ``a`` fails every route; a floor that is not a finite number is not used."""
    ok, diff, limit = close(a, b, tol)
    if ok:
        return Judgement(True, diff, limit, route="tolerance")
    j = Judgement(False, diff, limit)
    if fp32 is not None:
        mine, theirs = max_abs_diff(a, fp32), max_abs_diff(b, fp32)
        f_limit = theirs + tol.limit(fp32.float().abs().max().item() if fp32.numel() else 0.0)
        j = Judgement(mine <= f_limit, diff, limit, mine, theirs, f_limit, route="fp32" if mine <= f_limit else "")
    if j.passed or floor is None or not math.isfinite(floor):
        return j
    n_limit = limit + NOISE_MULTIPLE * floor
    ok = diff <= n_limit
    return dataclasses.replace(j, passed=ok, floor=floor, floor_limit=n_limit, route="noise floor" if ok else "")
