"""GemmaDecoder (Gemma, Gemma 2, Gemma 3 text): picked by make_decoder, exported with hybrid ring + full caches
and verified against HF eager far beyond the window (logits and every layer's valid slots); each config it
does not reproduce falls through (supports() is False)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvtrace
from conftest import FAMILY_ARCHS, TINY, tiny_model
from helpers import assert_exact_beyond_window, verify_bf16_export
from kvtrace._errors import UnsupportedError
from kvtrace.models import gemma
from kvtrace.models.registry import family_for, make_decoder
from kvtrace.models.step import LIVE_PROGRAMS
from kvtrace.spec.cache import LayerKind

WINDOW, MAX_SEQ_LEN, STEPS = 8, 48, 30  # FAMILY_ARCHS' Gemma 2 / 3 slide over 8 tokens on layer 0
# Two prompts (verify resets between them), the second longer than twice the window, each then decoded 30
# steps: positions up to 41 and 47, past 2x the window; the second prefill alone wraps the ring twice.
PROMPTS = ([5, 17, 42, 8, 99, 3, 64, 7, 1, 2, 9], [3, 11, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18])
FULL, SLIDING = LayerKind.FULL, LayerKind.SLIDING
LINEAR = {"rope_type": "linear", "factor": 8.0}  # real Gemma 3 checkpoints scale their global RoPE so
# name -> (arch, config overrides, layer kinds, RoPE tables)
MODELS = {
    "gemma": ("gemma", {}, [FULL, FULL], 1),
    "gemma2": ("gemma2", {}, [SLIDING, FULL], 1),
    "gemma3_text": ("gemma3_text", {}, [SLIDING, FULL], 2),
    "gemma3_text-linear": ("gemma3_text", dict(rope_scaling=LINEAR), [SLIDING, FULL], 2),
}


def _with_norms(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """HF initialises every Gemma norm weight to 0 ((1 + w) = 1): give each its own random weight, so that a
    norm scaled by w instead of 1 + w, skipped, or read from the wrong HF norm changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__.endswith("RMSNorm"):
                mod.weight.copy_(0.5 * torch.randn(mod.weight.shape, generator=gen))
    return model


def _tiny(arch: str, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    return _with_norms(tiny_model(arch, **overrides)).to(dtype)


def _model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    arch, overrides, _, _ = MODELS[name]
    return _tiny(arch, dtype, **overrides)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[tuple[str, str], tuple[torch.nn.Module, Any]] = {}

    def get(name: str, backend: str = "exported") -> tuple[torch.nn.Module, Any]:
        if (name, backend) not in cache:
            model, path = _model(name), tmp_path_factory.mktemp(f"{name}-{backend}") / "m.kvt"
            kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=backend)
            cache[name, backend] = model, kvtrace.load(path)
        return cache[name, backend]

    return get


def _state(dec: torch.nn.Module) -> list[torch.Tensor]:
    return [torch.full(b.shape, b.init, dtype=getattr(torch, b.dtype)) for b in dec.cache_spec.buffers()]


