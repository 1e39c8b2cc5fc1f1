"""kvtrace.jit on Mllama's text decoder (Llama 3.2 Vision): self- and cross-attention layers in one cache.

The tiny model (conftest.tiny_mllama) has 4 layers, cross-attention at 1 and 3. Every call runs eager on its
own cache with the same kwargs; logits, every layer's K/V, and which layers exist / are initialized must
match. Greedy continuations feed eager's pick to both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache
from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

import kvtrace
import kvtrace.runtime.jit
from conftest import IMAGE_TOKENS, MLLAMA_CROSS_LAYERS, TINY, image_features, tiny_mllama
from helpers import assert_close

STEPS = 16  # greedy decode steps after each prefill
SELF_LAYERS = tuple(i for i in range(4) if i not in MLLAMA_CROSS_LAYERS)


@pytest.fixture(scope="module")
def mllama():
    return tiny_mllama()


# --- helpers ----------------------------------------------------------------------------------
def cross_masks(allowed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T, N] 0/1 (1 = token attends image token) -> (cross_attention_mask [B, 1, T, N],
    full_text_row_masked_out_mask [B, 1, T, 1]), as HF's _prepare_cross_attention_mask makes them:
    additive finfo.min where 0; a row with no 1 becomes all-zero and its full_text_row is 0."""
    inverted = (1.0 - allowed.to(dtype))[:, None]  # [B, 1, T, N]
    mask = inverted.masked_fill(inverted.bool(), torch.finfo(dtype).min)
    row = (mask != torch.finfo(dtype).min).any(dim=-1, keepdim=True).to(dtype)  # [B, 1, T, 1]
    return mask * row, row


def allowed_mask(batch: int, t: int, n: int) -> torch.Tensor:
    """[B, T, N]: token 0 attends no image token (before the <|image|> tag), token 2 only part of them."""
    m = torch.ones(batch, t, n)
    m[:, 0] = 0
    m[:, 2, : n // 2] = 0
    if batch > 1:
        m[1, 3, -1] = 0
    return m


def tokens(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1:].argmax(-1)


def layout(cache: Any) -> list[tuple[bool, tuple[int, ...] | None]]:
    """Per existing layer: (initialized, K shape)."""
    return [(layer.is_initialized, tuple(layer.keys.shape) if layer.is_initialized else None)
            for layer in cache.layers]


def assert_caches_match(jc: Any, ec: Any, dtype: torch.dtype, what: str) -> None:
    assert layout(jc) == layout(ec), f"{what}: cache layers {layout(jc)} vs eager {layout(ec)}"
    for i, (a, b) in enumerate(zip(jc.layers, ec.layers, strict=True)):
        if a.is_initialized:
            assert_close(a.keys, b.keys, dtype, f"{what}, layer {i} keys")
            assert_close(a.values, b.values, dtype, f"{what}, layer {i} values")


def call_both(jm: Any, model: Any, jc: Any, ec: Any, cache_kw: str, **kw: Any) -> tuple[Any, Any, Any, Any]:
    """One call on both sides with the same kwargs; ``jc``/``ec`` None: no cache passed (each side makes one)."""
    if jc is None:
        jo, eo = jm(**kw), model(**kw)
        return jo, eo, jo.past_key_values, eo.past_key_values
    jo, eo = jm(**kw, **{cache_kw: jc}), model(**kw, **{cache_kw: ec})
    assert jo.past_key_values is jc
    return jo, eo, jc, ec


def generate(jm: Any, model: Any, ids: torch.Tensor, *, images: torch.Tensor | None = None,
             allowed: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
             new_cache: Callable[[], Any] | None = DynamicCache, cache_kw: str = "cache") -> tuple[Any, Any]:
    """Prefill (with image features / cross masks when given) + STEPS greedy decodes, checked every call.

    Decode calls pass the last prompt token's mask row again, as HF generate does, and no image features.
    """
    kw: dict[str, Any] = {}
    if images is not None:
        kw["cross_attention_states"] = images
    if allowed is not None:
        mask, row = cross_masks(allowed, dtype)
        kw.update(cross_attention_mask=mask, full_text_row_masked_out_mask=row)
    jc, ec = (new_cache(), new_cache()) if new_cache is not None else (None, None)
    jo, eo, jc, ec = call_both(jm, model, jc, ec, cache_kw, input_ids=ids, use_cache=True, **kw)
    assert_close(jo.logits, eo.logits, dtype, "prefill logits")
    assert_caches_match(jc, ec, dtype, "prefill")
    step_kw = {} if allowed is None else dict(cross_attention_mask=mask[:, :, -1:],
                                              full_text_row_masked_out_mask=row[:, :, -1:])
    for i in range(STEPS):
        cross_before = {j: jc.layers[j].keys for j in MLLAMA_CROSS_LAYERS
                        if j < len(jc.layers) and jc.layers[j].is_initialized}
        jo, eo, _, _ = call_both(jm, model, jc, ec, cache_kw, input_ids=greedy(eo.logits), **step_kw)
        assert_close(jo.logits, eo.logits, dtype, f"decode {i} logits")
        assert_caches_match(jc, ec, dtype, f"decode {i}")
        for j, keys in cross_before.items():  # read-only on decode: not returned, not written back
            assert jc.layers[j].keys is keys, f"decode {i}: cross layer {j} was written"
    return jc, ec


# --- 1. image prompts: prefill with image features, then greedy decode ---------------------------------
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.compile)])
def test_image_generation_matches_eager(mllama, backend):
    jm = kvtrace.jit(mllama, backend=backend)
    jc, _ = generate(jm, mllama, tokens(1, 7), images=image_features(), allowed=allowed_mask(1, 7, IMAGE_TOKENS))
    assert [s for _, s in layout(jc)] == [(1, 2, 7 + STEPS, 16), (1, 2, IMAGE_TOKENS, 16)] * 2
    assert jm.stats.captures == 2
    # a second prompt on a fresh cache: other prompt length, other image-token count, past_key_values=
    generate(jm, mllama, tokens(1, 10, seed=2), images=image_features(n=4, seed=3), allowed=allowed_mask(1, 10, 4),
             cache_kw="past_key_values")
    assert jm.stats.captures == 2 and jm.stats.calls == 2 * (1 + STEPS)
    assert jm.stats.specializations == []
    assert {k.layers for k in jm._programs} == {("self", "cross-empty") * 2, ("self", "cross-filled") * 2}


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.compile)])
def test_text_only_generation_matches_eager(mllama, backend):
    """No cross arguments: eager skips the cross layers, so they stay uninitialized or are never created."""
    jm = kvtrace.jit(mllama, backend=backend)
    jc, _ = generate(jm, mllama, tokens(1, 6))
    assert layout(jc) == [(True, (1, 2, 6 + STEPS, 16)), (False, None), (True, (1, 2, 6 + STEPS, 16))]
    generate(jm, mllama, tokens(1, 9, seed=2), cache_kw="past_key_values")
    assert jm.stats.captures == 2
    jc, _ = generate(jm, mllama, tokens(1, 4, seed=3), new_cache=None)  # DynamicCache(config=...): 4 layers
    assert len(jc.layers) == 4 and not jc.layers[3].is_initialized
    assert jm.stats.captures == 2 and jm.stats.specializations == []


