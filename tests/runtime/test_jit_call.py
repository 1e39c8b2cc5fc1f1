"""kvtrace.jit's prologue (runtime/jit_call.py): the cache dtype a call's key holds is the one its program gets."""

from __future__ import annotations

import pytest
import torch
from transformers import StaticCache

import kvtrace
from conftest import tiny_model
from kvtrace.cache.hf import kv_geometry


def _static(model: torch.nn.Module, dtype: torch.dtype | None) -> StaticCache:
    """A StaticCache of 16 positions; early-initialized with ``dtype`` unless None (HF's lazy init then)."""
    cache = StaticCache(config=model.config, max_cache_len=16)
    if dtype is not None:
        _, n_kv, head_dim = kv_geometry(model.config)
        cache.early_initialization(1, n_kv, head_dim, dtype, torch.device("cpu"))
    return cache


def _export_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[list[torch.dtype]]:
    """The dtypes of the example tensors of every torch.export call from now on."""
    seen: list[list[torch.dtype]] = []
    real = torch.export.export

    def spy(mod, args, *a, **kw):
        seen.append([t.dtype for t in args])
        return real(mod, args, *a, **kw)

    monkeypatch.setattr(torch.export, "export", spy)
    return seen


def test_static_cache_examples_take_the_caches_own_dtype(monkeypatch):
    """A bf16 StaticCache on an fp32 model: the key says bf16, so the capture traces bf16 state (it used to trace
    the first parameter's fp32 and run that program on the bf16 tensors); eager refuses the call, so does jit."""
    model = tiny_model("llama")
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(RuntimeError, match="same dtype"):
        model(input_ids=ids, past_key_values=_static(model, torch.bfloat16))
    seen = _export_dtypes(monkeypatch)
    jm = kvtrace.jit(model, backend="eager")
    with pytest.raises((kvtrace.CaptureError, RuntimeError)):
        jm(input_ids=ids, cache=_static(model, torch.bfloat16))
    n_layers = model.config.num_hidden_layers
    assert seen and seen[0][1:] == [torch.bfloat16, torch.bfloat16, torch.int64] * n_layers


def test_an_uninitialized_static_cache_takes_what_lazy_init_allocates(monkeypatch):
    model = tiny_model("llama")
    seen = _export_dtypes(monkeypatch)
    jm = kvtrace.jit(model, backend="eager")
    cache = _static(model, None)
    out = jm(input_ids=torch.tensor([[1, 2, 3, 4]]), cache=cache)
    assert seen[0][1:] == [torch.float32, torch.float32, torch.int64] * model.config.num_hidden_layers
    assert cache.layers[0].keys.dtype == torch.float32 and out.logits.dtype == torch.float32
