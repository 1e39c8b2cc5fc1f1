"""kvtrace lint: reports lengths baked into a capture, recaptures and mutations; nothing for the real adapters."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch
import transformers as tf

from conftest import TINY, tiny_model
from helpers import BakedLength, BranchOnLength
from kvtrace.cache import hf as _hf_cache
from kvtrace.tools.lint import EXPECTED_PROGRAMS, KINDS, Finding, LintReport, lint


class BranchOnPosition(tf.LlamaForCausalLM):
    """Branches on the cache's length, i.e. on the position the new tokens start at."""

    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        out = super().forward(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
        if past_key_values is not None and past_key_values.get_seq_length() > 6:
            out.logits = out.logits + 1
        return out


def planted(cls: type) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(tf.LlamaConfig(**TINY)).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def planted_report():
    """lint() of each planted model, run once per module."""
    reports: dict[type, LintReport] = {}

    def get(cls: type) -> LintReport:
        if cls not in reports:
            reports[cls] = lint(planted(cls))
        return reports[cls]

    return get


def show(report: LintReport) -> str:
    return "\n".join(report.lines())


@pytest.mark.parametrize(
    ("cls", "kind", "where"),
    [
        (BranchOnLength, "specialization", "if input_ids.shape[1] > 4:"),
        (BakedLength, "specialization", "n = int(input_ids.shape[1])"),
        (BakedLength, "baked-constant", "out.logits = out.logits * n"),
        (BranchOnPosition, "specialization", "past_key_values.get_seq_length() > 6"),
    ],
    ids=["branch-on-length", "int-of-length-guard", "int-of-length-literal", "branch-on-position"],
)
def test_lint_reports_a_planted_length(cls, kind, where, planted_report):
    report = planted_report(cls)
    assert not report.ok
    hits = [f for f in report.of_kind(kind) if where in f.where]
    assert hits, f"no {kind} finding at {where!r}:\n{show(report)}"
    assert all(f.kind in KINDS for f in report.findings)
    model_file = Path(inspect.getsourcefile(cls)).name  # this file, or tests/helpers.py for the shared ones
    assert f"{model_file}:" in hits[0].where  # the line in the planted model's file, not in torch or transformers
    # every planted length is a guard on it, whatever else is found; and no wrong result: jit pinned the length
    assert report.of_kind("specialization"), show(report)
    assert not report.of_kind("mismatch") and not report.of_kind("error"), show(report)


def test_lint_names_the_length_and_the_node(planted_report):
    report = planted_report(BakedLength)
    guard = next(f for f in report.of_kind("specialization") if "int(input_ids.shape[1])" in f.where)
    assert "input_ids.shape[1]" in guard.message and "T=" in guard.message
    literal = next(f for f in report.of_kind("baked-constant") if "out.logits * n" in f.where)
    assert "literal 3" in literal.message and "7" in literal.message  # T=3 in jit's capture, T=7 in lint's
    assert literal.where.startswith("node mul")
    position = planted_report(BranchOnPosition)
    assert any("past length P" in f.message for f in position.of_kind("specialization")), show(position)


@pytest.fixture(scope="module")
def adapter_report():
    reports: dict[str, LintReport] = {}

    def get(arch: str) -> LintReport:
        if arch not in reports:
            reports[arch] = lint(tiny_model(arch))
        return reports[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_lint_reports_nothing_for_the_real_adapters(arch, adapter_report):
    report = adapter_report(arch)
    assert report.findings == (), show(report)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_real_adapters_capture_once_per_size_class_with_no_length_baked_in(arch, adapter_report):
    """Three prompts (5+1, 9+3, and the shortest 1+1): one program per cache kind and size class of (T, P) —
    fresh T>=2, decode T=1, extend T>=2, fresh T=1, decode T=1 at P=1 — and the second prompt reuses them."""
    report = adapter_report(arch)
    assert EXPECTED_PROGRAMS == 5
    assert report.captures == EXPECTED_PROGRAMS and len(report.calls) == 6
    doc = json.loads(report.to_json())
    assert doc["captures"] == EXPECTED_PROGRAMS and len(doc["findings"]) == len(report.findings)


def test_lint_reports_recaptures_and_cache_mutations(monkeypatch):
    write_back = _hf_cache.write_back_dynamic

    def sloppy_write_back(cache, new_state):  # what a buggy epilogue could do
        write_back(cache, new_state)
        cache.layers[1].values = cache.layers[1].values * 1.5
        cache.kvtrace_note = "written"

    monkeypatch.setattr(_hf_cache, "write_back_dynamic", sloppy_write_back)
    calls = []

    def int32_after_first_call(n):  # the first prompt's ids are int64, later ones int32: a new program key
        calls.append(n)
        return {"input_ids": torch.randint(0, 128, (1, n), dtype=torch.int64 if len(calls) == 1 else torch.int32)}

    report = lint(tiny_model("llama"), make_inputs=int32_after_first_call)
    assert calls == [5, 1, 9, 3, 1, 1]
    recaptures = report.of_kind("recapture")
    assert any("dtypes" in f.message and "call 3" in f.where for f in recaptures), show(report)
    assert any(f"{EXPECTED_PROGRAMS + 1} programs captured over 6 calls" in f.message for f in recaptures), show(report)
    mutations = report.of_kind("mutation")
    for i in range(1, 7):
        assert any(f"call {i} " in f.where and "cache.layers[1].values" in f.message for f in mutations), show(report)
    assert any("cache.kvtrace_note is set" in f.message for f in mutations), show(report)
    assert not report.of_kind("specialization") and not report.of_kind("baked-constant"), show(report)


def test_report_is_frozen_and_serialisable():
    f = Finding("baked-constant", "node mul_1 holds the literal 3", "node mul_1 (mul.Tensor) from model.py:3 in forward")
    report = LintReport(model="M", calls=("prefill 5 tokens",), captures=2, findings=(f,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.captures = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.kind = "x"  # type: ignore[misc]
    doc = json.loads(report.to_json())
    assert doc["ok"] is False and doc["findings"] == [dataclasses.asdict(f)]
    assert "[baked-constant] node mul_1 holds the literal 3" in str(report)
    assert "at node mul_1 (mul.Tensor) from model.py:3 in forward" in str(report)


def _lint_sources() -> dict[str, str]:
    from pathlib import Path

    import kvtrace.tools.lint

    return {p.name: p.read_text() for p in sorted(Path(kvtrace.tools.lint.__file__).parent.glob("*.py"))}


def test_only_jit_view_reads_jit_internals():
    """kvtrace.runtime.jit is imported, and a JittedModel's private attributes read, in lint/jit_view.py only."""
    import ast

    srcs = _lint_sources()
    assert "jit_view.py" in srcs and "scenario.py" in srcs
    for name, text in srcs.items():
        tree = ast.parse(text)
        imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imports |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id == "jm" and n.attr.startswith("_")]
        if name == "jit_view.py":
            assert "kvtrace.runtime.jit" in imports and private == ["_programs"]
        else:
            assert not any(m and m.startswith("kvtrace.runtime") for m in imports), name
            assert private == [], f"{name} reads {private} of the jitted model"


def test_lint_judges_closeness_with_the_shared_tolerances():
    """No tolerance arithmetic of lint's own: every "within tolerance of eager" goes through spec.tolerances."""
    import ast

    for name, text in _lint_sources().items():
        calls = [n.func.attr for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr in ("limit", "isclose", "allclose")]
        assert calls == [], f"lint/{name} computes a tolerance itself ({calls}); use kvtrace.spec.tolerances"


def test_guard_locations_skip_all_of_kvtrace():
    """The line a guard is reported at is the model's own, never a frame of kvtrace's (jit, capture, cache)."""
    import os

    import kvtrace
    from kvtrace.tools.lint import guards

    assert os.path.dirname(kvtrace.__file__) + os.sep in guards._SKIP_DIRS
