"""verify: compare candidates against the eager model, step by step, logits AND cache contents.

Every runner speaks one small protocol (``Runner``, in ``kvtrace.tools.runners``): reset, prefill
(token ids plus the named inputs of a prompt, e.g. a vision decoder's ``cross_attention_states``),
decode, and ``cache()`` — the valid part of every layer's K and V: ``[B, H_kv, P, D]`` for self-attention layers,
``[B, H_kv, N, D]`` for cross-attention layers holding N image tokens, None for a layer that holds
nothing (a cross-attention layer in a text-only run, as eager leaves it). The harness feeds the reference's
greedy token to every runner (teacher forcing), so one early error cannot hide later ones, and
records per step: logits max abs / max rel error, top-1 agreement, and per layer the max abs
error of K and V. A candidate whose declared state (an artifact Session's cache) does not hold exactly
its declared initial values as it comes (before the first prompt: what a fresh program starts from) and
after each reset fails that prompt's prefill row (the seed's bug: an exporter that dropped a cache's
initial values). Pass/fail uses the per-dtype tolerances of ``kvtrace.spec.tolerances``; a NaN anywhere fails.
For bf16/fp16, an optional fp32 reference (the same weights upcast, fed the same tokens) gives the
second route of ``kvtrace.spec.tolerances``: a candidate further from eager than the tolerance still passes a
tensor if it is no further from fp32 than eager itself is (+ tolerance); rows record both errors.

An int8-cache candidate is judged against the same decoder run eagerly with the same quantized cache
(``tools.verify_kv``), its cache contents with ``kv_tolerance`` (one int8 step); its error vs the unquantized
cache is reported, not judged (``VerifyReport.vs_fp32``). Each row names its reference.

Lossy-quantized candidates (an int8 cache, quantized weights) also get the noise-floor route of
``kvtrace.spec.tolerances``: ``floor`` (a ``NoiseFloor``, measured by ``tools.verify_kv`` from the reference
re-run under ``tools.noise.PERTURBATIONS``) gives each compared tensor (logits; each layer's K, V) the
reference's own difference from itself, and a candidate passes a tensor within the tolerance plus
``NOISE_MULTIPLE`` times it. Rows say which route passed them (``StepRow.rule``); the summary and the report
(``VerifyReport.floors``) give the floor each candidate was judged with.

A failing row says what failed, cache first (the earliest layer whose K or V is off, with the first
bad position), then the logits, e.g. ``"layer 0 K max abs 1.3 > 0.0001 (first bad position 0,
worst 4); logits max abs 2.1 > 0.0005"``. A candidate that raises fails that step (the error is
the failure text) and is skipped for the rest of that prompt; the next prompt resets it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrace.spec.tolerances import (
    NOISE_MULTIPLE,
    Tolerance,
    judge,
    kv_tolerance,
    max_abs_diff,
    quant_tolerance,
    tolerance_for,
)
from kvtrace.tools.runners import EagerRunner, JitRunner, LayerKV, Prompt, Runner, SessionRunner, Unavailable

DEFAULT_MAX_SEQ_LEN = 256  # the --against exports' cache when --max-seq-len is not given (run_cli_verify)

__all__ = ["EagerRunner", "JitRunner", "NoiseFloor", "Prompt", "Runner", "SessionRunner", "StepRow", "Unavailable",
           "VerifyReport", "verify"]

# the routes of kvtrace.spec.tolerances, strictest first: a row records the loosest one any of its tensors needed
RULES = ("tolerance", "fp32", "noise floor")

@dataclass(frozen=True)
class StepRow:
    candidate: str
    prompt: int
    step: str  # "prefill" or the decode index "1", "2", ...
    position: int
    logits_max_abs: float
    logits_max_rel: float
    top1_agree: float  # fraction of rows/positions whose argmax equals the reference's
    token_agree: bool  # candidate's greedy next token == reference's
    k_max_abs: tuple[float, ...]  # per layer
    v_max_abs: tuple[float, ...]
    cache_len_ok: bool
    passed: bool
    failure: str = ""  # e.g. "layer 3 K max abs ... (first bad position 7, worst 9); logits max abs ...",
    # "layer 0 cache shape [1, 2, 14, 16] != eager [1, 2, 3, 16]", "raised UsageError: ..."
    logits_vs_fp32: float | None = None  # with an fp32 reference: max|candidate - fp32| of the logits
    eager_logits_vs_fp32: float | None = None  # ... and eager's own max|eager - fp32|
    reference: str = "eager"  # the runner this row was compared with (an int8 cache: the same decoder, eager)
    rule: str = ""  # a passing row: the loosest route (RULES) any of its tensors needed; "" when it failed

    @property
    def worst_layer(self) -> int:
        errs = [max(k, v) for k, v in zip(self.k_max_abs, self.v_max_abs, strict=True)]
        return max(range(len(errs)), key=errs.__getitem__) if errs else -1


@dataclass(frozen=True)
class NoiseFloor:
    """A lossy-quantized reference's own sensitivity (``tools.noise``): per compared tensor, the largest
    difference between the reference and any of its perturbed runs over the whole run (every prompt, every
    step), which ``verify`` lets a candidate exceed the tolerance by ``NOISE_MULTIPLE`` times."""

    logits: float
    k: tuple[float, ...]  # per layer
    v: tuple[float, ...]
    tokens_agree: int  # the fewest teacher-forced greedy tokens any perturbed run shares with the reference
    steps: int
    perturbations: tuple[str, ...]

    @classmethod
    def from_rows(cls, rows: Sequence[StepRow], perturbations: Sequence[str]) -> NoiseFloor | None:
        """The floor from the rows of the perturbed runs (one candidate each); None when any of them raised or
        produced a non-finite error (then there is no floor to judge by)."""
        names = list(dict.fromkeys(r.candidate for r in rows))
        if not rows or not all(r.cache_len_ok and math.isfinite(r.logits_max_abs) and
                               all(math.isfinite(x) for x in (*r.k_max_abs, *r.v_max_abs)) for r in rows):
            return None
        n_layers = len(rows[0].k_max_abs)
        return cls(logits=max(r.logits_max_abs for r in rows),
                   k=tuple(max(r.k_max_abs[i] for r in rows) for i in range(n_layers)),
                   v=tuple(max(r.v_max_abs[i] for r in rows) for i in range(n_layers)),
                   tokens_agree=min(sum(r.token_agree for r in rows if r.candidate == n) for n in names),
                   steps=len(rows) // len(names), perturbations=tuple(perturbations))

    @property
    def kv(self) -> float:
        return max((*self.k, *self.v), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"logits": self.logits, "kv_max": self.kv, "k": list(self.k), "v": list(self.v),
                "tokens_agree": self.tokens_agree, "steps": self.steps, "perturbations": list(self.perturbations),
                "multiple": NOISE_MULTIPLE}


@dataclass
class VerifyReport:
    tolerance: dict[str, str]
    dtype: str
    rows: list[StepRow] = field(default_factory=list)
    # int8-cache candidates vs the unquantized cache (the HF model, eager): reported, never judged
    vs_fp32: VerifyReport | None = None
    # candidate -> the noise floor it was judged with (lossy-quantized candidates; None: it could not be measured)
    floors: dict[str, NoiseFloor | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def candidates(self) -> list[str]:
        return list(dict.fromkeys(r.candidate for r in self.rows))

    def first_failure(self, candidate: str) -> StepRow | None:
        return next((r for r in self.rows if r.candidate == candidate and not r.passed), None)

    def summary(self) -> list[dict[str, Any]]:
        out = []
        for c in self.candidates():
            rows = [r for r in self.rows if r.candidate == c]
            worst = max(rows, key=lambda r: r.logits_max_abs)
            kv = max(rows, key=lambda r: max((*r.k_max_abs, *r.v_max_abs), default=0.0))
            fail = self.first_failure(c)
            floor = self.floors.get(c)
            out.append({
                "candidate": c,
                "reference": rows[0].reference,
                "steps": len(rows),
                "logits_max_abs": worst.logits_max_abs,
                "logits_worst_step": f"p{worst.prompt}/{worst.step}",
                "logits_max_rel": max(r.logits_max_rel for r in rows),
                "top1_agree": min(r.top1_agree for r in rows),
                "tokens_agree": sum(r.token_agree for r in rows),
                "kv_max_abs": max((*kv.k_max_abs, *kv.v_max_abs), default=0.0),
                "kv_worst": f"p{kv.prompt}/{kv.step} layer {kv.worst_layer}",
                "passed": fail is None,
                "result": "PASS" if fail is None else "FAIL",
                "tolerance": self.tolerance["rule"],
                "first_failure": "" if fail is None else f"prompt {fail.prompt} step {fail.step}: {fail.failure}",
                "logits_vs_fp32": _max_or_none(r.logits_vs_fp32 for r in rows),
                "eager_logits_vs_fp32": _max_or_none(r.eager_logits_vs_fp32 for r in rows),
                # how many steps each route passed (RULES); a failing step counts under none
                "judged_by": {k: n for k in RULES if (n := sum(r.rule == k for r in rows))},
                "noise_floor": None if floor is None else floor.to_dict(),
            })
        return out

    def unjudged(self) -> list[dict[str, Any]]:
        """``summary()`` without its verdict: the errors of a comparison that is reported, not judged."""
        drop = ("passed", "result", "tolerance", "first_failure", "judged_by", "noise_floor")
        return [{k: v for k, v in s.items() if k not in drop} for s in self.summary()]

    def to_json(self) -> str:
        """Strict JSON (an infinite or NaN error is written as null; the row's ``failure`` says why)."""
        doc = {"passed": self.passed, "result": "PASS" if self.passed else "FAIL", "dtype": self.dtype,
               "tolerance": self.tolerance, "summary": self.summary(), "rows": [asdict(r) for r in self.rows]}
        if self.floors:
            doc["noise_floors"] = {c: None if f is None else f.to_dict() for c, f in self.floors.items()}
        if self.vs_fp32 is not None:
            doc["vs_fp32"] = {"judged": False, "summary": self.vs_fp32.unjudged()}
        return json.dumps(_finite(doc), indent=2, allow_nan=False)


def _max_or_none(xs: Any) -> float | None:
    vals = [x for x in xs if x is not None]
    if not vals:
        return None
    return math.nan if any(math.isnan(v) for v in vals) else max(vals)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _compare(name: str, prompt: int, step: str, position: int, ref: Runner, cand: Runner,
             ref_logits: torch.Tensor, cand_logits: torch.Tensor, tol: Tolerance,
             fp32: Runner | None = None, fp32_logits: torch.Tensor | None = None,
             kv_tol: Tolerance | None = None, floor: NoiseFloor | None = None) -> StepRow:
    ref_f, cand_f = ref_logits.float(), cand_logits.float()
    vs_fp32 = eager_vs_fp32 = None
    routes: list[str] = []  # the route that passed each tensor
    if cand_f.shape != ref_f.shape:
        l_abs = l_rel = math.inf
        top1, tok_ok = 0.0, False
        logits_failure = f"logits shape {list(cand_f.shape)} != eager {list(ref_f.shape)}"
    else:
        j = judge(cand_f, ref_f, tol, fp32_logits, floor.logits if floor is not None else None)
        routes.append(j.route)
        l_abs = j.diff
        l_rel = l_abs / max(ref_f.abs().max().item(), 1e-12)
        top1 = (cand_f.argmax(-1) == ref_f.argmax(-1)).float().mean().item()
        tok_ok = bool((cand_f[:, -1].argmax(-1) == ref_f[:, -1].argmax(-1)).all())
        logits_failure = "" if j.passed else j.describe("logits")
        if fp32_logits is not None:
            vs_fp32, eager_vs_fp32 = max_abs_diff(cand_f, fp32_logits), max_abs_diff(ref_f, fp32_logits)
    ks, vs = [], []
    len_ok = True
    cache_failures: list[str] = []
    ref_cache, cand_cache = ref.cache(), cand.cache()
    fp32_cache: list[LayerKV] = fp32.cache() if fp32 is not None else [None] * len(ref_cache)
    if len(cand_cache) != len(ref_cache):
        len_ok = False
        cache_failures.append(f"cache has {len(cand_cache)} layers, eager {len(ref_cache)}")
    for i, (ref_kv, cand_kv, f_kv) in enumerate(zip(ref_cache, cand_cache, fp32_cache, strict=False)):
        if ref_kv is None or cand_kv is None:
            if ref_kv is cand_kv:  # both hold nothing (a skipped cross-attention layer)
                ks.append(0.0)
                vs.append(0.0)
                continue
            len_ok = False
            held = f"holds K/V {list((cand_kv or ref_kv)[0].shape)}"
            cache_failures.append(f"layer {i}: eager holds nothing, candidate {held}" if ref_kv is None
                                  else f"layer {i}: eager {held}, candidate holds nothing")
            ks.append(math.inf)
            vs.append(math.inf)
            continue
        (rk, rv), (ck, cv) = ref_kv, cand_kv
        if ck.shape != rk.shape or cv.shape != rv.shape:
            len_ok = False
            cache_failures.append(f"layer {i} cache shape {list(ck.shape)} != eager {list(rk.shape)}")
            ks.append(math.inf)
            vs.append(math.inf)
            continue
        fk, fv = f_kv if f_kv is not None and f_kv[0].shape == rk.shape else (None, None)
        for which, r, c, f, acc in (("K", rk, ck, fk, ks), ("V", rv, cv, fv, vs)):
            n = None if floor is None or i >= len(floor.k) else (floor.k if which == "K" else floor.v)[i]
            j = judge(c, r, kv_tol or tol, f, n)
            routes.append(j.route)
            acc.append(j.diff)
            if not j.passed:
                # positions over the limit of the route that decided: fp32's when it was tried, else the loosest
                # of eager's (the tolerance, the noise floor)
                base, lim = (f, j.fp32_limit) if j.fp32_limit is not None else (r, j.loosest_limit)
                per_pos = (c.float() - base.float()).abs().amax(dim=(0, 1, 3))  # [P]
                bad = (~(per_pos <= lim)).nonzero().flatten()
                first = int(bad[0]) if bad.numel() else -1
                worst = int(torch.nan_to_num(per_pos, nan=math.inf).argmax())
                cache_failures.append(f"{j.describe(f'layer {i} {which}')} (first bad position {first}, worst {worst})")
    for _ in range(len(ks), len(ref_cache)):  # layers the candidate lacks
        ks.append(math.inf)
        vs.append(math.inf)
    parts = cache_failures[:1]
    if len(cache_failures) > 1:
        parts[0] += f" (+{len(cache_failures) - 1} more layer K/V)"
    failure = "; ".join([*parts, *([logits_failure] if logits_failure else [])])
    rule = "" if failure else RULES[max((RULES.index(r) for r in routes if r), default=0)]
    return StepRow(name, prompt, step, position, l_abs, l_rel, top1, tok_ok, tuple(ks), tuple(vs), len_ok,
                   not failure, failure, vs_fp32, eager_vs_fp32, rule=rule)


def _error_row(name: str, prompt: int, step: str, position: int, n_layers: int, failure: str) -> StepRow:
    inf = (math.inf,) * n_layers
    return StepRow(name, prompt, step, position, math.inf, math.inf, 0.0, False, inf, inf, False, False, failure)


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"raised {type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def verify(
    reference: Runner,
    candidates: Sequence[Runner],
    prompts: Sequence[Sequence[int] | torch.Tensor | Prompt],
    *,
    steps: int = 8,
    dtype: torch.dtype = torch.float32,
    fp32: Runner | None = None,
    kv_dtype: str | None = None,
    quant: str | None = None,
    floor: NoiseFloor | None = None,
) -> VerifyReport:
    """Run every prompt (reset before each) through reference and candidates; compare every step.

    A ``Prompt`` carries named prefill inputs (e.g. image features) next to its token ids. ``fp32``
    (for a bf16/fp16 ``dtype`` only): the reference's model in float32, fed the same tokens, which
    enables the reduced-precision route of ``kvtrace.spec.tolerances``. ``kv_dtype``: the candidates hold a
    quantized cache ("int8") and the reference is the same decoder with the same cache: cache contents are
    judged with ``kv_tolerance`` (one int8 step) instead of the dtype's tolerance. ``quant``: the candidates'
    quantized weights compute with these activations ("bfloat16", "int8-dynamic", "float32") and the reference
    is the same quantized weights run eagerly: ``quant_tolerance``; with bf16 activations ``fp32`` may be the
    same weights with float32 activations. ``floor``: the reference's noise floor (lossy-quantized candidates,
    measured by ``tools.verify_kv.noise_floor``): the third route, each tensor within the tolerance plus
    ``NOISE_MULTIPLE`` times its floor."""
    from kvtrace._errors import UsageError

    tol = quant_tolerance(dtype, quant) if quant is not None else tolerance_for(dtype)
    kv_tol = kv_tolerance(dtype, kv_dtype, tol) if kv_dtype is not None else None
    if fp32 is not None and tol == tolerance_for(dtype) and dtype == torch.float32:
        raise UsageError("an fp32 reference only applies to reduced-precision runs (bfloat16, float16); "
                         "this run is float32, whose eager reference is already the fp32 one")
    rule = str(tol) + (", or no further from fp32 than eager is (+ the same tolerance)" if fp32 is not None else "")
    report = VerifyReport(tolerance={"atol": str(tol.atol), "rtol": str(tol.rtol), "rule": rule,
                                     "fp32_reference": str(fp32 is not None).lower(),
                                     **({"kv_rule": str(kv_tol)} if kv_tol is not None else {}),
                                     **({"quant_rule": f"{quant} activations: {rule}"} if quant is not None else {}),
                                     **({"noise_rule": noise_rule(floor)} if floor is not None else {})},
                          dtype=str(dtype).removeprefix("torch."))
    with torch.inference_mode():
        for p_idx, prompt in enumerate(prompts):
            inputs = dict(prompt.inputs) if isinstance(prompt, Prompt) else {}
            ids = torch.as_tensor(prompt.tokens if isinstance(prompt, Prompt) else prompt, dtype=torch.int64)
            ids = ids.reshape(1, -1) if ids.dim() == 1 else ids  # [B, T]
            reference.reset()  # before every prompt, the first one included
            if fp32 is not None:
                fp32.reset()
            broken: dict[int, str] = {}  # candidate index -> why it is skipped for the rest of this prompt
            initial: dict[int, str] = {}  # candidate index -> how its state differs from the declared initial one
            for c_idx, c in enumerate(candidates):
                if isinstance(c, Unavailable):
                    broken[c_idx] = f"not run: {c.reason}"
                    continue
                try:
                    check = getattr(c, "initial_state_error", None)  # runners holding declared state
                    # the first prompt: the state as the candidate came (a fresh program's own initial values,
                    # which a runtime without kvtrace's reset starts from), then after reset(), every prompt
                    fresh = check() if check is not None and p_idx == 0 else ""
                    c.reset()
                    initial[c_idx] = fresh or (check() if check is not None else "")
                except Exception as e:
                    broken[c_idx] = f"reset() {_describe(e)}"
            ref_logits = reference.prefill(ids, **inputs)
            f_inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
            f_logits = fp32.prefill(ids, **f_inputs) if fp32 is not None else None
            n_layers = len(reference.cache())
            pos = ids.shape[1]
            for s in range(steps + 1):
                step = "prefill" if s == 0 else str(s)
                if s:
                    tok = ref_logits[:, -1:].argmax(-1)  # [B, 1] the reference's greedy token, fed to all
                    ref_logits = reference.decode(tok)
                    f_logits = fp32.decode(tok) if fp32 is not None else None
                    pos += 1
                for c_idx, c in enumerate(candidates):
                    if c_idx in broken:
                        report.rows.append(_error_row(c.name, p_idx, step, pos, n_layers, broken[c_idx]))
                        if not broken[c_idx].startswith(("skipped", "not run")):
                            broken[c_idx] = f"skipped: {broken[c_idx]} at step {step}"
                        continue
                    try:
                        out = c.prefill(ids, **inputs) if s == 0 else c.decode(tok)
                        # a runner that declares last-position prefill logits is compared on that position
                        last = s == 0 and getattr(c, "prefill_logits", "all") == "last"
                        row = _compare(c.name, p_idx, step, pos, reference, c,
                                       ref_logits[:, -1:] if last else ref_logits, out, tol, fp32,
                                       f_logits[:, -1:] if last and f_logits is not None else f_logits, kv_tol,
                                       floor)
                    except Exception as e:
                        row = _error_row(c.name, p_idx, step, pos, n_layers, _describe(e))
                        broken[c_idx] = f"skipped: {_describe(e)} at step {step}"
                    if s == 0 and initial.get(c_idx):  # the state it started from was not the declared one
                        row = dataclasses.replace(row, passed=False,
                                                  failure="; ".join(filter(None, (row.failure, initial[c_idx]))))
                    report.rows.append(row)
    if reference.name != "eager":
        report.rows = [dataclasses.replace(r, reference=reference.name) for r in report.rows]
    if floor is not None:
        report.floors = {c.name: floor for c in candidates}
    return report


