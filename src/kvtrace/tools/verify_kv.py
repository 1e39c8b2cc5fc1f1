"""verify with the reference each candidate's cache and weights ask for: an int8 KV cache or quantized
weights pick their own.

A candidate whose Session declares a quantized cache (``CacheSpec.kv_dtype``, e.g. an artifact exported with
``kv_dtype="int8"``) cannot match the HF model's unquantized cache to the dtype's tolerance, so it is judged
against ``DecoderRunner``: the same model's decoder built with the *same* CacheSpec, run eagerly (same decoder,
same quantized cache: only capture and compilation differ), with ``kv_tolerance`` for the cache contents
(one int8 step). Its error vs the unquantized cache — the HF model eager, the usual reference — is measured
on the same prompts and attached as ``VerifyReport.vs_fp32``: reported, not judged. Every other candidate
is judged against the HF model eager as before. Rows name their reference (``StepRow.reference``).

Quantized weights (``Session.quant``, from the artifact's manifest) are judged the same way: against the same
decoder with the same quantized weights (dequantized from the source by the recorded formats, computed by plain
matmuls with the programs' activation rounding) and ``quant_tolerance``; bf16-activation kernels also get the
second route, whose fp32 reference is the same quantized weights with float32 activations. Their error vs the
unquantized model (the HF model eager; for a GGUF, its dequantized weights) goes to ``vs_fp32``.

A group whose programs round to a step at run time (an int8 cache; int8 / int4 / 8da4w weights, whose kernels
round activations to bf16, 8da4w's to int8 first) is also judged with its reference's noise floor (``noise_floor``):
the reference decoder re-run under each of ``tools.noise.PERTURBATIONS`` (every linear layer summed in float64,
then in two parts), teacher-forced like the candidates, gives per compared tensor how far the reference is
from itself; a candidate passes a tensor within the tolerance plus ``NOISE_MULTIPLE`` times that (the third
route of ``kvtrace.spec.tolerances``). Unquantized candidates and GGUF blocks computed in float32 (no rounding
step: the float32 tolerance, exactly as before) never get a floor.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch

from kvtrace._errors import UsageError
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.quant import BF16_ACTIVATIONS, QuantSpec
from kvtrace.tools import noise as _noise
from kvtrace.tools.runners import DecoderRunner, Prompt, Runner
from kvtrace.tools.verify import NoiseFloor, VerifyReport, verify

__all__ = ["decoder_reference", "noise_floor", "quantized_spec", "verify_by_cache", "weight_quant"]


def quantized_spec(runner: Runner) -> CacheSpec | None:
    """The CacheSpec of a runner's Session when it declares a quantized cache (kv_dtype), else None."""
    spec = getattr(getattr(runner, "session", None), "spec", None)
    return spec if isinstance(spec, CacheSpec) and spec.kv_dtype is not None else None


def weight_quant(runner: Runner) -> QuantSpec | None:
    """The quantized weights of a runner's Session (an artifact exported with ``quant=``), else None."""
    q = getattr(getattr(runner, "session", None), "quant", None)
    return q if isinstance(q, QuantSpec) else None


def decoder_reference(model: torch.nn.Module, spec: CacheSpec, name: str | None = None,
                      quant: QuantSpec | None = None, activations: str | None = None) -> DecoderRunner:
    """The model's decoder over exactly ``spec`` (its kv_dtype, max_seq_len, batch, dtype), run eagerly; with
    ``quant``, over the same quantized weights (dequantized, ``quantize_decoder(reference=True)``, the modules
    ``quant`` records), with the programs' activation rounding or ``activations``."""
    from kvtrace.models.quant import quantize_decoder
    from kvtrace.models.registry import make_decoder

    if any(p.dtype != spec.torch_dtype for p in model.parameters() if p.is_floating_point()):
        model = copy.deepcopy(model).to(spec.torch_dtype)  # the caller's model stays as it is
    decoder = make_decoder(model, max_seq_len=spec.max_seq_len, batch_size=spec.batch_size, kv_dtype=spec.kv_dtype)
    decoder = decoder.to(next(model.parameters()).device)  # where the model (and so the candidates) run
    if decoder.cache_spec != spec:
        raise UsageError(f"this model's decoder declares the cache {decoder.cache_spec.describe()}, the "
                         f"candidate {spec.describe()}; verify the artifact against the model it was exported from")
    if quant is not None:
        quantize_decoder(decoder, quant, reference=True, activations=activations)
    what = "-".join(x for x in (quant.key if quant else None, spec.kv_dtype) if x)
    return DecoderRunner(decoder, name or f"decoder-eager-{what}")


