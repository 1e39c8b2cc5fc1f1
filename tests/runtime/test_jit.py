"""kvtrace.jit against eager HF: same logits, same caches, same objects, no surprise recaptures.

Every comparison runs the eager model on its *own* cache with the same kwargs, and compares with
``close(...)`` at ``tolerance_for(dtype)``. Greedy continuations feed eager's pick to both sides.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import pytest
import torch
import transformers as tf
from transformers import DynamicCache, StaticCache

import kvtrace
import kvtrace.runtime.jit
from conftest import ARCHS, LONGROPE_ORIGINAL, TINY, tiny_model, tiny_phi3_longrope
from helpers import assert_close

PROMPT = [[128000, 791, 1401, 311, 2324, 374]]  # Llama-3 token ids, <|begin_of_text|> first


# --- helpers ----------------------------------------------------------------------------------
def kv(cache: Any) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def assert_caches_close(jc: Any, ec: Any, dtype: torch.dtype, valid: torch.Tensor | None = None) -> None:
    """Every layer's K/V [B, H, S, D]; with ``valid`` [B, S] only the positions it marks."""
    assert jc.get_seq_length() == ec.get_seq_length()
    for i, (a, b) in enumerate(zip(kv(jc), kv(ec), strict=True)):
        assert a.shape == b.shape, f"cache tensor {i}: {tuple(a.shape)} vs {tuple(b.shape)}"
        if valid is None:
            assert_close(a, b, dtype, f"cache tensor {i}")
            continue
        for row, keep in enumerate(valid.bool()):
            assert_close(a[row][:, keep], b[row][:, keep], dtype, f"cache tensor {i}, row {row}")


def ones(batch: int, n: int) -> torch.Tensor:
    return torch.ones(batch, n, dtype=torch.long)


def grow(mask: torch.Tensor, n: int = 1) -> torch.Tensor:
    return torch.cat([mask, ones(mask.shape[0], n)], dim=1)


def positions(mask: torch.Tensor, new: int) -> torch.Tensor:
    """position_ids for the last ``new`` tokens, as HF generate derives them from the attention mask."""
    return (mask.cumsum(-1) - 1).clamp(min=0)[:, -new:]


def step(jm: Any, model: Any, jc: Any, ec: Any, **kw: Any) -> tuple[Any, Any]:
    """One call on both sides, same kwargs, own caches; checks the cache object comes back."""
    jo = jm(cache=jc, **kw)
    eo = model(cache=ec, **kw)
    assert jo.past_key_values is jc
    return jo, eo


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1:].argmax(-1)


def tokens(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


def sliding_mistral() -> tuple[Any, Any]:
    cfg = tf.MistralConfig(**TINY, sliding_window=8)
    torch.manual_seed(0)
    return cfg, tf.MistralForCausalLM(cfg).eval().requires_grad_(False)


# --- 1. the seed scenario: Llama-3.2-1B shapes, one layer, bf16 ------------------------------------
@pytest.fixture(scope="module")
def llama_1b_shape():
    cfg = tf.LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, num_hidden_layers=1,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)  # random init straight in bf16
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.compile)])
def test_seed_scenario(llama_1b_shape, backend):
    model = llama_1b_shape
    assert model.dtype == torch.bfloat16 and model.config.rope_parameters["rope_type"] == "llama3"
    jm = kvtrace.jit(model, backend=backend)
    jc, ec = DynamicCache(), DynamicCache()
    input_ids = torch.tensor(PROMPT)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1]])
    cache_position = torch.tensor([0, 1, 2, 3, 4, 5])
    seconds, diffs = [], []
    for i in range(17):
        kw = dict(cache_position=cache_position, input_ids=input_ids, inputs_embeds=None,
                  attention_mask=mask, use_cache=True, return_dict=True)
        t0 = time.perf_counter()
        jo = jm(past_key_values=jc, **kw)
        seconds.append(time.perf_counter() - t0)
        eo = model(past_key_values=ec, **kw)
        assert jo.past_key_values is jc
        assert jc.get_seq_length() == ec.get_seq_length() == 6 + i
        diffs.append(assert_close(jo.logits, eo.logits, torch.bfloat16, f"logits, call {i}"))
        assert_caches_close(jc, ec, torch.bfloat16)
        input_ids, pos = greedy(eo.logits), mask.shape[1]
        mask, cache_position = grow(mask), torch.tensor([pos])
    assert jm.stats.captures == 2
    assert jm.stats.calls == 17
    print(f"\nseed[{backend}]: captures={jm.stats.captures} calls={jm.stats.calls} "
          f"max|logits diff|={max(diffs):.3g} first={seconds[0]:.2f}s second={seconds[1]:.2f}s "
          f"median later={statistics.median(seconds[2:]):.3f}s")


