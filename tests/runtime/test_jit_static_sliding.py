"""kvtrace.jit with a StaticCache holding sliding-window layers (StaticSlidingWindowLayer): what
``StaticCache(config=model.config, max_cache_len=...)`` builds for Mistral, hybrid Qwen2 or Gemma 3, and what
``generate(cache_implementation="static")`` and torch.compile users run.

Such a layer holds a static [B, H_kv, W, D] and branches on a Python int P (``cumulative_length_int``); the
program takes P as a symbolic size and is keyed by the regime (filling, crossing, full; ``jit_call``), and the
epilogue advances the int. Each test runs the same calls through kvtrace.jit and eagerly on two caches and
compares logits and every layer (keys, values, the cumulative_length tensor and int) after every call.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

import kvtrace
from conftest import tiny_model
from helpers import assert_close

W = 8
STEPS = 30


def prompt(n: int, batch: int = 1, seed: int | None = None) -> torch.Tensor:
    return torch.randint(3, 100, (batch, n), generator=torch.Generator().manual_seed(n if seed is None else seed))


def assert_same_static_cache(jc: Any, ec: Any, what: str, dtype: torch.dtype = torch.float32) -> None:
    for i, (a, b) in enumerate(zip(jc.layers, ec.layers, strict=True)):
        assert type(a) is type(b), f"{what}: layer {i}"
        assert getattr(a, "cumulative_length_int", None) == getattr(b, "cumulative_length_int", None), f"{what}: {i}"
        assert torch.equal(a.cumulative_length, b.cumulative_length), f"{what}: layer {i} cumulative_length"
        for name in ("keys", "values"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape, f"{what}: layer {i} {name} {tuple(x.shape)} vs {tuple(y.shape)}"
            assert_close(x, y, dtype, f"{what}: layer {i} {name}")


def generate(model: Any, jm: Any, n_prompt: int, max_len: int, steps: int = STEPS, mask: bool = False) -> int:
    """Prefill then greedy decode through ``jm`` and eagerly, each on its own StaticCache; returns P at the end."""
    jc = StaticCache(config=model.config, max_cache_len=max_len)
    ec = StaticCache(config=model.config, max_cache_len=max_len)
    ids, seen = prompt(n_prompt), 0
    dtype = next(model.parameters()).dtype
    for step in range(steps + 1):
        seen += ids.shape[1]
        kw = {"attention_mask": torch.ones(1, seen, dtype=torch.long)} if mask else {}
        jo = jm(input_ids=ids, past_key_values=jc, use_cache=True, **kw)
        eo = model(input_ids=ids, past_key_values=ec, use_cache=True, **kw)
        assert jo.past_key_values is jc
        assert_close(jo.logits, eo.logits, dtype, f"step {step} logits")
        assert_same_static_cache(jc, ec, f"step {step}", dtype)
        ids = eo.logits[:, -1:].argmax(-1)
    return jc.get_seq_length()


def regimes(jm: Any) -> set[tuple[tuple[int, int], str]]:
    return {(key.sizes, key.regime) for key in jm._programs}


def test_mistral_prompt_past_the_window_runs_on_two_programs_and_past_max_cache_len():
    """Every layer slides, so nothing bounds the positions (eager runs past max_cache_len=16 too): a prefill
    crossing the window (P = 0), then one decode program for every P >= W."""
    model = tiny_model("mistral", sliding_window=W)
    assert all(type(x) is StaticSlidingWindowLayer for x in StaticCache(config=model.config, max_cache_len=16).layers)
    jm = kvtrace.jit(model, backend="eager")
    assert generate(model, jm, 11, max_len=16) == 11 + STEPS > 16
    assert regimes(jm) == {((2, 0), "crossing"), ((1, 2), "full")}
    assert jm.stats.captures == 2 and jm.stats.specializations == []


def test_a_short_prompt_decodes_into_the_window_then_past_it():
    """P = 3 .. 33: decode writes in place while P + 1 < W (filling, P symbolic) and at P + 1 = W (reaching: the
    mask needs no padding), then rolls (full)."""
    model = tiny_model("mistral", sliding_window=W)
    jm = kvtrace.jit(model, backend="eager")
    assert generate(model, jm, 3, max_len=48, mask=True) == 3 + STEPS
    assert regimes(jm) == {((2, 0), "filling"), ((1, 2), "filling"), ((1, 2), "reaching"), ((1, 2), "full")}
    assert jm.stats.captures == 4 and jm.stats.specializations == []


def test_hybrid_qwen2_full_layer_static_and_sliding_layer_windowed():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=W, max_window_layers=1)
    cache = StaticCache(config=model.config, max_cache_len=48)
    assert [type(x) for x in cache.layers] == [StaticLayer, StaticSlidingWindowLayer]
    jm = kvtrace.jit(model, backend="eager")
    assert generate(model, jm, 11, max_len=48, mask=True) == 11 + STEPS
    assert jm.stats.captures == 2 and jm.stats.specializations == []


def test_gemma3_hybrid_static_cache():
    model = tiny_model("gemma3_text")
    assert {type(x) for x in StaticCache(config=model.config, max_cache_len=48).layers} == {
        StaticLayer, StaticSlidingWindowLayer}
    jm = kvtrace.jit(model, backend="eager")
    assert generate(model, jm, 5, max_len=48) == 5 + STEPS
    assert jm.stats.specializations == []


def test_random_chunks_batch_2_with_a_mask_every_regime():
    """Calls of 1..9 tokens at random, batch 2: filling, crossing from P = 0, 1 and >= 2, and full, each
    equal to eager's; programs bounded by the regimes x size classes met."""
    model = tiny_model("mistral", sliding_window=W)
    jm = kvtrace.jit(model, backend="eager")
    rng = random.Random(0)
    for trial in range(5):
        jc = StaticCache(config=model.config, max_cache_len=64)
        ec = StaticCache(config=model.config, max_cache_len=64)
        for call in range(6):
            n = rng.choice([1, 2, 3, 5, 7, 9])
            ids = prompt(n, batch=2, seed=10 * trial + call)
            mask = torch.ones(2, jc.get_seq_length() + n, dtype=torch.long)
            assert_close(jm(input_ids=ids, past_key_values=jc, attention_mask=mask).logits,
                         model(input_ids=ids, past_key_values=ec, attention_mask=mask).logits, torch.float32,
                         f"trial {trial} call {call} (T={n})")
            assert_same_static_cache(jc, ec, f"trial {trial} call {call}")
    assert jm.stats.calls == 30 and jm.stats.specializations == []
    # one program per (size classes x regime) met: T 1 / >= 2, P 0 / 1 / >= 2, four regimes
    assert jm.stats.captures == len(jm._programs) <= 16


