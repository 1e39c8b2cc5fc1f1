"""The lint scenario: ``lint(model)`` drives ``kvtrace.jit`` through SCENARIO and collects the findings.

Each call runs eager on copies first (the reference), then the jitted model on the caller's objects;
``mutation`` compares what both left, ``guards`` checks every captured program against the lengths of
its size class, ``graph_diff`` captures it again with other example lengths and compares the graphs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from kvtrace._errors import one_line
from kvtrace.spec.tolerances import close, tolerance_for
from kvtrace.tools.lint import jit_view
from kvtrace.tools.lint.graph_diff import _diff_programs, _recapture_with
from kvtrace.tools.lint.guards import _Capture, _check_guards, _program_name, recording_jit
from kvtrace.tools.lint.mutation import _differences, _model_state, _out_cache, _same_model, _state
from kvtrace.tools.lint.report import EXPECTED_PROGRAMS, SCENARIO, Finding, LintReport
from kvtrace.tools.lint.sliding import expected_programs, sliding_phase, sliding_recapture_lengths

__all__ = ["lint", "run_cli_lint"]

# Example sizes of the second capture of each program (the first is jit's own: jit_view.example_lengths).
_T_B, _P_B = 7, 11


def _default_inputs(model: torch.nn.Module) -> Callable[[int], dict[str, torch.Tensor]]:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device

    def make(n: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(device)}

    return make


def lint(model: torch.nn.Module, *, make_inputs: Callable[[int], Any] | None = None) -> LintReport:
    """Capture ``model`` with ``kvtrace.jit`` over prompts of different lengths and report what is wrong.

    Args:
        model: an HF causal LM (eval mode), as for ``kvtrace.jit``.
        make_inputs: ``make_inputs(n)`` -> the new-token inputs of one call with ``n`` tokens, a dict such as
            ``{"input_ids": LongTensor[B, n]}`` or ``{"inputs_embeds": ...}`` (or the ``input_ids`` tensor).
            Default: random token ids, batch 1. ``attention_mask`` and the cache are added by lint.

    Returns:
        a ``LintReport``; ``report.ok`` when there are no findings.
    """
    from transformers import DynamicCache

    from kvtrace.cache.hf import cache_kwarg_name, kv_geometry

    t_ex, p_ex = jit_view.example_lengths()
    make = make_inputs or _default_inputs(model)
    jm, lint_captures = recording_jit(model)
    cache_kw = cache_kwarg_name(model)
    n_layers = kv_geometry(model.config)[0]
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    max_len = getattr(cfg, "max_position_embeddings", None)
    findings: list[Finding] = []
    calls: list[str] = []

    run = _Runner(model, jm, make, cache_kw, findings, calls)
    steps = []
    for prompt, more in SCENARIO:
        steps.append((prompt, 0, f"prefill {prompt} tokens on a fresh DynamicCache"))
        steps.append((more, prompt, f"{'decode 1 token' if more == 1 else f'extend by {more} tokens'} at position {prompt}"))
    cache: Any = None
    programs_by_kind: dict[Any, Any] = {}  # (cache kind, size classes) -> key of the first program captured for it
    for i, (n, past, desc) in enumerate(steps):
        if past == 0:
            cache = DynamicCache()
        cache, new_keys = run.call(n, past, desc, cache, f"call {i + 1} of the lint scenario ({desc})")
        for key in new_keys:
            first = programs_by_kind.setdefault((key.cache.value, key.sizes), key)
            if first is not key:
                changed = {f.name: getattr(key, f.name) for f in dataclasses.fields(key)
                           if getattr(key, f.name) != getattr(first, f.name)}
                why = (f"whose key differs from the first one's in {changed}" if changed else
                       "with the same key: kvtrace.jit dropped its programs because the model's parameters or "
                       "buffers were replaced since the first capture")
                findings.append(Finding("recapture", f"a second {key.cache.value} program was captured {why}",
                                        f"call {i + 1} of the lint scenario ({desc})"))
    scenario_captures = jm.stats.captures
    findings.extend(sliding_phase(run, model.config, len(steps)))
    if scenario_captures > EXPECTED_PROGRAMS:
        findings.append(Finding("recapture", f"{scenario_captures} programs captured over {len(steps)} calls; "
                                f"expected {EXPECTED_PROGRAMS} (one per cache kind and size class of T and P, "
                                "whatever the lengths)",
                                "kvtrace.jit stats"))
    for s in jm.stats.specializations:
        findings.append(Finding("specialization", f"kvtrace.jit pinned a length: {s}", "kvtrace.jit capture"))

    first_caps: dict[Any, _Capture] = {}  # per program key, jit's first (non-exact) capture
    for c in lint_captures:
        if not c.exact and c.ep is not None:
            first_caps.setdefault(c.call.key, c)
    for cap in first_caps.values():
        findings.extend(_check_guards(cap, n_layers, max_len))
        prog = _program_name(cap.call)
        fresh = cap.call.key.cache.value == "dynamic-fresh"
        t_class, p_class = cap.call.key.sizes
        if t_class < 2 and (fresh or p_class < 2):
            continue  # every length of this program is fixed by its size class: nothing to vary
        t_a, t_b = (t_ex, _T_B) if t_class == 2 else (t_class, t_class)
        p_a, p_b = (0, 0) if fresh else (p_ex, _P_B) if p_class == 2 else (p_class, p_class)
        if cap.call.key.regime:  # sliding layers: both captures' lengths inside the key's regime
            lengths = sliding_recapture_lengths(cap.call.key, (_T_B, _P_B))
            if lengths is None:
                continue  # the regime holds one (T, P) of these size classes: nothing to vary
            (t_a, p_a), (t_b, p_b) = lengths
        sizes_a = f"T={t_a}" + ("" if fresh else f", P={p_a}")
        sizes_b = f"T={t_b}" + ("" if fresh else f", P={p_b}")
        try:
            other = _recapture_with(jm, cap, t_b, p_b)
        except Exception as e:
            findings.append(Finding("specialization", f"{prog}: capturing it again with {sizes_b} failed "
                                    f"({one_line(e)})", "torch.export"))
            continue
        findings.extend(_diff_programs(prog, cap, other, sizes_a, sizes_b))
    return LintReport(model=type(model).__name__, calls=tuple(calls), captures=jm.stats.captures,
                      findings=tuple(_dedupe(findings)), expected=EXPECTED_PROGRAMS + expected_programs(model.config))


class _Runner:
    """One call of a scenario: eager on copies (the reference), then the jitted model on the caller's objects;
    findings of kinds mutation, mismatch and error go to ``findings``."""

    def __init__(self, model: torch.nn.Module, jm: Any, make: Callable[[int], Any], cache_kw: str,
                 findings: list[Finding], calls: list[str]):
        self.model, self.jm, self.make, self.cache_kw = model, jm, make, cache_kw
        self.findings, self.calls = findings, calls
        self.eager_cache: Any = None  # what eager left after the last call

    def call(self, n: int, past: int, desc: str, cache: Any, where: str) -> tuple[Any, list[Any]]:
        """Run one call of ``n`` new tokens on ``cache`` (holding ``past``); returns the cache to continue
        with and the keys of the programs it captured."""
        model, jm, cache_kw, findings = self.model, self.jm, self.cache_kw, self.findings
        self.calls.append(desc)
        new = self.make(n)
        new = {"input_ids": new} if isinstance(new, torch.Tensor) else dict(new)
        main = next(iter(new.values()))
        mask = torch.ones(main.shape[0], past + n, dtype=torch.int64, device=main.device)
        kwargs = {**new, "attention_mask": mask, cache_kw: cache, "use_cache": True}
        eager_cache = copy.deepcopy(cache)
        eager_inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items() if k != cache_kw}
        before_eager = _model_state(model)
        with torch.no_grad():
            eager = model(**eager_inputs, **{cache_kw: eager_cache})
        self.eager_cache = eager_cache
        for d in _same_model(before_eager, _model_state(model)):
            findings.append(Finding("mutation", f"the model's own eager forward: {d} (kvtrace.jit recaptures "
                                    "whenever weights are replaced)", where))
        before_cache = _state(cache, "cache", {})
        before_inputs = _state({k: v for k, v in kwargs.items() if k != cache_kw}, "inputs", {})
        before_model = _model_state(model)
        captures = jm.stats.captures
        keys_before = jit_view.program_keys(jm)
        try:
            with torch.no_grad():
                out = jm(**kwargs)
        except Exception as e:
            out = None
            findings.append(Finding("error", one_line(e), where))
        after_inputs = _state({k: v for k, v in kwargs.items() if k != cache_kw}, "inputs", {})
        want_inputs = _state(eager_inputs, "inputs", {}) if out is not None else before_inputs
        for d in _differences(after_inputs, want_inputs, exact=out is None):
            findings.append(Finding("mutation", f"the caller's {d}", where))
        for d in _same_model(before_model, _model_state(model)):
            findings.append(Finding("mutation", f"the model: {d}", where))
        if out is None:  # a failed call must leave the caller's cache as it was
            for d in _differences(_state(cache, "cache", {}), before_cache, exact=True):
                findings.append(Finding("mutation", f"after the failed call the caller's {d}", where))
            cache = eager_cache  # continue the scenario from eager's state
        else:
            if _out_cache(out) is not cache and _out_cache(eager) is eager_cache:
                findings.append(Finding("mutation", "the output's past_key_values is not the caller's cache object "
                                        "(eager returns the same object)", where))
            for d in _differences(_state(cache, "cache", {}), _state(eager_cache, "cache", {}), exact=False):
                findings.append(Finding("mutation", f"the caller's {d}", where))
            ok, diff, lim = _close(out.logits, eager.logits)
            if not ok:
                findings.append(Finding("mismatch", f"logits differ from eager by {diff:.3g} > {lim:.3g}", where))
        new_keys = [k for k in jit_view.program_keys(jm) if k not in keys_before] if jm.stats.captures > captures else []
        return cache, new_keys


def _close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float, float]:
    if a.shape != b.shape:
        return False, math.inf, 0.0
    return close(a, b, tolerance_for(b.dtype))


def _dedupe(findings: list[Finding]) -> list[Finding]:
    return list(dict.fromkeys(findings))


def run_cli_lint(args: Any, step: Any) -> LintReport:
    """What ``kvtrace lint SOURCE [--dtype D]`` runs: load the model, lint it (the CLI prints and exits 0/1)."""
    from kvtrace.artifact.export import DTYPES
    from kvtrace.sources.load import load_model

    with step(f"loading {args.source}"):
        lm = load_model(args.source, dtype=DTYPES[args.dtype])
    with step(f"capturing {len(SCENARIO) * 2} calls of different lengths with kvtrace.jit"):
        return lint(lm.model)