# --- 2. no recaptures while lengths change --------------------------------------------------------
def test_zero_recaptures_over_lengths():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    jc = DynamicCache()
    ids = tokens(1, 6 + 64)
    jm(input_ids=ids[:, :6], attention_mask=ones(1, 6), cache=jc)
    for n in range(7, 6 + 64 + 1):
        jm(input_ids=ids[:, n - 1 : n], attention_mask=ones(1, n), cache=jc)
        assert jm.stats.captures == 2
    extend = tokens(1, 20, seed=2)
    jo = jm(input_ids=extend, attention_mask=ones(1, 90), cache=jc)
    # an extend (T >= 2 on a filled cache) is its own size class (CallKey.sizes), captured once for any T >= 2
    assert jm.stats.captures == 3 and jm.stats.calls == 66
    assert jm.stats.specializations == []
    ec = DynamicCache()  # eager sees the same 90 tokens, in two calls
    model(input_ids=ids, attention_mask=ones(1, 70), cache=ec)
    eo = model(input_ids=extend, attention_mask=ones(1, 90), cache=ec)
    assert_close(jo.logits, eo.logits, torch.float32, "logits after extend")
    assert_caches_close(jc, ec, torch.float32)
    assert jc.get_seq_length() == 90


# --- 3. a failed capture leaves the caller's cache untouched ---------------------------------------
def _boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected failure")


FAILURES = {  # stage -> (object, attribute) to break
    "export": (kvtrace.runtime.jit.torch.export, "export"),
    "compile": (torch.export.ExportedProgram, "module"),  # what backend="eager" compiles with
}