def noise_rule(floor: NoiseFloor) -> str:
    """What the noise-floor route says, for the report's tolerance block."""
    return (f"lossy-quantized candidates also pass a tensor within the tolerance + {NOISE_MULTIPLE:g} x the "
            f"reference's own noise floor for it (its largest difference from itself over the whole run under "
            f"{', '.join(floor.perturbations)})")


def render(report: VerifyReport) -> Any:
    """A rich renderable: one summary row per candidate, with the tolerance in the title; int8-cache
    candidates also get a table of their error vs the unquantized cache (reported, not judged). Candidates
    judged with a noise floor get its column (the floor of the logits / the largest of any K/V layer, and the
    perturbed runs' greedy tokens), and a PASS names the loosest route it needed."""
    from rich.console import Group
    from rich.table import Table

    summary = report.summary()
    verdict = "[green]PASS[/green]" if report.passed else "[red]FAIL[/red]"
    failed = [s["candidate"] for s in summary if not s["passed"]]
    kv_rule = report.tolerance.get("kv_rule")
    t = Table(
        title=f"kvtrace verify ({report.dtype}; pass if max|a-b| <= {report.tolerance['rule']})",
        caption=f"{verdict}: {len(summary) - len(failed)}/{len(summary)} candidate(s) within the {report.dtype} "
                f"tolerance {report.tolerance['rule']}" + (f"; failed: {', '.join(failed)}" if failed else "")
                + (f"; int8 caches: K/V within {kv_rule} of the same decoder's eager int8 cache" if kv_rule else "")
                + (f"; quantized weights vs the same quantized weights eager, {report.tolerance['quant_rule']}"
                   if "quant_rule" in report.tolerance else "")
                + (f"; noise floor: {report.tolerance['noise_rule']}" if "noise_rule" in report.tolerance else ""),
    )
    with_floor = bool(report.floors)
    with_fp32 = report.tolerance.get("fp32_reference") == "true"
    for col in ("candidate", "steps", "logits max abs", "worst step", "top-1 agree", "greedy tokens",
                "K/V max abs", "worst K/V", *(["logits vs fp32 (cand / eager)"] if with_fp32 else []),
                *(["noise floor: logits / K/V (tokens)"] if with_floor else []), "result"):
        t.add_column(col, overflow="fold")
    for s in summary:
        fp32_col = []
        if with_fp32:
            c, e = s["logits_vs_fp32"], s["eager_logits_vs_fp32"]
            fp32_col = ["-" if c is None or e is None else f"{c:.3g} / {e:.3g}"]
        floor_col = []
        if with_floor:
            n = s["noise_floor"]
            floor_col = ["-" if n is None else f"{n['logits']:.3g} / {n['kv_max']:.3g} ({n['tokens_agree']}/{n['steps']})"]
        name = s["candidate"] if s["reference"] == "eager" else f"{s['candidate']} (vs {s['reference']})"
        loosest = next((k for k in reversed(RULES) if k in s["judged_by"]), "tolerance")
        how = "" if loosest == "tolerance" else f" ({loosest}: {s['judged_by'][loosest]}/{s['steps']} steps)"
        t.add_row(
            name, str(s["steps"]), f"{s['logits_max_abs']:.3g}", s["logits_worst_step"],
            f"{s['top1_agree']:.3f}", f"{s['tokens_agree']}/{s['steps']}", f"{s['kv_max_abs']:.3g}", s["kv_worst"],
            *fp32_col, *floor_col,
            f"[green]PASS[/green]{how}" if s["passed"] else f"[red]FAIL[/red] {s['first_failure']}",
        )
    if report.vs_fp32 is None:
        return t
    u = Table(title=f"quantized candidates (int8 KV cache, quantized weights) vs the unquantized model "
                    f"({report.vs_fp32.dtype}, HF eager): reported, not judged")
    for col in ("candidate", "logits max abs", "top-1 agree", "greedy tokens", "K/V max abs", "worst K/V"):
        u.add_column(col, overflow="fold")
    for s in report.vs_fp32.unjudged():
        u.add_row(s["candidate"], f"{s['logits_max_abs']:.3g}", f"{s['top1_agree']:.3f}",
                  f"{s['tokens_agree']}/{s['steps']}", f"{s['kv_max_abs']:.3g}", s["kv_worst"])
    return Group(t, u)


