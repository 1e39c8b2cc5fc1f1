"""int8 KV caches on every decoder path, not only the Llama family's: the Gemma decoder (Gemma 2 soft-capping
and Gemma 3 q/k norms over hybrid ring + full layers) and the general HF path (GPT-NeoX; a Qwen3 with a window
through HF's own modules). Each exported with kv_dtype="int8" and verified against the same decoder run eagerly
with the same quantized cache, past twice the window, logits and every layer's cache each step; its error vs
the unquantized cache (HF eager) stays small. All of them read and write the cache through one function
(``kvtrace.cache.attend.update``), so they quantize alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvtrace
from conftest import TINY, tiny_model
from kvtrace.models.hf_generic import HFDecoder
from kvtrace.models.registry import family_for, make_decoder
from kvtrace.spec.cache import LayerKind
from kvtrace.tools.runners import DecoderRunner, EagerRunner, SessionRunner
from kvtrace.tools.verify import verify

WINDOW, MAX_SEQ_LEN, STEPS = 8, 48, 30
PROMPTS = ([5, 17, 42, 8, 99, 3, 64, 7, 1, 2, 9], [3, 11, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18])
F, S = LayerKind.FULL, LayerKind.SLIDING


def qwen3_windowed() -> torch.nn.Module:
    import transformers as tf

    cfg = tf.Qwen3Config(**TINY, head_dim=16, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)
    return model


# name -> (model, decoder builder, family the registry picks, declared layer kinds)
CASES = {
    "gemma2": (lambda: tiny_model("gemma2"), None, "gemma", [S, F]),
    "gemma3_text": (lambda: tiny_model("gemma3_text"), None, "gemma", [S, F]),
    "gpt_neox": (lambda: tiny_model("gpt_neox"), None, "hf", [F, F]),
    "qwen3-general": (qwen3_windowed, HFDecoder, None, [F, S]),
}


def _decoder(name: str, model: torch.nn.Module, kv_dtype: str | None) -> torch.nn.Module:
    build = CASES[name][1]
    if build is None:
        return make_decoder(model, max_seq_len=MAX_SEQ_LEN, kv_dtype=kv_dtype)
    return build(model, max_seq_len=MAX_SEQ_LEN, kv_dtype=kv_dtype)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    built: dict[str, tuple[torch.nn.Module, Any]] = {}

    def get(name: str) -> tuple[torch.nn.Module, Any]:
        if name not in built:
            model = CASES[name][0]()
            path = tmp_path_factory.mktemp(name) / "m.kvt"
            kvtrace.export(_decoder(name, model, "int8"), path)
            built[name] = model, kvtrace.load(path)
        return built[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_int8_cache_on_every_path_matches_the_same_decoder_eager(name, exported):
    model, art = exported(name)
    family = CASES[name][2]
    if family is not None:
        assert family_for(model.config).name == family  # the path this case is about
    spec = art.cache_spec
    assert spec.kv_dtype == "int8" and [x.kind for x in spec.layers] == CASES[name][3]
    assert [b.dtype for b in spec.buffers()] == ["int8", "int8", "float16", "float16"] * 2
    ref = DecoderRunner(_decoder(name, model, "int8"), "decoder-eager-int8")
    report = verify(ref, [SessionRunner(art.session(), "exported")], PROMPTS, steps=STEPS, kv_dtype="int8")
    assert report.passed, [f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    assert len(report.rows) == len(PROMPTS) * (1 + STEPS)
    assert max(r.position for r in report.rows) == len(PROMPTS[1]) + STEPS > 2 * WINDOW
    for r in report.rows:  # exported runs the eager decoder's own aten ops: exact
        assert r.token_agree and r.top1_agree == 1.0 and r.logits_max_abs <= 1e-5, (r.prompt, r.step)
        assert len(r.k_max_abs) == 2 and max(*r.k_max_abs, *r.v_max_abs) <= 1e-6, (r.prompt, r.step)
    # vs the unquantized cache (the HF model eager): lossy, but within a few int8 steps of the logits
    vs = verify(EagerRunner(model), [SessionRunner(art.session(), "exported")], PROMPTS, steps=STEPS)
    worst_kv = max(max(*r.k_max_abs, *r.v_max_abs) for r in vs.rows)
    worst_logits = max(r.logits_max_abs for r in vs.rows)
    assert 0 < worst_kv < 0.1 and 0 < worst_logits < 0.1, (worst_kv, worst_logits)


class _SkipsRoundTrip(DecoderRunner):
    """Planted fault: a ring layer's attention reads the call's own keys unquantized (as an fp cache would)
    while the ring stores them quantized."""

    def _unquantized(self, call: Any, *args: Any) -> Any:
        from kvtrace.cache import int8

        real = int8.stored
        int8.stored = lambda x: x
        try:
            return call(*args)
        finally:
            int8.stored = real

    def prefill(self, tokens: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        return self._unquantized(super().prefill, tokens)

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        return self._unquantized(super().decode, token)


def test_a_ring_that_skips_the_int8_round_trip_fails_verify(exported):
    model, _ = exported("qwen3-general")
    ref = DecoderRunner(_decoder("qwen3-general", model, "int8"), "decoder-eager-int8")
    broken = _SkipsRoundTrip(_decoder("qwen3-general", model, "int8"), "skips-round-trip")
    report = verify(ref, [broken], PROMPTS, steps=4, kv_dtype="int8")
    assert not report.passed
    assert report.rows[0].step == "prefill" and not report.rows[0].passed  # caught at the first step