@pytest.mark.parametrize("name", list(MODELS))
def test_make_decoder_picks_gemma_with_its_quirks(name):
    model = _model(name)
    dec = make_decoder(model, max_seq_len=MAX_SEQ_LEN)
    _, _, kinds, tables = MODELS[name]
    assert type(dec) is gemma.GemmaDecoder and family_for(model.config).name == "gemma"
    assert [x.kind for x in dec.cache_spec.layers] == kinds and dec.programs == LIVE_PROGRAMS
    a = dec.args
    assert a.tie_embeddings and dec.output.weight is dec.tok_embeddings.weight
    assert dec.embed_scale.item() == model.model.embed_tokens.embed_scale.item() == TINY["hidden_size"] ** 0.5
    assert dec.rope_cos.shape == (tables, MAX_SEQ_LEN, 16)
    if name == "gemma":
        assert (a.post_norms, a.qk_norm, a.attn_softcap, a.final_softcap) == (False, False, None, None)
        assert a.scale == 16 ** -0.5
    else:  # query_pre_attn_scalar 256 (the config default) instead of head_dim 16
        assert a.post_norms and a.qk_norm == name.startswith("gemma3") and a.scale == 256 ** -0.5
    if name == "gemma2":  # Gemma 2's defaults cap both the attention scores and the logits
        assert (a.attn_softcap, a.final_softcap) == (50.0, 30.0) and model.config._attn_implementation == "eager"
    if tables == 2:  # layer 0 slides with the local table, layer 1 the global one
        assert a.rope_of == (1, 0) and not torch.equal(dec.rope_cos[0], dec.rope_cos[1])
        local, glob = model.model.rotary_emb.sliding_attention_inv_freq, model.model.rotary_emb.full_attention_inv_freq
        assert torch.equal(dec.rope_cos[1, 5, :8], (5 * local).cos()) and torch.equal(dec.rope_cos[0, 5, :8],
                                                                                      (5 * glob).cos())
    if name == "gemma3_text-linear":  # the global frequencies divided by 8, the local ones untouched
        plain = make_decoder(_model("gemma3_text"), max_seq_len=MAX_SEQ_LEN)
        assert torch.equal(dec.rope_cos[1], plain.rope_cos[1]) and not torch.equal(dec.rope_cos[0], plain.rope_cos[0])


