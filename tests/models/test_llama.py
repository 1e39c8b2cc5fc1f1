"""LlamaDecoder reproduces the HF Llama family: logits and every K/V, prefill and decode."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import TINY, tiny_model
from kvtrace.models.hf_generic import HFDecoder, hf_cache_spec
from kvtrace.models.llama import LlamaDecoder, supports
from kvtrace.models.registry import make_decoder
from kvtrace.spec.tolerances import close, tolerance_for

TOL = tolerance_for(torch.float32)
TINY_HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_matches_hf_step_by_step(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    spec = hf_cache_spec(model.config, max_seq_len=32, batch_size=1, dtype=dtype)
    dec = LlamaDecoder.from_hf(model, spec)
    state = spec.allocate()
    tol = tolerance_for(dtype)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    cache = DynamicCache()
    with torch.no_grad():
        ref = model(input_ids=ids, cache=cache, use_cache=True).logits
        out = dec(ids, torch.arange(7), *state)
        pos = 7
        for step in range(8):
            ok, diff, limit = close(out, ref, tol)
            assert ok, (arch, step, diff, limit)
            for i, layer in enumerate(cache.layers):
                for mine, theirs in ((state[2 * i], layer.keys), (state[2 * i + 1], layer.values)):
                    ok, diff, limit = close(mine[:, :, :pos], theirs, tol)
                    assert ok, (arch, step, i, diff, limit)
            assert state[0][:, :, pos:].abs().max() == 0  # nothing written past the position
            tok = ref[:, -1:].argmax(-1)
            ref = model(input_ids=tok, cache=cache, use_cache=True).logits
            out = dec(tok, torch.tensor([pos]), *state)
            pos += 1


def test_bias_and_tied_embeddings_are_carried():
    qwen = LlamaDecoder.from_hf(tiny_model("qwen2"), hf_cache_spec(tiny_model("qwen2").config, max_seq_len=8,
                                                                     batch_size=1, dtype=torch.float32))
    assert qwen.args.qkv_bias and qwen.layers[0].wqkv.bias is not None
    tied = tiny_model("llama", tie_word_embeddings=True)
    dec = make_decoder(tied, max_seq_len=8)
    assert isinstance(dec, LlamaDecoder) and dec.args.tie_embeddings
    assert dec.output.weight.data_ptr() == dec.tok_embeddings.weight.data_ptr()


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_configs_it_does_not_reproduce_use_the_general_decoder(arch):
    # qwen3 and phi3 are on the fast path now (test_llama_families.py); these variations of them are not
    model = tiny_model(arch, hidden_act="gelu" if arch == "qwen3" else "gelu_new")
    assert not supports(model.config)
    assert isinstance(make_decoder(model, max_seq_len=8), HFDecoder)


def test_sliding_window_is_claimed_and_the_general_decoder_runs_it_as_rings():
    model = tiny_model("mistral", sliding_window=4)
    assert supports(model.config)
    dec = make_decoder(model, max_seq_len=8)
    assert isinstance(dec, LlamaDecoder) and [x.max_len for x in dec.cache_spec.layers] == [4, 4]
    assert [p.method for p in dec.programs] == ["forward", "forward"]  # rings only: no live prefix to read
    assert [x.max_len for x in HFDecoder(model, max_seq_len=8).cache_spec.layers] == [4, 4]  # rings there too
    assert isinstance(HFDecoder(model, max_seq_len=4), HFDecoder)  # the window covers the whole cache


def test_live_prefix_attention_equals_full_attention_up_to_the_last_slot():
    """forward_live(key_pos = 0..L-1) reads only the live cache prefix; it must agree with forward (all S
    slots, stale ones masked) at every position, the very last slot included (L == S)."""
    model = tiny_model("llama")
    s_max = 12
    spec = hf_cache_spec(model.config, max_seq_len=s_max, batch_size=1, dtype=torch.float32)
    dec = LlamaDecoder.from_hf(model, spec)
    assert [(p.name, p.method, p.key_pos) for p in dec.programs] == [
        ("prefill", "forward_live", True), ("decode", "forward_live", True)]
    full, live = spec.allocate(), spec.allocate()
    for t in full + live:
        t.normal_()  # stale garbage in unwritten slots: the live path must never read it, the full path masks it
    for t_live, t_full in zip(live, full, strict=True):
        t_live.copy_(t_full)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        a = dec(ids, torch.arange(5), *full)
        b = dec.forward_live(ids, torch.arange(5), torch.arange(5), *live)
        assert close(b, a, TOL)[0]
        for pos in range(5, s_max):  # decode to the last slot: L = pos + 1 = s_max at the end
            tok = a[:, -1:].argmax(-1)
            a = dec(tok, torch.tensor([pos]), *full)
            b = dec.forward_live(tok, torch.tensor([pos]), torch.arange(pos + 1), *live)
            assert close(b, a, TOL)[0], pos
    for t_live, t_full in zip(live, full, strict=True):
        assert close(t_live, t_full, TOL)[0]  # same writes (up to rounding in later layers) ...
    assert torch.equal(live[0], full[0])  # ... layer 0's K exactly: its input does not depend on attention


def test_small_caches_attend_to_every_slot():
    model = tiny_model("llama")
    dec = LlamaDecoder.from_hf(model, hf_cache_spec(model.config, max_seq_len=4, batch_size=1, dtype=torch.float32))
    assert [p.key_pos for p in dec.programs] == [False, False]


def test_length_dependent_rope_goes_through_the_general_decoder():
    """longrope uses the long factors for *every* position once the sequence passes
    original_max_position_embeddings; a position-indexed RoPE table built at export would be silently
    wrong past it (LlamaDecoder was: 4.7e-4 max logits error on this tiny model, 1e-7 below the switch)."""
    head_dim = TINY_HEAD_DIM
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * (head_dim // 2),
            "long_factor": [4.0] * (head_dim // 2), "original_max_position_embeddings": 16}
    model = tiny_model("llama", max_position_embeddings=64, rope_parameters=rope)
    model.config.original_max_position_embeddings = 16
    assert not supports(model.config)
    dec = make_decoder(model, max_seq_len=64)
    assert isinstance(dec, HFDecoder)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))  # past the switch at 16
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        out = dec(ids, torch.arange(40), *dec.cache_spec.allocate())
    ok, diff, limit = close(out, ref, TOL)
    assert ok, (diff, limit)


def test_position_indexed_rope_variants_stay_on_llama_decoder():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    model = tiny_model("llama", max_position_embeddings=64, rope_parameters=rope)
    assert supports(model.config)
    dec = make_decoder(model, max_seq_len=64)
    assert isinstance(dec, LlamaDecoder)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ok, diff, limit = close(dec(ids, torch.arange(40), *dec.cache_spec.allocate()), model(input_ids=ids).logits, TOL)
    assert ok, (diff, limit)