def test_image_generation_bf16_batch2():
    model = tiny_mllama(torch.bfloat16)
    jm = kvtrace.jit(model, backend="eager")
    images = image_features(batch=2, dtype=torch.bfloat16)
    generate(jm, model, tokens(2, 6), images=images, allowed=allowed_mask(2, 6, IMAGE_TOKENS), dtype=torch.bfloat16)
    assert jm.stats.captures == 2


def test_mask_helper_matches_hf():
    """cross_masks on a [B, T, N] mask = HF's own preparation of a one-image, one-tile mask."""
    allowed = allowed_mask(2, 5, 1)[..., None]  # [B, T, images=1, tiles=1]
    mask, row = _prepare_cross_attention_mask(allowed, num_vision_tokens=IMAGE_TOKENS, dtype=torch.float32)
    ours = cross_masks(allowed[..., 0].repeat_interleave(IMAGE_TOKENS, dim=2), torch.float32)
    assert torch.equal(ours[0], mask) and torch.equal(ours[1], row)
    assert row[0, 0, 0, 0] == 0 and bool((mask[0, 0, 0] == 0).all())  # the fully masked row


# --- 2. HF's quirks and rarer call patterns reproduce eager ---------------------------------------------
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.compile)])
def test_no_cross_mask_reproduces_eager(mllama, backend):
    """Without cross_attention_mask HF's sdpa path attends causally (T > 1) or to every image token (T = 1):
    two graphs, three programs (causal prefill, one-token decode, causal extend); lengths stay symbolic,
    with fewer and with more image tokens than text tokens."""
    jm = kvtrace.jit(mllama, backend=backend)
    for t, n in [(5, 6), (9, 4)]:  # T < N and T > N
        jc, ec = generate(jm, mllama, tokens(1, t, seed=t), images=image_features(n=n))
        jo, eo, _, _ = call_both(jm, mllama, jc, ec, "cache", input_ids=tokens(1, 3, seed=4))  # extend by 3
        assert_close(jo.logits, eo.logits, torch.float32, "extend logits")
        assert_caches_match(jc, ec, torch.float32, "extend")
    assert jm.stats.captures == 3
    assert sorted(k.unmasked_cross for k in jm._programs) == ["causal", "causal", "one-token"]


def test_second_image_appends_to_the_cross_layers(mllama):
    """New image features on a cache that holds image tokens: eager appends them (N_c + N)."""
    jm = kvtrace.jit(mllama, backend="eager")
    for t, n, n2 in [(6, 6, 3), (8, 4, 5)]:
        jc, ec = generate(jm, mllama, tokens(1, t, seed=t), images=image_features(n=n),
                          allowed=allowed_mask(1, t, n))
        mask, row = cross_masks(torch.ones(1, 2, n + n2), torch.float32)
        jo, eo, _, _ = call_both(jm, mllama, jc, ec, "cache", input_ids=tokens(1, 2, seed=5),
                                 cross_attention_states=image_features(n=n2, seed=6), cross_attention_mask=mask,
                                 full_text_row_masked_out_mask=row)
        assert_close(jo.logits, eo.logits, torch.float32, "second image logits")
        assert_caches_match(jc, ec, torch.float32, "second image")
        assert jc.layers[1].keys.shape[2] == n + n2
    assert jm.stats.captures == 3