@pytest.mark.parametrize("stage", FAILURES)
def test_capture_failure_keeps_dynamic_cache(monkeypatch, stage):
    model = tiny_model("llama")
    cache = DynamicCache()
    model(input_ids=tokens(1, 5), cache=cache, use_cache=True)
    before = kv(cache)
    copies = [t.clone() for t in before]
    jm = kvtrace.jit(model, backend="eager")
    monkeypatch.setattr(*FAILURES[stage], _boom)
    with pytest.raises(kvtrace.CaptureError) as err:
        jm(input_ids=tokens(1, 1), attention_mask=ones(1, 6), cache=cache)
    assert "LlamaForCausalLM" in str(err.value) and f"'{stage}'" in str(err.value)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert cache.get_seq_length() == 5
    assert all(a is b for a, b in zip(kv(cache), before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(kv(cache), copies, strict=True))
    assert jm.stats.captures == 0


def test_capture_failure_keeps_static_cache_uninitialized(monkeypatch):
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    jc, ec = StaticCache(config=model.config, max_cache_len=16), StaticCache(config=model.config, max_cache_len=16)
    ids, mask = tokens(1, 4), ones(1, 4)
    with monkeypatch.context() as m:
        m.setattr(kvtrace.runtime.jit.torch.export, "export", _boom)
        with pytest.raises(kvtrace.CaptureError, match=r"LlamaForCausalLM.*'export'"):
            jm(input_ids=ids, attention_mask=mask, cache=jc)
    assert not any(layer.is_initialized for layer in jc.layers)
    assert jc.get_seq_length() == 0
    jo, eo = step(jm, model, jc, ec, input_ids=ids, attention_mask=mask)  # works once export is back
    assert_close(jo.logits, eo.logits, torch.float32, "logits")


# --- 4. StaticCache -------------------------------------------------------------------------------
def test_static_cache_matches_eager_and_overflows_cleanly():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    jc, ec = (StaticCache(config=model.config, max_cache_len=16) for _ in range(2))
    mask = ones(1, 6)
    jo, eo = step(jm, model, jc, ec, input_ids=tokens(1, 6), attention_mask=mask)
    for i in range(9):
        assert_close(jo.logits, eo.logits, torch.float32, f"logits, call {i}")
        assert_caches_close(jc, ec, torch.float32)
        if i < 8:
            mask = grow(mask)
            jo, eo = step(jm, model, jc, ec, input_ids=greedy(eo.logits), attention_mask=mask)
    assert jm.stats.captures == 2  # prefill (T >= 2) and decode (T = 1): the size classes of CallKey.sizes
    assert int(jc.get_seq_length()) == 14
    before = kv(jc)
    copies = [t.clone() for t in before]
    with pytest.raises(kvtrace.CacheOverflowError) as err:
        jm(input_ids=tokens(1, 3), attention_mask=grow(mask, 3), cache=jc)
    assert "16" in str(err.value) and "17" in str(err.value)
    assert int(jc.get_seq_length()) == 14
    assert all(a is b and torch.equal(a, c) for a, b, c in zip(kv(jc), before, copies, strict=True))


# --- 5. no cache passed ---------------------------------------------------------------------------
def test_no_cache_creates_dynamic_cache_like_eager():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    ids, mask = tokens(1, 5), ones(1, 5)
    jo = jm(input_ids=ids, attention_mask=mask, use_cache=True)
    eo = model(input_ids=ids, attention_mask=mask, use_cache=True)
    assert type(jo.past_key_values) is type(eo.past_key_values) is DynamicCache
    assert_close(jo.logits, eo.logits, torch.float32, "prefill logits")
    jc, ec = jo.past_key_values, eo.past_key_values
    assert_caches_close(jc, ec, torch.float32)
    jo, eo = step(jm, model, jc, ec, input_ids=greedy(eo.logits), attention_mask=grow(mask))
    assert_close(jo.logits, eo.logits, torch.float32, "decode logits")
    assert_caches_close(jc, ec, torch.float32)


# --- 6. architectures, dtypes, left padding -------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_architectures_greedy_decode(arch, dtype, batch):
    model = tiny_model(arch, dtype)
    jm = kvtrace.jit(model, backend="eager")
    jc, ec = DynamicCache(), DynamicCache()
    mask = ones(batch, 6)
    if batch == 2:
        mask[1, :2] = 0  # left padding, as a tokenizer with padding_side="left" gives
    ids = tokens(batch, 6)
    for i in range(9):
        new = ids.shape[1]
        jo, eo = step(jm, model, jc, ec, input_ids=ids, attention_mask=mask, position_ids=positions(mask, new))
        for row in range(batch):
            real = mask[row, -new:].bool()
            assert_close(jo.logits[row, real], eo.logits[row, real], dtype, f"logits, call {i}, row {row}")
        assert_caches_close(jc, ec, dtype, valid=mask)
        ids, mask = greedy(eo.logits), grow(mask)
    assert jm.stats.captures == 2


def test_phi3_longrope_captured_fresh_matches_eager_past_the_switch():
    """Phi-3 LongRoPE sets rotary_emb.long_inv_freq on its first forward: here the first forward is jit's
    trace. The caller's model keeps no FakeTensor, eager keeps working, and both programs match eager on
    both sides of the short/long factor switch."""
    model = tiny_phi3_longrope()
    jm = kvtrace.jit(model, backend="eager")
    jc, ec = DynamicCache(), DynamicCache()
    ids = tokens(1, 6)
    for i in range(LONGROPE_ORIGINAL):  # positions 0..5, then 6..20: past the original 16
        jo, eo = step(jm, model, jc, ec, input_ids=ids)
        assert_close(jo.logits, eo.logits, torch.float32, f"logits, call {i} (position {jc.get_seq_length() - 1})")
        assert_caches_close(jc, ec, torch.float32)
        ids = greedy(eo.logits)
    assert jc.get_seq_length() > LONGROPE_ORIGINAL + 1
    assert jm.stats.captures == 2
    assert type(model.model.rotary_emb.long_inv_freq) is torch.Tensor  # eager's own, real


# --- strided inputs: a sliced position_ids, a cropped cache -----------------------------------------
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.compile)])
def test_strided_inputs_and_cropped_cache(backend):
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend=backend)
    jc, ec = DynamicCache(), DynamicCache()
    mask, ids = ones(2, 6), tokens(2, 6)
    mask[1, :2] = 0
    for i in range(4):
        pos = positions(mask, ids.shape[1])
        assert pos.is_contiguous() == (i == 0)  # decode steps pass a strided [B, 1] view
        jo, eo = step(jm, model, jc, ec, input_ids=ids, attention_mask=mask, position_ids=pos)
        assert_close(jo.logits[:, -1], eo.logits[:, -1], torch.float32, f"logits, call {i}")
        ids, mask = greedy(eo.logits), grow(mask)
    jc.crop(-2), ec.crop(-2)  # HF crops by slicing: the cache now holds strided views
    assert not jc.layers[0].keys.is_contiguous()
    mask = mask[:, :-2]
    jo, eo = step(jm, model, jc, ec, input_ids=ids, attention_mask=mask, position_ids=positions(mask, 1))
    assert_close(jo.logits, eo.logits, torch.float32, "logits after crop")
    assert_caches_close(jc, ec, torch.float32, valid=mask)
    assert jm.stats.captures == 2
    if backend == "inductor":  # the compiled runner refuses strided tensors instead of misreading them
        program = jm._programs[next(k for k in jm._programs if k.cache == "dynamic")][0].run
        args = [ids, mask, positions(mask, 1), *kv(jc)]
        with pytest.raises(ValueError, match="not contiguous"):
            program(*args)