DEFAULT_PROMPTS = ("Who's the founder of Meta?", "Write one sentence about caches.")


def _prompts(args: Any) -> list[str]:
    from kvtrace._errors import UsageError

    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise UsageError(f"--prompts file {path} does not exist")
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if not lines:
            raise UsageError(f"--prompts file {path} has no non-empty lines")
        return lines
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt is empty")
        return [args.prompt, DEFAULT_PROMPTS[1]]
    return list(DEFAULT_PROMPTS)


def run_cli_verify(args: Any, step: Any) -> VerifyReport:
    """What ``kvtrace verify`` runs: eager reference vs the requested candidates on real prompts."""
    import tempfile

    from kvtrace._errors import UsageError
    from kvtrace.artifact.archive import load
    from kvtrace.artifact.export import DTYPES, export
    from kvtrace.backends import registry
    from kvtrace.sources.chat import encode_prompt
    from kvtrace.sources.load import load_model

    against = [a.strip() for a in args.against.split(",") if a.strip()]
    takes = ("jit", "jit-eager", *registry.names())  # kvtrace.jit's two backends, then every artifact backend
    unknown = sorted(set(against) - set(takes))
    if unknown:
        raise UsageError(f"--against takes {', '.join(takes)}; got {unknown}")
    if not against and not args.artifact:
        raise UsageError("nothing to verify: --against is empty and no --artifact given; "
                         "pass e.g. --against jit,exported")
    for f in args.artifact:
        if not Path(f).is_file():
            raise UsageError(f"--artifact {f} does not exist; expected a file written by `kvtrace export`")
    from kvtrace.spec.device import check_available, concrete
    from kvtrace.spec.device import resolve as resolve_device

    dtype = DTYPES[args.dtype]
    device = resolve_device(getattr(args, "device", None), what="--device")
    check_available(device, f"verify --device {device}")
    device = concrete(device)
    with step(f"loading {args.source}"):
        lm = load_model(args.source, dtype=dtype)
        lm.model.to(device)  # our own copy: eager, jit and every export run on the device
    tok = lm.tokenizer
    ids = [encode_prompt(tok, text, chat=args.chat, template=lm.chat_template, bos_id=lm.bos_id, eos_ids=lm.eos_ids,
                         require_template=False) for text in _prompts(args)]
    longest = max(len(i) for i in ids) + args.steps
    asked = getattr(args, "max_seq_len", None)
    if asked is None:  # 256, unless the model was built for fewer positions (its export would refuse 256)
        from kvtrace.spec.config import max_positions

        asked = min(DEFAULT_MAX_SEQ_LEN, max_positions(lm.model.config) or DEFAULT_MAX_SEQ_LEN)
    max_seq_len = max(asked, longest)
    prompts: list[Prompt] = [Prompt(i) for i in ids]
    image_tokens = None
    if getattr(args, "image_features", None):
        from kvtrace.models.mllama import is_mllama
        from kvtrace.spec.program import read_inputs_file

        if not is_mllama(lm.model.config):
            raise UsageError(f"--image-features needs a vision decoder (MllamaForCausalLM); {args.source} is a "
                             f"text-only {lm.model.config.model_type!r} model")
        states = read_inputs_file(args.image_features).get("cross_attention_states")
        if states is None or states.dim() != 3:
            raise UsageError(f"--image-features {args.image_features} needs a tensor named cross_attention_states "
                             "of shape [1, N, dim]")
        image_tokens = states.shape[1]
        prompts = [Prompt(i, {"cross_attention_states": states.to(device=device, dtype=dtype)}) for i in ids] + prompts
    cands: list[Runner] = []
    with tempfile.TemporaryDirectory(prefix="kvtrace-verify-") as tmp:
        for a in against:
            if a in ("jit", "jit-eager"):
                cands.append(JitRunner(lm.model, backend="inductor" if a == "jit" else "eager"))
            else:
                try:
                    with step(f"exporting ({a})"):
                        path = export(lm.model, Path(tmp) / f"{a}.kvt", max_seq_len=max_seq_len, dtype=args.dtype,
                                      backend=a, image_tokens=image_tokens, kv_dtype=getattr(args, "kv_dtype", None),
                                      device=device, quant=getattr(args, "quant", None),
                                      quant_head=getattr(args, "quant_head", True),
                                      quant_group_size=getattr(args, "quant_group_size", None))
                    cands.append(SessionRunner(load(path, device=device).session(), a))
                except Exception as e:  # reported in the table; the other candidates still run
                    cands.append(Unavailable(a, f"export ({a}) {_describe(e)}"))
        for f in args.artifact:
            try:
                art = load(f, device=device)  # a slots artifact: its last slot, driven like a Session
                session = art.slot_session() if art.manifest.programs["prefill"].slots else art.session()
            except Exception as e:
                cands.append(Unavailable(Path(f).name, f"loading {f} {_describe(e)}"))
                continue
            if art.cache_spec.dtype != args.dtype:  # else a bf16 artifact FAILs at float32's tolerance, unexplained
                raise UsageError(f"--artifact {f} holds a {art.cache_spec.dtype} model, but the reference runs in "
                                 f"{args.dtype}; pass --dtype {art.cache_spec.dtype}")
            cands.append(SessionRunner(session, Path(f).name))
        with step(f"verifying {len(cands)} candidate(s) on {len(prompts)} prompts x (prefill + {args.steps} steps)"):
            fp32 = None
            if dtype != torch.float32 and getattr(args, "fp32_reference", True):
                import copy

                fp32 = EagerRunner(copy.deepcopy(lm.model).float(), name="eager-fp32")
            from kvtrace.tools.verify_kv import verify_by_cache

            # candidates with an int8 cache are judged against the same decoder with the same cache (verify_kv)
            return verify_by_cache(lm.model, EagerRunner(lm.model), cands, prompts, steps=args.steps, dtype=dtype,
                                   fp32=fp32, floor=getattr(args, "noise_floor", True))
