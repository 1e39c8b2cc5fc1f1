"""kvtrace.jit with HF sliding-window caches: a DynamicCache(config=...) holding DynamicSlidingWindowLayer layers.

A tiny random Mistral with sliding_window=8 (every layer sliding) and a hybrid Qwen2 (layer 0 full, layer 1
sliding), each run through kvtrace.jit and eagerly on a separate cache: logits per step, and after prefill
and every step every layer's keys/values (the last window - 1 tokens of a sliding layer), its
cumulative_length and its type.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

import kvtrace
from conftest import make_tiny_hf_dir, tiny_model
from helpers import assert_close
from kvtrace.cli.main import main
from kvtrace.tools.runners import EagerRunner, JitRunner
from kvtrace.tools.verify import verify

W = 8
STEPS = 30


def mistral() -> Any:
    return tiny_model("mistral", sliding_window=W)


def hybrid_qwen2() -> Any:
    return tiny_model("qwen2", use_sliding_window=True, sliding_window=W, max_window_layers=1)


def prompt(n: int) -> torch.Tensor:
    return torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(n))


def assert_same_cache(jc: Any, ec: Any, what: str, dtype: torch.dtype = torch.float32) -> None:
    """Every layer: the same type, cumulative_length, and keys/values of the same shape and contents."""
    assert len(jc.layers) == len(ec.layers)
    for i, (a, b) in enumerate(zip(jc.layers, ec.layers, strict=True)):
        assert type(a) is type(b), f"{what}: layer {i} is {type(a).__name__}, eager {type(b).__name__}"
        assert getattr(a, "cumulative_length", None) == getattr(b, "cumulative_length", None), f"{what}: layer {i}"
        for name in ("keys", "values"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.shape == y.shape, f"{what}: layer {i} {name} {tuple(x.shape)} vs {tuple(y.shape)}"
            assert_close(x, y, dtype, f"{what}: layer {i} {name}")


def generate(model: Any, jm: Any, n_prompt: int, mask: bool = False, steps: int = STEPS) -> tuple[float, int]:
    """Prefill ``n_prompt`` tokens then STEPS greedy decode steps through ``jm`` and eagerly; the max logit
    diff and the final past length."""
    jc, ec = DynamicCache(config=model.config), DynamicCache(config=model.config)
    layers = list(jc.layers)
    ids, worst, seen = prompt(n_prompt), 0.0, 0
    dtype = next(model.parameters()).dtype
    for step in range(steps + 1):
        seen += ids.shape[1]
        kw = {"attention_mask": torch.ones(1, seen, dtype=torch.long)} if mask else {}
        jo = jm(input_ids=ids, past_key_values=jc, use_cache=True, **kw)
        eo = model(input_ids=ids, past_key_values=ec, use_cache=True, **kw)
        assert jo.past_key_values is jc and jc.layers == layers  # the caller's object and its layers, kept
        worst = max(worst, assert_close(jo.logits, eo.logits, dtype, f"step {step} logits"))
        assert_same_cache(jc, ec, f"step {step}", dtype)
        ids = eo.logits[:, -1:].argmax(-1)
    return worst, jc.get_seq_length()


def test_mistral_prompt_past_the_window_then_30_steps_two_programs():
    model = mistral()
    assert all(type(layer) is DynamicSlidingWindowLayer for layer in DynamicCache(config=model.config).layers)
    jm = kvtrace.jit(model, backend="eager")
    worst, past = generate(model, jm, 11)
    assert past == 11 + STEPS and worst < 1e-5
    # one prefill program (fresh cache, T = 11) and one decode program for every P >= W: no recompiles
    assert jm.stats.captures == 2 and jm.stats.specializations == []


def test_mistral_short_prompt_crosses_the_window_while_decoding():
    """P = 3 .. 33: below the window HF's sliding code branches on P (stored tail shorter than W - 1, exactly
    W - 1 after this call, exactly W - 1 before it, full), so decode needs its own program on each side (its
    regime, part of the key: no program pinned to a length); past the window (P >= W) one program serves every
    step."""
    model = mistral()
    jm = kvtrace.jit(model, backend="eager")
    worst, past = generate(model, jm, 3, mask=True)
    assert past == 3 + STEPS and worst < 1e-5
    # prefill; decode P = 3..5 (filling), P = 6 (reaching), P = 7 (crossing), P >= 8 (full): one key each
    assert jm.stats.captures == 5 and jm.stats.specializations == []
    calls, captures = jm.stats.calls, jm.stats.captures
    jc = DynamicCache(config=model.config)
    for n in (11, *[1] * 5):  # another prompt past the window: its prefill program, then the saturated decode's
        jm(input_ids=prompt(n), past_key_values=jc, use_cache=True,
           attention_mask=torch.ones(1, jc.get_seq_length() + n, dtype=torch.long))
    assert jm.stats.captures == captures + 1 and jm.stats.calls == calls + 6


def programs(jm: Any) -> set[tuple[str, tuple[int, int], str]]:
    return {(key.cache.value, key.sizes, key.regime) for key in jm._programs}


def test_40_token_generation_across_the_window_then_a_longer_prompt_captures_one_program_per_regime():
    """A prompt shorter than the window, greedy decode across it to 40 positions, then a prompt longer than the
    window and more decode steps: one program per (regime x size class) reached (kvtrace.runtime.jit_call's
    table), none pinned to a length, logits and the caller's cache equal to eager's after every step."""
    model = mistral()
    jm = kvtrace.jit(model, backend="eager")
    worst, past = generate(model, jm, 5, mask=True, steps=35)
    assert past == 40 and worst < 1e-5
    decode = {("dynamic", (1, 2), regime) for regime in ("filling", "reaching", "crossing", "full")}
    # prefill 5 < W - 1; decode P = 5 (filling), 6 (reaching: P + 1 = W - 1), 7 (crossing), 8 .. 39 (full)
    assert programs(jm) == {("dynamic-fresh", (2, 0), "filling"), *decode}
    assert jm.stats.captures == 5 and jm.stats.specializations == []
    worst, past = generate(model, jm, 11, mask=True, steps=10)
    assert past == 21 and worst < 1e-5
    # the longer prompt is its own prefill program (it overflows the tail); its decode reuses the full one
    assert programs(jm) == {("dynamic-fresh", (2, 0), "filling"), ("dynamic-fresh", (2, 0), "crossing"), *decode}
    assert jm.stats.captures == 6 and jm.stats.specializations == [] and jm.stats.calls == 36 + 11


def test_hybrid_qwen2_full_and_sliding_layers():
    model = hybrid_qwen2()
    kinds = [type(layer).__name__ for layer in DynamicCache(config=model.config).layers]
    assert kinds == ["DynamicLayer", "DynamicSlidingWindowLayer"]
    jm = kvtrace.jit(model, backend="eager")
    worst, past = generate(model, jm, 11, mask=True)
    assert past == 11 + STEPS and worst < 1e-5
    assert jm.stats.captures == 2 and jm.stats.specializations == []


def test_an_extend_call_past_the_window_keeps_the_last_window_tokens():
    """T >= 2 on a filled cache (chunked prefill) that crosses the window within the call."""
    model = mistral()
    jm = kvtrace.jit(model, backend="eager")
    jc, ec = DynamicCache(config=model.config), DynamicCache(config=model.config)
    for n in (4, 6, 9):  # P: 0 -> 4 -> 10 -> 19
        ids = prompt(n)
        assert_close(jm(input_ids=ids, past_key_values=jc, use_cache=True).logits,
                     model(input_ids=ids, past_key_values=ec, use_cache=True).logits, torch.float32, f"T={n}")
        assert_same_cache(jc, ec, f"T={n}")
    assert jc.get_seq_length() == 19 and jc.layers[0].keys.shape[-2] == W - 1


def test_random_chunks_batch_2_with_a_mask_match_eager_with_bounded_programs():
    """Calls of 1..9 tokens in random order, six caches: every call equals eager, whichever side of the window."""
    model = mistral()
    jm = kvtrace.jit(model, backend="eager")
    rng = random.Random(0)
    for trial in range(6):
        jc, ec = DynamicCache(config=model.config), DynamicCache(config=model.config)
        for call in range(6):
            n = rng.choice([1, 2, 3, 5, 7, 9])
            ids = torch.randint(3, 100, (2, n), generator=torch.Generator().manual_seed(10 * trial + call))
            mask = torch.ones(2, jc.get_seq_length() + n, dtype=torch.long)
            assert_close(jm(input_ids=ids, past_key_values=jc, attention_mask=mask).logits,
                         model(input_ids=ids, past_key_values=ec, attention_mask=mask).logits, torch.float32,
                         f"trial {trial} call {call} (T={n})")
            assert_same_cache(jc, ec, f"trial {trial} call {call}")
    assert jm.stats.calls == 36 and jm.stats.captures <= 12


def test_bf16_mistral_decode_past_the_window():
    model = tiny_model("mistral", dtype=torch.bfloat16, sliding_window=W)
    jm = kvtrace.jit(model, backend="eager")
    _, past = generate(model, jm, 11, mask=True, steps=10)
    assert past == 21 and jm.stats.captures == 2


def test_a_cache_recording_its_past_is_refused_and_the_caller_cache_is_untouched():
    model = mistral()
    jm = kvtrace.jit(model, backend="eager")
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        layer.activate_past_recording()
    with pytest.raises(kvtrace.UnsupportedError, match="record their past"):
        jm(input_ids=prompt(4), past_key_values=cache, use_cache=True)
    assert not any(layer.is_initialized for layer in cache.layers) and jm.stats.captures == 0


def test_a_sliding_layer_holding_more_than_its_tail_is_a_usage_error():
    model = mistral()
    jm = kvtrace.jit(model, backend="eager")
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt(11), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    layer.keys = layer.values = torch.zeros(1, layer.keys.shape[1], 9, layer.keys.shape[3])  # 9 > W - 1 kept
    with pytest.raises(kvtrace.UsageError, match="last sliding_window - 1"):
        jm(input_ids=prompt(1), past_key_values=cache, use_cache=True)


def test_verify_jit_against_eager_on_a_sliding_window_model():
    model = mistral()
    jit = JitRunner(model, backend="eager")
    report = verify(EagerRunner(model), [jit], [prompt(11).tolist()[0], prompt(3).tolist()[0]], steps=STEPS)
    assert report.passed, report.first_failure(report.candidates()[0])
    assert len(report.rows) == 2 * (STEPS + 1)
    assert jit.jm.stats.captures <= 2 + 5  # prompt 11: 2 programs; prompt 3 adds its prefill and 3 below-window


@pytest.mark.compile
def test_mistral_through_aoti_crosses_the_window_with_zero_recompiles_after_it():
    model = mistral()
    jm = kvtrace.jit(model)
    worst, past = generate(model, jm, 11, mask=True)
    assert past == 11 + STEPS and worst < 1e-4
    assert jm.stats.captures == 2 and jm.stats.specializations == []


def test_the_verify_command_against_jit_eager_on_a_sliding_window_model(tmp_path, capsys):
    """``kvtrace verify SOURCE --against jit-eager`` on a Mistral with a window (the CLI path of issue #15)."""
    (tmp_path / "m").mkdir()
    make_tiny_hf_dir(tmp_path / "m", model=mistral())
    out = tmp_path / "report.json"
    code = main(["verify", str(tmp_path / "m"), "--against", "jit-eager", "--steps", "12", "--raw",
                 "--prompt", "hello world the cat sat hello", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["passed"] is True and len(report["rows"]) == 2 * (1 + 12)  # prompts x (prefill + steps)
    assert max(r["position"] for r in report["rows"]) > W  # past the window
