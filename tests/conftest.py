"""Shared fixtures: tiny random-weight HF decoders (no downloads), one per supported architecture."""

from __future__ import annotations

import pytest
import torch

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=128,
    max_position_embeddings=512,
)

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3")


def tiny_model(arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A tiny random-weight causal LM of the given HF architecture, eval mode, no grads."""
    import transformers as tf

    cfg_kwargs = {**TINY, **overrides}
    if arch == "llama":
        cfg = tf.LlamaConfig(**cfg_kwargs)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**cfg_kwargs, use_sliding_window=False)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**cfg_kwargs, head_dim=16, use_sliding_window=False)
        cls = tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**cfg_kwargs, sliding_window=None)
        cls = tf.MistralForCausalLM
    elif arch == "phi3":
        cfg = tf.Phi3Config(**cfg_kwargs, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=None)
        cls = tf.Phi3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval().requires_grad_(False)
    # Random init leaves logits tiny and near-uniform; scale embeddings up so greedy picks are decisive.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)
    return model.to(dtype)


@pytest.fixture
def llama():
    return tiny_model("llama")