# Variants the exported tests do not build, checked by one forward over 30 tokens against HF's logits.
VARIANTS = {
    "gemma-untied": ("gemma", dict(tie_word_embeddings=False)),
    "gemma2-uncapped": ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
    "gemma2-hard-capped": ("gemma2", dict(attn_logit_softcapping=1.0, final_logit_softcapping=3.0)),
    # HF 5.24's Gemma 3 attention never passes attn_logit_softcapping on: the logits ignore it
    "gemma3_text-attn-cap-ignored": ("gemma3_text", dict(attn_logit_softcapping=1.0, final_logit_softcapping=3.0)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_hf(variant):
    arch, overrides = VARIANTS[variant]
    model = _tiny(arch, **overrides)
    dec = make_decoder(model, max_seq_len=MAX_SEQ_LEN)
    assert type(dec) is gemma.GemmaDecoder
    assert dec.args.tie_embeddings is overrides.get("tie_word_embeddings", True)
    tokens = torch.tensor([[(7 * i + 3) % 128 for i in range(30)]])
    pos = torch.arange(30)
    want = model(tokens).logits
    got = dec.forward_live(tokens, pos, pos, *_state(dec))
    assert (got - want).abs().max().item() <= 1e-4
    if overrides.get("final_logit_softcapping"):
        assert want.abs().max().item() <= overrides["final_logit_softcapping"]


def test_every_norm_weight_reaches_the_logits():
    """The forward checks above are sensitive to each norm: dropping any one of its weights (as if never copied
    from HF) moves the logits far beyond the tolerance."""
    model = _tiny("gemma3_text")
    tokens, pos = torch.tensor([[(7 * i + 3) % 128 for i in range(12)]]), torch.arange(12)
    want = model(tokens).logits
    dec = make_decoder(model, max_seq_len=MAX_SEQ_LEN)
    names = [n for n, _ in dec.named_parameters() if n == "norm" or n.endswith("norm")]
    assert len(names) == 1 + 2 * 6  # final + per layer: attn, post-attn, pre-MLP, post-MLP, q, k
    for name in names:
        broken = copy.deepcopy(dec)
        broken.get_parameter(name).zero_()
        got = broken.forward_live(tokens, pos, pos, *_state(broken))
        assert (got - want).abs().max().item() > 1e-2, name


def _assert_exact_beyond_the_window(name: str, model: torch.nn.Module, art: Any, runner: str) -> dict[str, float]:
    return assert_exact_beyond_window(model, art, runner, PROMPTS, STEPS, WINDOW, MODELS[name][2])


@pytest.mark.parametrize("name", list(MODELS))
def test_exported_matches_eager_beyond_twice_the_window(name, built):
    model, art = built(name)
    spec, kinds = art.cache_spec, MODELS[name][2]
    assert [x.kind for x in spec.layers] == kinds and spec.max_seq_len == MAX_SEQ_LEN
    assert [x.window for x in spec.layers] == [WINDOW if k is SLIDING else None for k in kinds]
    slots = [WINDOW if k is SLIDING else MAX_SEQ_LEN for k in kinds]
    assert [b.shape[2] for b in spec.buffers()] == [s for s in slots for _ in "kv"]  # from the CacheSpec
    assert set(art.manifest.signatures) == {"prefill", "decode"}
    for program, signature in art.manifest.signatures.items():  # ... and from each program's signature
        assert [i["shape"][2] for i in signature[-2 * len(kinds):]] == [s for s in slots for _ in "kv"], program
    _assert_exact_beyond_the_window(name, model, art, "exported")


def test_bf16_gemma3_passes_with_the_fp32_reference(tmp_path):
    low = _model("gemma3_text", torch.bfloat16)
    art = verify_bf16_export(low, tmp_path / "m.kvt", PROMPTS, STEPS, MAX_SEQ_LEN)
    assert [x.kind for x in art.cache_spec.layers] == [SLIDING, FULL]


@pytest.mark.compile
def test_aoti_gemma3_matches_eager_beyond_twice_the_window(built):
    model, art = built("gemma3_text", "aoti")
    _assert_exact_beyond_the_window("gemma3_text", model, art, "aoti")


def _config(arch: str, **overrides: Any) -> Any:
    import transformers as tf

    config_cls, _, defaults = FAMILY_ARCHS[arch]
    return getattr(tf, config_cls)(**{**defaults, **TINY, **overrides})


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
# refusal -> (arch, config overrides, attributes set after construction)
REFUSED = {
    "bidirectional": ("gemma", dict(use_bidirectional_attention=True), {}),
    "bidirectional-gemma3": ("gemma3_text", dict(use_bidirectional_attention=True), {}),
    "attention-bias": ("gemma", dict(attention_bias=True), {}),
    "activation": ("gemma", dict(hidden_act="silu"), {}),
    "activation-gemma2": ("gemma2", dict(hidden_activation="gelu_new"), {}),
    "gemma-with-a-window": ("gemma", {}, dict(sliding_window=WINDOW)),
    "unknown-layer-type": ("gemma2", {}, dict(layer_types=["sliding_attention", "chunked_attention"])),
    "dynamic-rope": ("gemma2", dict(rope_parameters=DYNAMIC), {}),
    "dynamic-rope-gemma3-global": ("gemma3_text", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), {}),
    "softcap-not-eager": ("gemma2", {}, dict(_attn_implementation="flex_attention")),
}


def test_the_tiny_configs_refusals_start_from_are_supported():
    for arch in ("gemma", "gemma2", "gemma3_text"):
        assert gemma.supports(_config(arch)), arch


@pytest.mark.parametrize("refusal", list(REFUSED))
def test_supports_refuses_what_it_does_not_reproduce(refusal):
    arch, overrides, attrs = REFUSED[refusal]
    cfg = _config(arch, **overrides)
    for k, v in attrs.items():
        setattr(cfg, k, v)
    assert not gemma.supports(cfg)
    with pytest.raises(UnsupportedError, match="GemmaDecoder does not reproduce"):
        gemma.GemmaDecoder.from_hf(SimpleNamespace(config=cfg), None)  # refused before it reads weights


def test_composite_gemma3_is_not_taken_for_its_text_decoder():
    import transformers as tf

    cfg = tf.Gemma3Config(text_config=_config("gemma3_text").to_dict())
    assert cfg.get_text_config(decoder=True).model_type == "gemma3_text" and not gemma.supports(cfg)
