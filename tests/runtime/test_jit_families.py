"""kvtrace.jit on every HF decoder family kvtrace exports, with transformers' own cache for it
(``DynamicCache(config=...)``: sliding-window layers where the config has them): a prompt longer than the
window, then decode past twice the window — two programs, no specialization, logits and the caller's
cache equal eager's after every step."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvtrace
from conftest import FAMILY_ARCHS, tiny_model
from kvtrace.cache import hf as hfc

WINDOW = 8
CASES = {
    "llama": {}, "qwen3": {}, "phi3": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
    **{arch: {} for arch in FAMILY_ARCHS},  # gemma2 / gemma3_text: window 8, [sliding, full]
}
PROMPT = [5, 17, 42, 8, 99, 3, 64, 7, 1, 2, 9]  # 11 > WINDOW
STEPS = 2 * WINDOW + 4


@pytest.mark.parametrize("arch", list(CASES))
def test_a_generation_past_the_window_runs_on_two_programs_and_matches_eager(arch):
    model = tiny_model(arch, **CASES[arch])
    jm = kvtrace.jit(model, backend="eager")
    mine, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for step in range(STEPS):
            want = model(input_ids=ids, past_key_values=theirs, use_cache=True)
            got = jm(input_ids=ids, past_key_values=mine, use_cache=True)
            assert got.past_key_values is mine
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4, msg=f"{arch} step {step}")
            for i, (a, b) in enumerate(zip(mine.layers, theirs.layers, strict=True)):
                assert type(a) is type(b) and a.keys.shape == b.keys.shape, (arch, step, i)
                torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5, msg=f"{arch} step {step} layer {i}")
                torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
            ids = want.logits[:, -1:].argmax(-1)
    sliding = [hfc.is_sliding(layer) for layer in mine.layers]
    assert any(sliding) == (arch in ("mistral", "qwen2", "gemma2", "gemma3_text"))
    assert mine.get_seq_length() == len(PROMPT) + STEPS - 1 > 2 * WINDOW
    assert jm.stats.captures == 2 and jm.stats.specializations == [], jm.stats  # prefill, decode: that is all
