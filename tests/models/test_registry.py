"""Tests for kvtrace.models.registry: which family adapts which HF model, and registering families."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ARCHS, tiny_mllama, tiny_model
from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.models import registry
from kvtrace.models.hf_generic import HFDecoder
from kvtrace.models.llama import LlamaDecoder
from kvtrace.models.mllama import MllamaDecoder
from kvtrace.models.registry import Family, families, family_for, make_decoder, register, unregister
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec
from kvtrace.spec.decoder import Decoder

# Every tiny arch is a Llama-family config LlamaDecoder reproduces (qwen3's q/k norms, phi3's fused projections too).
EXPECTED = {"llama": "llama", "qwen2": "llama", "mistral": "llama", "qwen3": "llama", "phi3": "llama"}
DECODER = {"llama": LlamaDecoder, "hf": HFDecoder, "mllama": MllamaDecoder}


@pytest.mark.parametrize("arch", ARCHS)
def test_each_tiny_arch_gets_its_family(arch):
    model = tiny_model(arch)
    family = family_for(model.config)
    assert family.name == EXPECTED[arch]
    dec = make_decoder(model, max_seq_len=16)
    assert type(dec) is DECODER[family.name] and isinstance(dec, Decoder)
    assert dec.cache_spec.max_seq_len == 16


def test_mllama_gets_the_vision_family():
    model = tiny_mllama()
    assert family_for(model.config).name == "mllama" and family_for(model.config).vision
    dec = make_decoder(model, max_seq_len=16, image_tokens=6)
    assert type(dec) is MllamaDecoder and dec.image_tokens == 6


def test_length_dependent_rope_falls_through_to_the_general_family():
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert family_for(tiny_model("llama", rope_parameters=rope).config).name == "hf"


def test_families_are_asked_specialised_first():
    names = [f.name for f in families()]
    assert names == ["mllama", "llama", "gemma", "hf"]
    assert [f.priority for f in families()] == sorted(f.priority for f in families())


def test_unsupported_model_type_is_one_line():
    import transformers as tf

    cfg = tf.BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=32)  # the reason is named, not a list
    with pytest.raises(UnsupportedError, match=r"model type 'bloom' is not supported for export: BloomForCausalLM's "
                                               r"attention does not go through transformers' attention interface"):
        family_for(cfg)
    with pytest.raises(UnsupportedError, match="'bloom' is not supported") as e:
        make_decoder(tf.BloomForCausalLM(cfg).eval(), max_seq_len=8)
    assert "\n" not in str(e.value)


def test_image_tokens_on_a_text_family_is_refused():
    with pytest.raises(UsageError, match=r"image_tokens applies to vision decoders.*'llama' is a text-only model"):
        make_decoder(tiny_model("llama"), max_seq_len=16, image_tokens=6)


class _Toy(torch.nn.Module):
    """A Decoder that ignores its input: logits of zeros over a one-layer cache."""

    def __init__(self, max_seq_len: int, batch_size: int):
        super().__init__()
        self.cache_spec = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, max_seq_len),), batch_size=batch_size,
                                    max_seq_len=max_seq_len, dtype="float32")

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*tokens.shape, 3)  # [B, T, V=3]


def _toy(name: str = "toy", priority: int = 0, model_types: tuple[str, ...] = ("llama",)) -> Family:
    def supports(config):
        return config.model_type in model_types

    def build(model, *, max_seq_len, batch_size, image_tokens):
        return _Toy(max_seq_len, batch_size)

    return Family(name, model_types, supports, build, priority=priority)


def test_a_registered_family_is_picked_until_unregistered():
    model = tiny_model("llama")
    register(_toy())
    try:
        assert families()[0].name == "toy"
        dec = make_decoder(model, max_seq_len=8, batch_size=2)
        assert type(dec) is _Toy and dec.cache_spec.batch_size == 2
        assert family_for(tiny_model("phi3").config).name == "llama"  # the toy does not take phi3
    finally:
        unregister("toy")
    assert "toy" not in [f.name for f in families()]
    assert type(make_decoder(model, max_seq_len=8)) is LlamaDecoder


def test_a_family_can_cover_a_new_model_type_and_ties_go_to_the_first_registered():
    import transformers as tf

    cfg = tf.BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=32)  # no built-in family adapts Bloom
    register(_toy("bloom-a", priority=50, model_types=("bloom",)))
    register(_toy("bloom-b", priority=50, model_types=("bloom",)))
    try:
        assert family_for(cfg).name == "bloom-a"
    finally:
        unregister("bloom-a")
        unregister("bloom-b")
    with pytest.raises(UnsupportedError):
        family_for(cfg)


def test_register_and_unregister_refuse_what_they_cannot_do():
    with pytest.raises(UsageError, match="'llama' is already registered"):
        register(_toy("llama"))
    with pytest.raises(UsageError, match="no registered model family named 'nope'"):
        unregister("nope")
    with pytest.raises(UsageError, match="no registered model family named 'hf'"):
        unregister("hf")  # built-ins stay
    assert [f.name for f in families()] == ["mllama", "llama", "gemma", "hf"]


def test_importing_the_registry_imports_no_family():
    code = ("import sys, kvtrace.models.registry as r\n"
            "assert not any(m in sys.modules for m in r.BUILTIN), [m for m in r.BUILTIN if m in sys.modules]\n"
            "assert [f.name for f in r.families()] == ['mllama', 'llama', 'gemma', 'hf']\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert registry.BUILTIN == ("kvtrace.models.mllama", "kvtrace.models.llama", "kvtrace.models.gemma",
                                "kvtrace.models.hf_generic")
