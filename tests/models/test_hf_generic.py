"""The general HF decoder path (HFDecoder: HF's own modules over kvtrace's cache and attention) for every
decoder-only family: exported and verified against HF eager far beyond the sliding window (logits and every
layer's valid slots), rings of ``window`` slots, the caller's model untouched, unsupported kinds refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import kvtrace
from conftest import FAMILY_ARCHS, TINY, tiny_model
from helpers import assert_exact_beyond_window
from kvtrace._errors import CaptureError, UnsupportedError
from kvtrace.models import hf_attention
from kvtrace.models.hf_generic import HFDecoder, refusal
from kvtrace.models.registry import family_for, make_decoder
from kvtrace.spec.cache import LayerKind
from kvtrace.spec.tolerances import close, tolerance_for
from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

WINDOW, MAX_SEQ_LEN, STEPS = 8, 48, 30
# Two prompts (verify resets between them), the second longer than twice the window, each decoded 30 steps:
# positions up to 41 and 47, more than twice the window; the second prefill alone wraps the ring twice.
PROMPTS = ([5, 17, 42, 8, 99, 3, 64, 7, 1, 2, 9], [3, 11, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18])
TOL = tolerance_for(torch.float32)
F, S = LayerKind.FULL, LayerKind.SLIDING
# arch -> (config overrides, declared layer kinds); FAMILY_ARCHS' gemma2/gemma3_text slide (window 8) on layer 0
MODELS: dict[str, tuple[dict[str, Any], list[LayerKind]]] = {
    "gemma": ({}, [F, F]),
    "gemma2": ({}, [S, F]),
    "gemma3_text": ({}, [S, F]),
    "smollm3": ({}, [F, F]),
    "granite": ({}, [F, F]),
    "olmo2": ({}, [F, F]),
    "gpt_neox": ({}, [F, F]),
    "qwen3": (dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1), [F, S]),
    "phi3": (dict(sliding_window=WINDOW), [S, S]),
    "mistral": (dict(sliding_window=WINDOW), [S, S]),
    "gpt2": ({}, [F, F]),  # absolute position embeddings, Conv1D projections: nothing kvtrace knows of
    "gpt_oss": (dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]), [S, F]),  # sinks, MoE
}
assert set(FAMILY_ARCHS) <= set(MODELS)


def make(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """conftest's tiny model; Qwen3 with a window, GPT-2 and GPT-OSS, which tiny_model does not build, built alike here."""
    if arch not in ("gpt2", "qwen3", "gpt_oss"):
        return tiny_model(arch, dtype, **MODELS[arch][0])
    import transformers as tf

    if arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=512, bos_token_id=1,
                            eos_token_id=2)
        cls = tf.GPT2LMHeadModel
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**TINY, head_dim=16, **MODELS[arch][0]), tf.Qwen3ForCausalLM
    else:
        cfg = tf.GptOssConfig(**TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, **MODELS[arch][0])
        cls = tf.GptOssForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)  # decisive greedy picks, as conftest's tiny models
        if arch == "gpt_oss":
            model.get_output_embeddings().weight.mul_(20)
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()  # initialised to 0; sinks that matter
    return model.to(dtype)


def _assert_slots(arch: str, art: Any) -> None:
    """Ring buffers are ``window`` slots, in the CacheSpec and in every program's signature."""
    kinds = MODELS[arch][1]
    spec = art.cache_spec
    assert [x.kind for x in spec.layers] == kinds and spec.max_seq_len == MAX_SEQ_LEN
    slots = [WINDOW if k is S else MAX_SEQ_LEN for k in kinds]
    assert [b.shape[2] for b in spec.buffers()] == [s for s in slots for _ in "kv"]
    for name, signature in art.manifest.signatures.items():
        assert [i["shape"][2] for i in signature[-2 * len(kinds):]] == [s for s in slots for _ in "kv"], name


def _assert_exact(model: torch.nn.Module, art: Any, name: str, arch: str) -> dict[str, float]:
    return assert_exact_beyond_window(model, art, name, PROMPTS, STEPS, WINDOW, MODELS[arch][1], kv_limit=1e-4,
                                      logits_limit=float("inf"))