def noise_floor(reference: DecoderRunner, prompts: Sequence[Sequence[int] | torch.Tensor | Prompt], *,
                steps: int = 8, dtype: torch.dtype = torch.float32, kv_dtype: str | None = None,
                quant: str | None = None, perturbations: Sequence[str] | None = None,
                prefill_logits: str = "all") -> NoiseFloor | None:
    """The reference's own sensitivity: ``reference``'s decoder run again under each perturbation (a second
    Session over the same decoder, so no second copy of its weights), fed the reference's greedy tokens, compared
    with the reference at every step as verify compares a candidate; None when a perturbed run fails.
    ``perturbations``: names in ``tools.noise.PERTURBATIONS`` (default: all of them). ``prefill_logits``
    "last": the prefill's logits compared on the last position only, as verify compares candidates that return
    only that one (the floor is then taken over the same logits as the candidates' errors)."""
    perturbations = tuple(_noise.PERTURBATIONS) if perturbations is None else tuple(perturbations)
    runs = [_noise.PerturbedRunner(DecoderRunner(reference.decoder, reference.name), p, prefill_logits)
            for p in perturbations]
    report = verify(reference, runs, prompts, steps=steps, dtype=dtype, kv_dtype=kv_dtype, quant=quant)
    return NoiseFloor.from_rows(report.rows, perturbations)


def verify_by_cache(model: torch.nn.Module, eager: Runner, candidates: Sequence[Runner],
                    prompts: Sequence[Sequence[int] | torch.Tensor | Prompt], *, steps: int = 8,
                    dtype: torch.dtype = torch.float32, fp32: Runner | None = None,
                    floor: bool = True) -> VerifyReport:
    """``verify`` of every candidate against its reference: ``eager`` (the HF ``model`` eager; ``fp32`` its
    float32 copy for bf16 runs) for unquantized caches and weights, ``decoder_reference`` for each quantized
    CacheSpec and each quantization of the weights (the same decoder, cache and quantized weights, eager).
    One report: the rows of every group, and the quantized candidates vs ``eager`` in ``vs_fp32``. ``floor``:
    judge each quantized group with its reference's noise floor too (``noise_floor``; off: the fixed tolerances
    alone)."""
    plain = [c for c in candidates if quantized_spec(c) is None and weight_quant(c) is None]
    groups: dict[tuple[CacheSpec, QuantSpec | None], list[Runner]] = {}
    for c in candidates:
        if c in plain:
            continue
        spec = c.session.spec  # type: ignore[attr-defined]  # quantized: a Session runner
        groups.setdefault((spec, weight_quant(c)), []).append(c)
    report = verify(eager, plain, prompts, steps=steps, dtype=dtype, fp32=fp32) if plain or not groups else None
    for (spec, quant), cands in groups.items():
        high = None
        if quant is not None and quant.activations in BF16_ACTIVATIONS:  # same weights, float32 activations
            high = decoder_reference(model, spec, "decoder-eager-fp32-activations", quant, activations="float32")
        elif dtype != torch.float32 and fp32 is not None:  # the same decoder in float32: the second route
            high = decoder_reference(model, dataclasses.replace(spec, dtype="float32"), "decoder-eager-fp32", quant)
        ref = decoder_reference(model, spec, quant=quant)
        how = {"dtype": dtype, "kv_dtype": spec.kv_dtype, "quant": quant.activations if quant else None}
        # a rounding step at run time (int8 cache writes; bf16 / int8 activations); a GGUF's blocks computed in
        # float32 have none: its programs are judged as fp32 ones
        steps_at_run_time = spec.kv_dtype is not None or (quant is not None and quant.activations != "float32")
        measure = floor and steps_at_run_time
        last = all(getattr(c, "prefill_logits", "all") == "last" for c in cands)
        noise = noise_floor(ref, prompts, steps=steps, prefill_logits="last" if last else "all", **how) if measure else None
        judged = verify(ref, cands, prompts, steps=steps, fp32=high, floor=noise, **how)
        if measure and noise is None:  # measured and failed: the report says so
            judged.floors = {c.name: None for c in cands}
            judged.tolerance["noise_rule"] = "none: a perturbed run of the reference failed"
        measured = verify(eager, cands, prompts, steps=steps, dtype=dtype)  # vs the unquantized model
        report = _merge(report, judged, measured)
    assert report is not None
    return report


def _merge(into: VerifyReport | None, judged: VerifyReport, measured: VerifyReport) -> VerifyReport:
    if into is None:
        into = VerifyReport(tolerance=dict(judged.tolerance), dtype=judged.dtype)
    into.rows.extend(judged.rows)
    into.floors.update(judged.floors)
    for k in ("kv_rule", "quant_rule", "noise_rule"):
        if k in judged.tolerance:
            into.tolerance.setdefault(k, judged.tolerance[k])
    if into.vs_fp32 is None:
        into.vs_fp32 = VerifyReport(tolerance=dict(measured.tolerance), dtype=measured.dtype)
    into.vs_fp32.rows.extend(measured.rows)
    return into