# --- 7. what the key holds: weights dtype, batch ------------------------------------------------------
def _prefill_and_decode(jm: Any, model: Any, batch: int, dtype: torch.dtype) -> None:
    jc, ec = DynamicCache(), DynamicCache()
    mask = ones(batch, 5)
    jo, eo = step(jm, model, jc, ec, input_ids=tokens(batch, 5), attention_mask=mask)
    assert_close(jo.logits, eo.logits, dtype, "prefill logits")
    jo, eo = step(jm, model, jc, ec, input_ids=greedy(eo.logits), attention_mask=grow(mask))
    assert_close(jo.logits, eo.logits, dtype, "decode logits")
    assert_caches_close(jc, ec, dtype)


def test_dtype_change_recaptures_once_per_program():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    _prefill_and_decode(jm, model, 1, torch.float32)
    assert jm.stats.captures == 2
    model.to(torch.bfloat16)
    _prefill_and_decode(jm, model, 1, torch.bfloat16)
    assert jm.stats.captures == 4
    _prefill_and_decode(jm, model, 1, torch.bfloat16)
    assert jm.stats.captures == 4


def test_batch_change_recaptures_once_per_program():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    _prefill_and_decode(jm, model, 1, torch.float32)
    assert jm.stats.captures == 2
    jc, ec = DynamicCache(), DynamicCache()
    jo, eo = step(jm, model, jc, ec, input_ids=tokens(3, 5), attention_mask=ones(3, 5))
    assert jm.stats.captures == 3
    jo, eo = step(jm, model, jc, ec, input_ids=greedy(eo.logits), attention_mask=ones(3, 6))
    assert jm.stats.captures == 4
    assert_close(jo.logits, eo.logits, torch.float32, "batch-3 decode logits")


def test_replaced_weights_are_never_stale():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    ids = tokens(1, 5)

    def check(captures: int) -> None:
        jo, eo = jm(input_ids=ids, cache=DynamicCache()), model(input_ids=ids, cache=DynamicCache())
        assert_close(jo.logits, eo.logits, torch.float32, "logits")
        assert jm.stats.captures == captures

    check(1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3)  # in place: programs see it, no recapture
    check(1)
    norm = model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight * 2, requires_grad=False)  # a new tensor: recapture
    check(2)
    layer = model.model.layers[1]
    layer.mlp = copy.deepcopy(layer.mlp)  # a new submodule: recapture, and watch its weights from now on
    check(3)
    layer.mlp.up_proj.weight = torch.nn.Parameter(layer.mlp.up_proj.weight * 2, requires_grad=False)
    check(4)


# --- 8. unsupported caches ---------------------------------------------------------------------------
class SubclassedCache(DynamicCache):
    pass


def recording_past(cache: Any) -> Any:
    """Sliding-window layers that keep every token until ``crop`` (assisted decoding): not supported."""
    for layer in cache.layers:
        layer.activate_past_recording()
    return cache


UNSUPPORTED_CACHES = {  # QuantizedCache needs optimum-quanto or hqq, which are not installed
    "sliding-recording-past": lambda cfg: recording_past(DynamicCache(config=cfg)),
    "offloading": lambda cfg: DynamicCache(offloading=True),
    "subclass": lambda cfg: SubclassedCache(),
    "list": lambda cfg: [],
}


@pytest.mark.parametrize("cache", UNSUPPORTED_CACHES)
def test_unsupported_cache_raises_with_what_is_supported(cache):
    cfg, model = sliding_mistral()
    jm = kvtrace.jit(model, backend="eager")
    obj = UNSUPPORTED_CACHES[cache](cfg)
    with pytest.raises(kvtrace.UnsupportedError) as err:
        jm(input_ids=tokens(1, 4), cache=obj, use_cache=True)
    assert "DynamicCache" in str(err.value) and "StaticCache" in str(err.value)
    assert jm.stats.captures == 0


