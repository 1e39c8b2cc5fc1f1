"""kvtrace lint's sliding-window phase (tools/lint/sliding.py): the window crossed and wrapped, a cache that
grows unbounded flagged even when the logits match."""

from __future__ import annotations

import pytest
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import kvtrace.runtime.jit_call as jit_call
from conftest import tiny_model
from kvtrace.tools.lint import EXPECTED_PROGRAMS, KINDS, lint
from kvtrace.tools.lint.sliding import _classes, expected_programs, sliding_steps, windows

SLIDING_MODELS = [("mistral", {"sliding_window": 4}), ("gemma2", {}),
                  ("qwen2", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1})]


def test_the_phase_runs_only_for_declared_sliding_layers_and_crosses_then_wraps_the_window():
    assert windows(tiny_model("llama").config) == {}
    assert windows(tiny_model("mistral", sliding_window=4).config) == {0: 4, 1: 4}
    assert windows(tiny_model("qwen2", sliding_window=4, use_sliding_window=True, max_window_layers=1).config) == {1: 4}
    assert windows(tiny_model("gemma2").config) == {0: 8}  # layer_types [sliding, full]
    steps = sliding_steps(4)
    positions = [0]
    for n, _ in steps:
        positions.append(positions[-1] + n)
    assert [n for n, _ in steps] == [2, 1, 1, 1, 5, 1, 3, 1]
    crossing = [d for _, d in steps if "crossing" in d]
    assert crossing == ["decode 1 token at position 3 (crossing the window)"]  # 3 < 4 <= 4
    assert any("wraps" in d and n > 4 for n, d in steps)
    assert positions[-1] > 2 * 4 and "sliding" in KINDS


def test_a_sliding_cache_that_grows_unbounded_is_flagged(monkeypatch):
    # Planted fault (the transformers bug): sliding layers that keep every token like full ones, while the
    # sliding mask still hides the old ones from attention, so the logits stay right
    for name in ("update", "get_mask_sizes", "get_seq_length"):
        monkeypatch.setattr(DynamicSlidingWindowLayer, name, getattr(DynamicLayer, name))
    report = lint(tiny_model("mistral", sliding_window=4))
    grows = [f for f in report.of_kind("sliding") if "grows unbounded" in f.message]
    assert [f.message.split(" cache")[0] for f in grows] == ["eager's", "the caller's"], str(report)  # once each
    first = grows[0]
    assert first.message.startswith("eager's cache layers 0, 1 (DynamicSlidingWindowLayer) hold 4 tokens at "
                                    "position 4; a sliding window of 4 keeps the last 3"), first.message
    assert "crossing the window" in first.where
    assert not report.of_kind("mismatch")  # the logits matched all along: only the cache contents show it


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("mistral", {"sliding_window": None})])
def test_models_without_windows_run_the_main_scenario_only(arch, overrides):
    report = lint(tiny_model(arch, **overrides))
    assert len(report.calls) == 6 and not report.of_kind("sliding")


def test_the_phase_expects_one_program_per_regime_and_size_class_it_reaches():
    """The module docstring's table: fresh filling prefill, decodes reaching, crossing and past the window,
    extends past it (windows 4 and 8 alike)."""
    want = [(True, (2, 0), "filling"), (False, (1, 2), "reaching"), (False, (1, 2), "crossing"),
            (False, (1, 2), "full"), (False, (2, 2), "full")]
    for arch, overrides in SLIDING_MODELS:
        config = tiny_model(arch, **overrides).config
        assert list(dict.fromkeys(_classes(config))) == want, arch
        assert expected_programs(config) == len(want)
    assert expected_programs(tiny_model("llama").config) == 0


@pytest.mark.parametrize("arch,overrides", SLIDING_MODELS, ids=[a for a, _ in SLIDING_MODELS])
def test_crossing_and_wrapping_the_window_is_clean_with_one_program_per_regime(arch, overrides):
    model = tiny_model(arch, **overrides)
    report = lint(model)
    assert report.ok, str(report)
    assert report.expected == EXPECTED_PROGRAMS + expected_programs(model.config) > EXPECTED_PROGRAMS
    assert report.captures == report.expected, str(report)


def test_a_jit_that_keys_no_regime_is_flagged(monkeypatch):
    """Planted fault: the regime left out of the key, so one program per size class meets calls on both sides
    of the window and the jit pins lengths (captures per call near the window)."""
    monkeypatch.setattr(jit_call, "sliding_regime", lambda t_len, past, windows, static=False: "")
    report = lint(tiny_model("mistral", sliding_window=4))
    assert report.captures > report.expected
    counted = [f for f in report.of_kind("sliding") if "programs captured over the sliding-window phase" in f.message]
    assert len(counted) == 1, str(report)
    assert any("pinned a length" in f.message for f in report.of_kind("specialization")), str(report)