@pytest.mark.parametrize("arch", list(MODELS))
def test_general_decoder_exports_and_matches_eager_beyond_twice_the_window(arch, tmp_path):
    model = make(arch)
    dec = HFDecoder(model, max_seq_len=MAX_SEQ_LEN)
    assert [x.kind for x in dec.cache_spec.layers] == MODELS[arch][1]
    kvtrace.export(dec, tmp_path / "m.kvt", backend="exported")
    art = kvtrace.load(tmp_path / "m.kvt")
    _assert_slots(arch, art)
    err = _assert_exact(model, art, "exported", arch)
    assert err["logits"] <= 1e-4, err


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2"])  # families no fast decoder claims: kvtrace.export(model)
def test_export_of_the_hf_model_goes_the_general_way_and_matches_eager(arch, tmp_path):
    model = make(arch)
    kvtrace.export(model, tmp_path / "m.kvt", max_seq_len=MAX_SEQ_LEN, backend="exported")
    art = kvtrace.load(tmp_path / "m.kvt")
    _assert_slots(arch, art)
    assert set(art.manifest.programs) == {"prefill", "decode"}
    _assert_exact(model, art, "exported", arch)


def test_bf16_hybrid_passes_with_the_fp32_reference(tmp_path):
    low = make("gemma3_text", torch.bfloat16)
    high = copy.deepcopy(low).float()
    kvtrace.export(HFDecoder(low, max_seq_len=MAX_SEQ_LEN), tmp_path / "m.kvt", backend="exported")
    art = kvtrace.load(tmp_path / "m.kvt")
    assert art.cache_spec.dtype == "bfloat16"
    _assert_slots("gemma3_text", art)
    report = verify(EagerRunner(low), [SessionRunner(art.session(), "exported")], PROMPTS, steps=STEPS,
                    dtype=torch.bfloat16, fp32=EagerRunner(high, "fp32"))
    assert report.passed, [f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    assert len(report.rows) == len(PROMPTS) * (1 + STEPS)


@pytest.mark.compile
def test_aoti_hybrid_matches_eager_beyond_twice_the_window(tmp_path):
    model = make("gemma3_text")
    kvtrace.export(HFDecoder(model, max_seq_len=MAX_SEQ_LEN), tmp_path / "m.kvt", backend="aoti")
    art = kvtrace.load(tmp_path / "m.kvt")
    _assert_slots("gemma3_text", art)
    _assert_exact(model, art, "aoti", "gemma3_text")


# --- the live prefix ----------------------------------------------------------------------------------
def test_live_prefix_equals_attention_over_every_slot():
    """forward_live (full layers read slots [0, L) only) agrees with forward at every position up to the last
    slot, on a hybrid model whose ring layer is read the same way either way."""
    model = make("gemma2")
    dec = HFDecoder(model, max_seq_len=20)
    assert [(p.method, p.key_pos) for p in dec.programs] == [("forward_live", True)] * 2
    a_state, b_state = dec.cache_spec.allocate(), dec.cache_spec.allocate()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])  # longer than the window
    with torch.no_grad():
        a = dec(ids, torch.arange(11), *a_state)
        b = dec.forward_live(ids, torch.arange(11), torch.arange(11), *b_state)
        assert close(b, a, TOL)[0]
        for pos in range(11, 20):
            tok = a[:, -1:].argmax(-1)
            a = dec(tok, torch.tensor([pos]), *a_state)
            b = dec.forward_live(tok, torch.tensor([pos]), torch.arange(pos + 1), *b_state)
            ok, diff, limit = close(b, a, TOL)
            assert ok, (pos, diff, limit)


def test_rings_only_attend_over_their_ring():
    dec = HFDecoder(make("mistral"), max_seq_len=MAX_SEQ_LEN)
    assert [p.method for p in dec.programs] == ["forward", "forward"]  # no full layer: no live prefix to read