# --- 3. bad input: a clear UsageError before any tracing, the cache untouched ----------------------------
def filled_cache(model: Any) -> Any:
    cache = DynamicCache()
    mask, row = cross_masks(allowed_mask(1, 5, IMAGE_TOKENS), torch.float32)
    model(input_ids=tokens(1, 5), cross_attention_states=image_features(), cross_attention_mask=mask,
          full_text_row_masked_out_mask=row, cache=cache, use_cache=True)
    return cache


def snapshot(cache: Any) -> list[Any]:
    return [(layer.keys, layer.keys.clone(), layer.values) for layer in cache.layers]


def assert_unchanged(cache: Any, snap: list[Any]) -> None:
    assert len(cache.layers) == len(snap)
    for layer, (k, k_copy, v) in zip(cache.layers, snap, strict=True):
        assert layer.keys is k and layer.values is v and torch.equal(k, k_copy)


BAD_INPUTS = {  # name -> (kwargs of a decode call on filled_cache, what the message names)
    "hidden size": (dict(cross_attention_states=image_features(dim=32)), ["cross_attention_states", "32", "64"]),
    "mask T": (dict(cross_attention_mask=torch.zeros(1, 1, 2, IMAGE_TOKENS)), ["cross_attention_mask", "[1, 1, 2, 6]",
                                                                              "[1, 1, 1, 6]"]),
    "mask N": (dict(cross_attention_mask=torch.zeros(1, 1, 1, 5)), ["cross_attention_mask", "X = 6"]),
    "row T": (dict(full_text_row_masked_out_mask=torch.ones(1, 1, 3, 1)), ["full_text_row_masked_out_mask",
                                                                           "[1, 1, 3, 1]"]),
}


@pytest.mark.parametrize("bad", BAD_INPUTS)
def test_bad_cross_inputs_raise_before_tracing(mllama, bad):
    kw, named = BAD_INPUTS[bad]
    cache = filled_cache(mllama)
    snap = snapshot(cache)
    jm = kvtrace.jit(mllama, backend="eager")
    with pytest.raises(kvtrace.UsageError) as err:
        jm(input_ids=tokens(1, 1), cache=cache, **kw)
    for word in named:
        assert word in str(err.value), str(err.value)
    assert jm.stats.captures == 0
    assert_unchanged(cache, snap)


def test_bad_prefill_mask_names_expected_and_found(mllama):
    mask, _ = cross_masks(allowed_mask(1, 7, IMAGE_TOKENS), torch.float32)  # for 7 tokens
    cache = DynamicCache()
    jm = kvtrace.jit(mllama, backend="eager")
    with pytest.raises(kvtrace.UsageError, match=r"cross_attention_mask has shape \[1, 1, 7, 6\]; expected .*"
                                                 r"\[1, 1, 5, 6\] \(T = 5 new tokens"):
        jm(input_ids=tokens(1, 5), cross_attention_states=image_features(), cross_attention_mask=mask, cache=cache)
    assert cache.layers == [] and jm.stats.captures == 0


def test_capture_failure_keeps_the_cache(mllama, monkeypatch):
    cache = filled_cache(mllama)
    snap = snapshot(cache)
    jm = kvtrace.jit(mllama, backend="eager")

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(kvtrace.runtime.jit.torch.export, "export", boom)
    with pytest.raises(kvtrace.CaptureError, match="MllamaForCausalLM"):
        jm(input_ids=tokens(1, 1), cache=cache)
    assert_unchanged(cache, snap)


def test_bad_caches_are_named(mllama):
    jm = kvtrace.jit(mllama, backend="eager")
    partly = filled_cache(mllama)
    partly.layers[2] = type(partly.layers[2])()  # a self layer without tensors
    with pytest.raises(kvtrace.UsageError, match="partly filled: 1 of 2 self-attention layers"):
        jm(input_ids=tokens(1, 1), cache=partly)
    uneven = filled_cache(mllama)  # self layers hold 5 tokens; cut one of them to 3
    uneven.layers[0].keys = uneven.layers[0].keys[:, :, :3]
    uneven.layers[0].values = uneven.layers[0].values[:, :, :3]
    with pytest.raises(kvtrace.UsageError, match=r"self-attention layers hold different lengths \[3, 5\]"):
        jm(input_ids=tokens(1, 1), cache=uneven)
    half = filled_cache(mllama)
    half.layers[3] = type(half.layers[3])()  # one cross layer without image tokens
    with pytest.raises(kvtrace.UsageError, match=r"cross-attention layers \[1\] hold image tokens but \[3\] do not"):
        jm(input_ids=tokens(1, 1), cache=half)
    assert jm.stats.captures == 0