def test_full_layers_still_bound_a_hybrid_static_cache():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=W, max_window_layers=1)
    jm = kvtrace.jit(model, backend="eager")
    cache = StaticCache(config=model.config, max_cache_len=12)
    jm(input_ids=prompt(10), past_key_values=cache, use_cache=True)
    with pytest.raises(kvtrace.CacheOverflowError, match="holds 12 positions; 10 are used and the call adds 3"):
        jm(input_ids=prompt(3), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 10  # nothing written


def test_layers_that_disagree_about_the_past_are_a_usage_error_and_nothing_is_written():
    model = tiny_model("mistral", sliding_window=W)
    jm = kvtrace.jit(model, backend="eager")
    cache = StaticCache(config=model.config, max_cache_len=16)
    jm(input_ids=prompt(5), past_key_values=cache, use_cache=True)
    cache.layers[1].cumulative_length_int = 7
    before = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]
    with pytest.raises(kvtrace.UsageError, match=r"different lengths \[5, 7\]"):
        jm(input_ids=prompt(1), past_key_values=cache, use_cache=True)
    after = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.compile
def test_mistral_static_sliding_through_aoti():
    model = tiny_model("mistral", sliding_window=W)
    jm = kvtrace.jit(model)
    assert generate(model, jm, 11, max_len=48, mask=True) == 11 + STEPS
    assert jm.stats.captures == 2 and jm.stats.specializations == []