# --- the caller's model ------------------------------------------------------------------------------
def _snapshot(model: torch.nn.Module) -> dict[str, Any]:
    return {
        "modules": [(n, id(m), sorted(vars(m))) for n, m in model.named_modules()],
        "tensors": {n: (id(t), t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()},
        "config": model.config.to_json_string(use_diff=False),
        "attn": (model.config._attn_implementation, id(model.config)),
    }


def _assert_same(before: dict[str, Any], model: torch.nn.Module) -> None:
    after = _snapshot(model)
    assert after["modules"] == before["modules"] and after["config"] == before["config"]
    assert after["attn"] == before["attn"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for n, (i, t) in before["tensors"].items():
        assert after["tensors"][n][0] == i and torch.equal(after["tensors"][n][1], t), n


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_neox"])
def test_the_callers_model_is_unchanged_before_during_and_after(arch, tmp_path, monkeypatch):
    model, twin = make(arch), make(arch)
    attn = model.config._attn_implementation
    assert attn != hf_attention.IMPLEMENTATION
    before = _snapshot(model)
    dec = HFDecoder(model, max_seq_len=MAX_SEQ_LEN)
    _assert_same(before, model)
    assert dec.model is not model and dec.model.config._attn_implementation == hf_attention.IMPLEMENTATION
    assert all(p is q for p, q in zip(dec.model.parameters(), model.parameters(), strict=True))  # shared, not copied
    seen: list[str] = []
    real = hf_attention.attention

    def failing(module, *args, **kwargs):  # during the trace: the caller's config still says its own attention
        seen.append(model.config._attn_implementation)
        real(module, *args, **kwargs)
        raise RuntimeError("injected failure inside attention")

    from transformers import AttentionInterface

    monkeypatch.setattr(hf_attention, "attention", failing)  # what a new HFDecoder registers ...
    monkeypatch.setitem(AttentionInterface._global_mapping, hf_attention.IMPLEMENTATION, failing)  # ... and is registered
    # exported as the general decoder (a faster family, e.g. GemmaDecoder, would otherwise take the model)
    with pytest.raises(CaptureError, match="injected failure inside attention"):
        kvtrace.export(HFDecoder(model, max_seq_len=MAX_SEQ_LEN), tmp_path / "bad.kvt", backend="exported")
    assert seen and set(seen) == {attn}
    _assert_same(before, model)
    monkeypatch.undo()
    kvtrace.export(HFDecoder(model, max_seq_len=MAX_SEQ_LEN), tmp_path / "m.kvt", backend="exported")
    _assert_same(before, model)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():  # and it still runs eagerly exactly as an untouched twin
        assert torch.equal(model(input_ids=ids).logits, twin(input_ids=ids).logits)


def test_kv_heads_of_a_config_without_grouped_query_attention():
    """GPT-NeoX has no num_key_value_heads field: a stray kwarg of that name (as conftest's TINY passes) is not GQA."""
    from kvtrace.spec import config as hfconfig

    assert hfconfig.kv_heads(make("gpt_neox").config) == TINY["num_attention_heads"]
    assert hfconfig.kv_heads(make("olmo2").config) == TINY["num_key_value_heads"]


# --- refusals -------------------------------------------------------------------------------------------
def test_a_layer_type_kvtrace_does_not_declare_is_refused_naming_it():
    import transformers as tf

    cfg = tf.Llama4TextConfig(num_hidden_layers=4, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16, intermediate_size=32, intermediate_size_mlp=32, vocab_size=32)
    assert "chunked_attention" in cfg.layer_types
    with pytest.raises(UnsupportedError, match=r"'llama4_text' is not supported for export: its layer_types hold "
                                               r"'chunked_attention' \(layers \[0, 1, 2\]\)") as e:
        family_for(cfg)
    assert "\n" not in str(e.value)
    model = make("gemma2")
    model.config.layer_types = ["sliding_attention", "linear_attention"]
    with pytest.raises(UnsupportedError, match=r"cannot be exported: its layer_types hold 'linear_attention' \(layers \[1\]\)"):
        HFDecoder(model, max_seq_len=MAX_SEQ_LEN)
    with pytest.raises(UnsupportedError, match="'linear_attention'"):
        make_decoder(model, max_seq_len=MAX_SEQ_LEN)


def test_models_that_are_not_decoder_only_or_bypass_the_attention_interface_are_refused():
    import transformers as tf

    t5 = tf.T5Config(num_layers=1, d_model=16, d_kv=8, num_heads=2, d_ff=32, vocab_size=32)
    assert "encoder-decoder" in refusal(t5)
    with pytest.raises(UnsupportedError, match="'t5' is not supported for export: it is an encoder-decoder model"):
        family_for(t5)
    bloom = tf.BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=32)
    with pytest.raises(UnsupportedError, match="BloomForCausalLM's attention does not go through transformers' "
                                               "attention interface"):
        HFDecoder(tf.BloomForCausalLM(bloom).eval(), max_seq_len=8)
    assert refusal(make("gemma3_text").config) is None


def test_a_layer_that_attends_outside_the_interface_is_refused(monkeypatch):
    """A model whose attention skipped kvtrace's function for some layer fails the call, naming the layer."""
    model = make("olmo2")
    dec = HFDecoder(model, max_seq_len=16)
    layer = dec.model.model.layers[1].self_attn
    real = hf_attention.attention

    def eager_for_layer_1(module, *args, **kwargs):
        if module is layer:  # as if this layer computed attention by itself
            from transformers.models.olmo2.modeling_olmo2 import eager_attention_forward

            return eager_attention_forward(module, *args[:3], None, scaling=kwargs["scaling"])
        return real(module, *args, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, hf_attention.IMPLEMENTATION, eager_for_layer_1)
    with pytest.raises(UnsupportedError, match=r"layer\(s\) \[1\] attended without transformers' attention interface"):
        dec(torch.tensor([[5, 6, 7]]), torch.arange(3), *dec.cache_spec.allocate())
