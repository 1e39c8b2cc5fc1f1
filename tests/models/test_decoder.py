"""HFDecoder in eager mode: the functional view of an HF model equals the model with a DynamicCache."""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, tiny_model
from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.cache.hf import cache_kwarg_name
from kvtrace.models.hf_generic import HFDecoder
from kvtrace.spec.tolerances import close, tolerance_for

PROMPT = torch.tensor([[5, 17, 42, 8, 99]])  # [1, 5]
TOL = tolerance_for(torch.float32)


def eager(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{cache_kwarg_name(model): cache}).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_matches_hf_with_a_dynamic_cache(arch):
    from transformers import DynamicCache

    model = tiny_model(arch)
    dec = HFDecoder(model, max_seq_len=16)
    state = dec.cache_spec.allocate()
    assert [tuple(t.shape) for t in state] == [b.shape for b in dec.cache_spec.buffers()]
    cache = DynamicCache(config=model.config)
    ref = eager(model, cache, PROMPT)
    with torch.no_grad():
        got = dec(PROMPT, torch.arange(5), *state)
    pos = 5
    for step in range(4):
        ok, diff, limit = close(got, ref, TOL)
        assert ok, f"{arch} call {step}: logits differ by {diff} > {limit}"
        for i, layer in enumerate(cache.layers):
            assert close(state[2 * i][:, :, :pos], layer.keys, TOL)[0], (arch, step, i, "K")
            assert close(state[2 * i + 1][:, :, :pos], layer.values, TOL)[0], (arch, step, i, "V")
            assert int(state[2 * i][:, :, pos:].count_nonzero()) == 0, "written beyond the position"
        tok = ref[:, -1:].argmax(-1)
        ref = eager(model, cache, tok)
        with torch.no_grad():
            got = dec(tok, torch.tensor([pos]), *state)
        pos += 1


def test_decoder_keeps_no_cache_of_its_own():
    model = tiny_model("llama")
    dec = HFDecoder(model, max_seq_len=8)
    assert not [n for n, _ in dec.named_buffers() if "cache" in n or n.endswith((".keys", ".values"))]
    theirs = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    assert all(t.data_ptr() in theirs for t in [*dec.parameters(), *dec.buffers()])  # the model's tensors only
    state = dec.cache_spec.allocate()
    with torch.no_grad():
        dec(PROMPT, torch.arange(5), *state)
    held = [t for m in dec.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]
    assert not any(t.data_ptr() == s.data_ptr() for t in held for s in state)  # the call's cache stays the caller's


def test_decoder_reads_positions_not_a_counter():
    """Rewriting positions 3.. over stale slots equals a clean run: HF masks by position."""
    model = tiny_model("llama")
    dec = HFDecoder(model, max_seq_len=12)
    clean, stale = dec.cache_spec.allocate(), dec.cache_spec.allocate()
    with torch.no_grad():
        dec(torch.tensor([[9, 8, 7, 6, 5, 4]]), torch.arange(6), *stale)  # 6 tokens, then "rewind" to 3
        a = dec(torch.tensor([[40, 41]]), torch.tensor([3, 4]), *stale)
        dec(torch.tensor([[9, 8, 7]]), torch.arange(3), *clean)
        b = dec(torch.tensor([[40, 41]]), torch.tensor([3, 4]), *clean)
    ok, diff, limit = close(a, b, TOL)
    assert ok, (diff, limit)


def test_unsupported_model_type_is_refused():
    import transformers as tf

    cfg = tf.BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=32)  # ALiBi, its own attention
    model = tf.BloomForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedError, match="'bloom' cannot be exported: BloomForCausalLM's attention does not go"):
        HFDecoder(model, max_seq_len=8)


def test_max_seq_len_beyond_the_model_is_refused():
    with pytest.raises(UsageError, match="1024 exceeds the model's max_position_embeddings 512"):
        HFDecoder(tiny_model("llama"), max_seq_len=1024)
