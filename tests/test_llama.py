"""LlamaDecoder reproduces the HF Llama family: logits and every K/V, prefill and decode."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from kvtrace._decoder import HFDecoder, hf_cache_spec, make_decoder
from kvtrace._llama import LlamaDecoder, supports
from kvtrace._tolerances import close, tolerance_for


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
def test_other_architectures_use_the_general_decoder(arch):
    model = tiny_model(arch)
    assert not supports(model.config)
    assert isinstance(make_decoder(model, max_seq_len=8), HFDecoder)


def test_sliding_window_is_not_claimed():
    model = tiny_model("mistral", sliding_window=4)
    assert not supports(model.config)
