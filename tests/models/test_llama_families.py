"""More HF families on LlamaDecoder's fast path (Qwen3, SmolLM3, Granite, OLMo2, Phi-3 incl. LongRoPE), each
with its quirks switched on: exported and verified against HF eager (logits and every cache layer's valid
slots) far beyond a sliding window; config variations the fast path does not reproduce fall through."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvtrace
from conftest import TINY, tiny_model
from helpers import assert_exact_beyond_window, verify_bf16_export
from kvtrace._errors import UnsupportedError
from kvtrace.models import registry
from kvtrace.models.hf_generic import hf_cache_spec
from kvtrace.models.llama import LlamaDecoder, supports
from kvtrace.spec.cache import LayerKind

WINDOW, MAX_SEQ_LEN, STEPS = 8, 48, 30
# As test_llama_sliding.py: two prompts (verify resets between them), the second longer than twice the window,
# each decoded 30 steps: positions up to 41 and 47.
PROMPTS = ([5, 17, 42, 8, 99, 3, 64, 7, 1, 2, 9], [3, 11, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18])
FULL, SLIDING = LayerKind.FULL, LayerKind.SLIDING
PARTIAL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
# Phi-3 LongRoPE switching at 16 (HF reads original_max_position_embeddings from the config's top level): the
# 11-token prompt crosses it while decoding, the 17-token prefill is past it from the start.
SWITCH, HALF = 16, TINY["hidden_size"] // TINY["num_attention_heads"] // 2
LONGROPE = dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
                                 "long_factor": [1.5 + 0.5 * i for i in range(HALF)]},
                max_position_embeddings=64, original_max_position_embeddings=SWITCH)
# name -> (arch, config overrides, layer kinds, what LlamaDecoder must have read from the config)
FAMILIES: dict[str, tuple[str, dict[str, Any], list[LayerKind], dict[str, Any]]] = {
    "qwen3": ("qwen3", {}, [FULL, FULL], dict(qk_norm="head", head_dim=16)),
    "qwen3-hybrid": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                     [FULL, SLIDING], dict(qk_norm="head")),
    "smollm3": ("smollm3", {}, [FULL, FULL], dict(no_rope=(1,))),  # no_rope_layer_interval=2: layer 1 has no RoPE
    "granite": ("granite", {}, [FULL, FULL], dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                                  attention_scale=0.0078125, logits_scaling=0.125)),
    "olmo2": ("olmo2", {}, [FULL, FULL], dict(post_norms=True, norm_upcast=True, qk_norm="proj")),
    "phi3": ("phi3", {}, [FULL, FULL], dict(qk_norm=None)),
    "phi3-partial": ("phi3", dict(rope_parameters=PARTIAL_ROPE), [FULL, FULL], dict(qk_norm=None)),
    "phi3-longrope": ("phi3", LONGROPE, [FULL, FULL], dict(rope_switch=SWITCH)),
    "phi3-sliding": ("phi3", dict(sliding_window=WINDOW), [SLIDING, SLIDING], dict(rope_switch=None)),
}


def _model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    arch, overrides, _, _ = FAMILIES[name]
    return tiny_model(arch, dtype, **overrides)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache: dict[tuple[str, str], tuple[torch.nn.Module, Any]] = {}

    def get(name: str, backend: str = "exported") -> tuple[torch.nn.Module, Any]:
        if (name, backend) not in cache:
            model = _model(name)
            path = tmp_path_factory.mktemp(f"{name}-{backend}") / "m.kvt"
            kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=backend)
            cache[name, backend] = model, kvtrace.load(path)
        return cache[name, backend]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_fast_path_claims_the_family_and_reads_its_quirks(name):
    model = _model(name)
    assert supports(model.config) and registry.family_for(model.config).name == "llama"
    dec = registry.make_decoder(model, max_seq_len=MAX_SEQ_LEN)
    assert type(dec) is LlamaDecoder
    for field, value in FAMILIES[name][3].items():
        assert getattr(dec.args, field) == value, field
    assert [x.kind for x in dec.cache_spec.layers] == FAMILIES[name][2]
    if name == "phi3-partial":  # the RoPE table covers the rotated half of each head only
        assert dec.rope_cos.shape == (MAX_SEQ_LEN, dec.args.head_dim // 2)
    assert hasattr(dec, "rope_cos_long") == (name == "phi3-longrope")
    if name.startswith("phi3"):  # HF's fused projections, copied as they are (q, k, v rows; gate, up rows)
        att, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert torch.equal(dec.layers[0].wqkv.weight, att.qkv_proj.weight)
        assert torch.equal(dec.layers[0].w13.weight, mlp.gate_up_proj.weight)


def _assert_exact(name: str, model: torch.nn.Module, art: Any, runner: str) -> None:
    assert_exact_beyond_window(model, art, runner, PROMPTS, STEPS, WINDOW, FAMILIES[name][2], rel_limit=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_exported_family_matches_eager_logits_and_every_cache_layer(name, exported):
    model, art = exported(name)
    kinds = FAMILIES[name][2]
    slots = [WINDOW if k is SLIDING else MAX_SEQ_LEN for k in kinds]
    assert [x.kind for x in art.cache_spec.layers] == kinds
    assert [b.shape[2] for b in art.cache_spec.buffers()] == [s for s in slots for _ in "kv"]
    _assert_exact(name, model, art, "exported")


def test_bf16_qwen3_hybrid_passes_with_the_fp32_reference(tmp_path):
    low = _model("qwen3-hybrid", torch.bfloat16)
    verify_bf16_export(low, tmp_path / "m.kvt", PROMPTS, STEPS, MAX_SEQ_LEN)  # (it exported fp32 before)


@pytest.mark.compile
def test_aoti_qwen3_hybrid_matches_eager_beyond_twice_the_window(exported):
    model, art = exported("qwen3-hybrid", "aoti")
    _assert_exact("qwen3-hybrid", model, art, "aoti")


# name -> a config variation the fast path does not reproduce (it must fall through, never run approximately)
FALLS_THROUGH = {
    "qwen3": lambda: tiny_model("qwen3", hidden_act="gelu"),
    "qwen3-hybrid": lambda: tiny_model("qwen3", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                       rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    "smollm3": lambda: tiny_model("smollm3", mlp_bias=True),
    "granite": lambda: tiny_model("granite", hidden_act="gelu"),
    "olmo2": lambda: tiny_model("olmo2", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    "phi3": lambda: tiny_model("phi3", hidden_act="gelu_new"),
    "phi3-partial": lambda: tiny_model("phi3", hidden_act="gelu_new", rope_parameters=PARTIAL_ROPE),
    # longrope is reproduced for Phi-3 only (its checkpoints); another family's longrope stays general
    "phi3-longrope": lambda: tiny_model("llama", **LONGROPE),
    "phi3-sliding": lambda: tiny_model("phi3", sliding_window=WINDOW, hidden_act="gelu_new"),
}


@pytest.mark.parametrize("name", list(FALLS_THROUGH))
def test_a_variation_the_fast_path_does_not_reproduce_falls_through(name):
    model = FALLS_THROUGH[name]()
    assert not supports(model.config)
    spec = hf_cache_spec(model.config, max_seq_len=MAX_SEQ_LEN, batch_size=1, dtype=torch.float32)
    with pytest.raises(UnsupportedError, match="does not reproduce"):
        LlamaDecoder.from_hf(model, spec)
    try:
        family = registry.family_for(model.config).name  # the general path, which runs or refuses it by name
    except UnsupportedError:
        family = None  # no family takes it: refused by name, never run approximately
    assert family != "llama"

def test_a_bias_the_config_does_not_announce_is_refused_not_dropped():
    model = tiny_model("phi3")
    for layer in model.model.layers:
        layer.self_attn.o_proj.bias = torch.nn.Parameter(torch.ones(model.config.hidden_size))
    spec = hf_cache_spec(model.config, max_seq_len=MAX_SEQ_LEN, batch_size=1, dtype=torch.float32)
    dec = LlamaDecoder.from_hf(model, spec)  # read from the modules: carried
    assert dec.args.o_bias and torch.equal(dec.layers[0].wo.bias, torch.ones(model.config.hidden_size))
    model.model.layers[1].self_attn.o_proj.bias = None  # only layer 0 has one now: refused, not dropped
    with pytest.raises(UnsupportedError, match="o_proj"):
        LlamaDecoder.from_hf(model, spec)


def test_longrope_past_the_switch_needs_the_long_table():
    """The switch is real at these positions: the short table alone (no switch) misses HF's keys past it."""
    from transformers import DynamicCache

    model = _model("phi3-longrope")
    dec = registry.make_decoder(model, max_seq_len=MAX_SEQ_LEN)
    assert not torch.equal(dec.rope_cos_long, dec.rope_cos)
    ids = torch.tensor([PROMPTS[1] + [20, 21, 22]])  # 20 positions: past the switch at 16, so all of them long
    cache, exact, short_only = DynamicCache(config=model.config), dec.cache_spec.allocate(), dec.cache_spec.allocate()
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        dec(ids, torch.arange(ids.shape[1]), *exact)
        dec.rope_cos_long.copy_(dec.rope_cos)
        dec.rope_sin_long.copy_(dec.rope_sin)
        dec(ids, torch.arange(ids.shape[1]), *short_only)
    hf_k0 = cache.layers[0].keys  # [1, H_kv, 20, D]
    assert (exact[0][:, :, :20] - hf_k0).abs().max() <= 1e-5
    assert (short_only[0][:, :, :20] - hf_k0).abs().max() > 1e-1
