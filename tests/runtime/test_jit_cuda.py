"""kvtrace.jit on a model on a GPU: captured with its own device's examples, compiled for CUDA (marked cuda)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvtrace
from conftest import tiny_model
from helpers import assert_close


@pytest.mark.cuda
@pytest.mark.compile
def test_jit_on_a_cuda_model_matches_eager_step_by_step():
    model = tiny_model("llama").cuda()
    jm = kvtrace.jit(model)
    jc, ec = DynamicCache(), DynamicCache()
    ids = torch.tensor([[5, 17, 42, 8, 99]], device="cuda")
    mask = torch.ones_like(ids)
    jo, eo = jm(input_ids=ids, cache=jc, attention_mask=mask, use_cache=True), \
        model(input_ids=ids, cache=ec, attention_mask=mask, use_cache=True)
    for _ in range(6):
        assert jo.logits.is_cuda and jo.past_key_values is jc
        assert_close(jo.logits, eo.logits, what="logits")
        for a, b in zip(jc.layers, ec.layers, strict=True):
            assert a.keys.is_cuda
            assert_close(a.keys, b.keys, what="keys")
            assert_close(a.values, b.values, what="values")
        tok = eo.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        jo = jm(input_ids=tok, cache=jc, attention_mask=mask, use_cache=True)
        eo = model(input_ids=tok, cache=ec, attention_mask=mask, use_cache=True)
    assert jm.stats.captures == 2  # prefill and decode, no recapture per step
