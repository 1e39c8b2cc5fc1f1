"""Tests for kvtrace.spec.config: the facts read from HF config objects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers as tf

from conftest import TINY
from kvtrace._errors import UsageError
from kvtrace.spec import config as hfconfig


def test_head_dim_prefers_config_head_dim_over_hidden_by_heads():
    assert hfconfig.head_dim(tf.LlamaConfig(**TINY)) == 64 // 4
    assert hfconfig.head_dim(tf.LlamaConfig(**TINY, head_dim=8)) == 8
    assert hfconfig.head_dim(tf.Qwen3Config(**TINY, head_dim=32)) == 32
    assert hfconfig.head_dim(SimpleNamespace(head_dim=None, hidden_size=96, num_attention_heads=3)) == 32
    assert hfconfig.head_dim(SimpleNamespace(hidden_size=96, num_attention_heads=4)) == 24


def test_kv_heads_default_to_the_query_heads():
    assert hfconfig.kv_heads(tf.LlamaConfig(**TINY)) == 2
    assert hfconfig.kv_heads(SimpleNamespace(num_key_value_heads=None, num_attention_heads=4)) == 4


def test_a_composite_config_is_read_through_its_text_config():
    text = tf.MllamaTextConfig(**TINY, cross_attention_layers=[1])
    vision = tf.MllamaConfig(text_config=text.to_dict())
    assert hfconfig.text_config(vision).model_type == "mllama_text_model"
    assert hfconfig.head_dim(vision) == 16 and hfconfig.max_positions(vision) == 512
    plain = SimpleNamespace(model_type="x")
    assert hfconfig.text_config(plain) is plain


@pytest.mark.parametrize(("cfg", "expected"), [
    (tf.LlamaConfig(**TINY), "default"),
    (tf.LlamaConfig(**TINY, rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                             "rope_theta": 10000.0}), "llama3"),
    (SimpleNamespace(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),  # transformers 4.x spelling
    (SimpleNamespace(rope_parameters=None, rope_scaling=None), "default"),
    (SimpleNamespace(rope_scaling="linear"), "default"),  # not a dict: nothing to read
])
def test_rope_type(cfg, expected):
    assert hfconfig.rope_type(cfg) == expected


def test_max_positions_and_the_max_seq_len_check():
    cfg = tf.LlamaConfig(**TINY)
    assert hfconfig.max_positions(cfg) == 512
    hfconfig.check_max_seq_len(cfg, 512)
    with pytest.raises(UsageError, match="max_seq_len 600 exceeds the model's max_position_embeddings 512"):
        hfconfig.check_max_seq_len(cfg, 600)
    free = SimpleNamespace()  # declares no limit: nothing to check
    assert hfconfig.max_positions(free) is None
    hfconfig.check_max_seq_len(free, 10**6)


def test_sliding_window_and_layer_types():
    mistral = tf.MistralConfig(**TINY, sliding_window=16)
    assert hfconfig.sliding_window(mistral) == 16
    assert hfconfig.layer_types(mistral) == ("sliding_attention",) * 2
    assert hfconfig.sliding_window(tf.MistralConfig(**TINY, sliding_window=None)) is None
    qwen2 = tf.Qwen2Config(**TINY, use_sliding_window=False)
    assert hfconfig.sliding_window(qwen2) is None  # a window is configured but switched off
    assert hfconfig.layer_types(qwen2) == ("full_attention",) * 2
    declared = SimpleNamespace(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)
    assert hfconfig.layer_types(declared) == ("sliding_attention", "full_attention")
    assert hfconfig.layer_types(SimpleNamespace(num_hidden_layers=3)) == ("full_attention",) * 3