def test_unsupported_cache_falls_back_to_eager_with_one_warning():
    cfg, model = sliding_mistral()
    jm = kvtrace.jit(model, backend="eager", fallback="eager")
    jc, ec = recording_past(DynamicCache(config=cfg)), recording_past(DynamicCache(config=cfg))
    mask = ones(1, 6)
    with pytest.warns(UserWarning, match="falls back to eager") as record:
        jo, eo = step(jm, model, jc, ec, input_ids=tokens(1, 6), attention_mask=mask)
        assert_close(jo.logits, eo.logits, torch.float32, "prefill logits")
        jo, eo = step(jm, model, jc, ec, input_ids=greedy(eo.logits), attention_mask=grow(mask))
        assert_close(jo.logits, eo.logits, torch.float32, "decode logits")
    assert len([w for w in record if "falls back to eager" in str(w.message)]) == 1
    assert jm.stats.fallbacks == 2 and jm.stats.captures == 0 and jm.stats.calls == 2
    assert_caches_close(jc, ec, torch.float32)


# --- 9. calling conventions -----------------------------------------------------------------------
def test_return_dict_false_returns_tuple_like_eager():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    jc, ec = DynamicCache(), DynamicCache()
    jo = jm(input_ids=tokens(1, 4), cache=jc, use_cache=True, return_dict=False)
    eo = model(input_ids=tokens(1, 4), cache=ec, use_cache=True, return_dict=False)
    assert isinstance(jo, tuple) and isinstance(eo, tuple) and len(jo) == len(eo) == 2
    assert jo[1] is jc
    assert_close(jo[0], eo[0], torch.float32, "logits")
    assert_caches_close(jc, ec, torch.float32)


def test_cache_kwarg_spellings():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="eager")
    ids = tokens(1, 4)
    old, new = DynamicCache(), DynamicCache()
    a = jm(input_ids=ids, past_key_values=old, use_cache=True)
    b = jm(input_ids=ids, cache=new, use_cache=True)
    assert a.past_key_values is old and b.past_key_values is new
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(kv(old), kv(new), strict=True))
    with pytest.raises(kvtrace.UsageError, match="not both"):
        jm(input_ids=ids, cache=DynamicCache(), past_key_values=DynamicCache())


# --- 10. AOTInductor ------------------------------------------------------------------------------
@pytest.mark.compile
def test_inductor_dynamic_cache():
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend="inductor")
    jc, ec = DynamicCache(), DynamicCache()
    mask, ids, seconds = ones(1, 6), tokens(1, 6), []
    for i in range(10):
        t0 = time.perf_counter()
        jo = jm(input_ids=ids, attention_mask=mask, cache=jc)
        seconds.append(time.perf_counter() - t0)
        eo = model(input_ids=ids, attention_mask=mask, cache=ec)
        assert jo.past_key_values is jc
        assert_close(jo.logits, eo.logits, torch.float32, f"logits, call {i}")
        assert_caches_close(jc, ec, torch.float32)
        ids = greedy(eo.logits) if i < 8 else tokens(1, 5, seed=3)  # 8 decode steps, then a 5-token extend
        mask = grow(mask, ids.shape[1])
    assert jm.stats.captures == 3  # prefill, decode (T = 1), extend (T >= 2 on a filled cache)
    print(f"\ninductor tiny llama: first={seconds[0]:.2f}s second={seconds[1]:.2f}s "
          f"median later={statistics.median(seconds[2:]):.4f}s")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.compile)])
def test_shortest_lengths_one_token_prompt_then_decode(backend):
    """T = 1 prefill on a fresh cache and P = 1 / P = 2 decodes: below the capture example sizes."""
    model = tiny_model("llama")
    jm = kvtrace.jit(model, backend=backend)
    for prompt in ([[7]], [[7, 9]]):
        jc, ec = DynamicCache(), DynamicCache()
        ids, mask = torch.tensor(prompt), ones(1, len(prompt[0]))
        for _ in range(3):
            j = jm(input_ids=ids, attention_mask=mask, past_key_values=jc, use_cache=True)
            e = model(input_ids=ids, attention_mask=mask, past_key_values=ec, use_cache=True)
            assert_close(j.logits, e.logits, torch.float32, f"prompt {prompt}, length {mask.shape[1]}")
            assert_caches_close(jc, ec, torch.float32)
            ids, mask = e.logits[:, -1:].argmax(-1), grow(mask)
    # one program per size class (CallKey.sizes): fresh T=1, decode at P=1, decode at P>=2 (both prompts), fresh T=2
    assert jm.stats.captures == 4
    assert sorted((k.cache.value, k.sizes) for k in jm._programs) == [
        ("dynamic", (1, 1)), ("dynamic", (1, 2)), ("dynamic-fresh", (1, 0)), ("dynamic-fresh", (2, 0))]
