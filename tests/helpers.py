"""Shared test helpers (not fixtures: those live in conftest.py). Import as ``from helpers import ...``."""

from __future__ import annotations

import torch
import transformers as tf

from kvtrace.spec.tolerances import close, tolerance_for


def assert_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32, what: str = "") -> float:
    """``a`` within ``dtype``'s tolerance (kvtrace.spec.tolerances) of the reference ``b``; the max abs diff."""
    ok, diff, limit = close(a, b, tolerance_for(dtype))
    assert ok, f"{what}: max|a - b| = {diff:.3g} > {limit:.3g}"
    return diff


class CacheKwargOnlyLlama(tf.LlamaForCausalLM):
    """A Llama whose forward takes the cache as ``cache=`` only, as transformers 5.40 will (5.24 still takes
    the deprecated ``past_key_values=`` through its ``**kwargs``): a caller using the old name fails."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
        if "past_key_values" in kwargs:
            raise TypeError("forward() got an unexpected keyword argument 'past_key_values'")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, **kwargs)


def cache_kwarg_only_model() -> CacheKwargOnlyLlama:
    from conftest import TINY

    torch.manual_seed(0)
    return CacheKwargOnlyLlama(tf.LlamaConfig(**TINY)).eval().requires_grad_(False)
