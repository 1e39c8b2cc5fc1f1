"""Tests for kvtrace.spec.decoder: the Decoder protocol and its optional parts."""

from __future__ import annotations

import torch

from conftest import tiny_model
from kvtrace.models.hf_generic import HFDecoder
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec
from kvtrace.spec.decoder import Decoder, is_decoder, supports_last_logits

SPEC = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, 4),), batch_size=1, max_seq_len=4, dtype="float32")


class _Plain(torch.nn.Module):
    cache_spec = SPEC

    def forward(self, tokens, input_pos, *state):
        return torch.zeros(*tokens.shape, 3)


class _WithLast(_Plain):
    last_logits = False


def test_a_decoder_is_a_module_with_a_cache_spec():
    model = tiny_model("llama")
    dec = HFDecoder(model, max_seq_len=8)
    assert is_decoder(dec) and isinstance(dec, Decoder)
    assert not is_decoder(model)  # an HF model to adapt, not a Decoder
    assert is_decoder(_Plain()) and not is_decoder(object())


def test_last_logits_is_declared_by_the_class():
    assert supports_last_logits(_WithLast()) and not supports_last_logits(_Plain())
    assert supports_last_logits(HFDecoder(tiny_model("llama"), max_seq_len=8))
