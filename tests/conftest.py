"""Shared fixtures: tiny random-weight HF decoders (no downloads), one per supported architecture."""

from __future__ import annotations

import json
from pathlib import Path

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

# More HF decoder families (issue #15), each with what sets it apart switched on: Gemma's scaled embeddings
# and (1 + w) norms, Gemma 2's soft-capping and local/global layers, Gemma 3's q/k norms and per-layer-type
# RoPE, SmolLM3's layers without RoPE, Granite's multipliers, OLMo2's post-norms and q/k norms, GPT-NeoX's
# parallel residual and partial rotary. name -> (config class, model class, config defaults).
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILY_ARCHS = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, **_TOKENS)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"], **_TOKENS)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                         rope_local_base_freq=10000.0, **_TOKENS)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, **_TOKENS)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                     logits_scaling=0.125, tie_word_embeddings=False, **_TOKENS)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(**_TOKENS)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25, use_parallel_residual=True, **_TOKENS)),
}


# The default suite (``make check``, the first stage of ``make test``) runs every test that neither loads the real
# model (``slow``) nor compiles (``compile``), plus these compile tests, one per compiled path: the seed scenario
# through the Inductor jit, a jit trust check, an AOTI artifact step by step, aoti-packed, an ExecuTorch .pte, a
# GGUF-native quantized artifact. (The vision decoder through Inductor moved to the second stage in stop 51, to keep
# the default suite under 15 minutes: its exported artifact is verified in the first.) Every other compile test runs in
# ``make test``'s second stage, with the real-model tests (CI runs both stages).
ESSENTIAL = (
    "tests/runtime/test_jit.py::test_seed_scenario[inductor]",
    "tests/runtime/test_jit_trust.py::test_branch_on_symbolic_cache_length_is_checked_every_call_inductor",
    "tests/artifact/test_export.py::test_logits_and_cache_match_eager_step_by_step[llama-aoti]",
    "tests/artifact/test_export.py::test_aoti_packed_matches_eager_with_one_program_holding_the_weights[float32-all]",
    "tests/backends/test_executorch.py::test_llama_pte_verifies_logits_and_every_cache_layer",
    "tests/backends/test_executorch.py::test_loading_needs_no_transformers_no_torch_export_deserialization_and_no_"
    "compiler",
    "tests/models/test_quant.py::test_compiled_quantized_artifacts_verify[gguf-aoti]",
)


# Family matrices the default suite runs in a few representative forms (each kept one covers a distinct code path:
# a hybrid cache, attention sinks, learned positions, a partial rotary, a sliding layer); these other forms run in
# ``make test``'s second stage (CI), to keep the default suite under 15 minutes on 2 cores.
VARIANTS = (
    *(f"tests/models/test_hf_generic.py::test_general_decoder_exports_and_matches_eager_beyond_twice_the_window[{f}]"
      for f in ("gemma", "gemma3_text", "smollm3", "granite", "olmo2", "gpt_neox", "phi3", "mistral", "qwen3")),
    *(f"tests/models/test_llama_families.py::test_exported_family_matches_eager_logits_and_every_cache_layer[{f}]"
      for f in ("qwen3", "smollm3", "granite", "olmo2", "phi3", "phi3-longrope")),
    *(f"tests/models/test_int8_families.py::test_int8_cache_on_every_path_matches_the_same_decoder_eager[{f}]"
      for f in ("gemma2", "gpt_neox")),
    "tests/tools/test_lint.py::test_lint_reports_nothing_for_the_real_adapters[mistral]",
    "tests/tools/test_lint.py::test_lint_reports_nothing_for_the_real_adapters[qwen2]",
    "tests/tools/test_lint.py::test_real_adapters_capture_once_per_size_class_with_no_length_baked_in[mistral]",
    "tests/tools/test_lint.py::test_lint_reports_a_planted_length[branch-on-length]",
    # all three (stop 51: gemma2 too); test_a_jit_that_keys_no_regime_is_flagged stays in the default suite
    *(f"tests/tools/test_lint_sliding.py::test_crossing_and_wrapping_the_window_is_clean_with_one_program_per_regime[{f}]"
      for f in ("mistral", "qwen2", "gemma2")),
    # slots artifacts: Gemma 2's hybrid ring + full cache stays in the default suite (and the schedule fuzz's int8 one)
    *(f"tests/runtime/test_slots.py::test_slots_artifacts_of_sliding_int8_and_other_families_answer_as_solo_runs[{f}]"
      for f in ("mistral-sliding-int8", "hf-gpt_neox")),
    "tests/models/test_quant.py::test_a_gguf_native_slots_artifact_answers_as_solo_runs",  # the rows path: unit-tested
    # the schedule fuzz over Llama's full layers (the hybrid int8 cache's stays: rings, int8 and prefix reuse)
    "tests/runtime/test_slots.py::test_random_schedules_answer_as_solo_runs[exported]",
    "tests/serve/test_serve_bench.py::test_serve_bench_measures_levels_and_checks_answers",  # a bench's plumbing
)


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect: ``-m essential`` must see the marker
def pytest_collection_modifyitems(config, items):
    """``essential`` on the ESSENTIAL compile tests and ``variant`` on the VARIANTS (a listed test that no longer
    exists is an error, so neither list goes stale silently); tests marked ``cuda`` run only where torch sees a
    GPU, elsewhere they are skipped, saying why."""
    ids = {item.nodeid: item for item in items}
    files = {item.nodeid.split("::")[0] for item in items}
    picked = any("::" in a for a in config.args)  # a picked subset: listed tests may be absent
    for listed, marker in (("ESSENTIAL", "essential"), ("VARIANTS", "variant")):
        for nodeid in globals()[listed]:
            if nodeid in ids:
                item = ids[nodeid]
                if marker == "essential" and item.get_closest_marker("compile") is None:
                    raise pytest.UsageError(f"ESSENTIAL lists {nodeid}, which is not marked compile: take it off the list")
                item.add_marker(getattr(pytest.mark, marker))
            elif nodeid.split("::")[0] in files and not picked:
                raise pytest.UsageError(f"{listed} lists {nodeid}, which its file no longer has: update tests/conftest.py")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
                                   "(bench/gpu.sh runs the GPU checks on one)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def tiny_model(arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A tiny random-weight causal LM of the given HF architecture, eval mode, no grads."""
    import transformers as tf

    cfg_kwargs = {**TINY, **overrides}
    if arch == "llama":
        cfg = tf.LlamaConfig(**cfg_kwargs)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**{"use_sliding_window": False, **cfg_kwargs})
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**{"head_dim": 16, "use_sliding_window": False, **cfg_kwargs})
        cls = tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**{"sliding_window": None, **cfg_kwargs})
        cls = tf.MistralForCausalLM
    elif arch == "phi3":
        cfg = tf.Phi3Config(**{"sliding_window": None, **cfg_kwargs}, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = tf.Phi3ForCausalLM
    elif arch in FAMILY_ARCHS:
        config_cls, model_cls, defaults = FAMILY_ARCHS[arch]
        cfg = getattr(tf, config_cls)(**{**defaults, **cfg_kwargs})
        cls = getattr(tf, model_cls)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval().requires_grad_(False)
    # Random init leaves logits tiny and near-uniform; scale embeddings up so greedy picks are decisive.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)
        head = model.get_output_embeddings().weight
        if arch in FAMILY_ARCHS and head.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            head.mul_(20)  # untied heads too (OLMo2, GPT-NeoX), and Granite divides by logits_scaling
    return model.to(dtype)


# Phi-3 with LongRoPE (Phi-3-mini-128k style): short factors up to position 16, long factors past it.
# HF's rotary layer computes long_inv_freq on its first forward and stores it as a plain attribute.
LONGROPE_ORIGINAL = 16


def tiny_phi3_longrope(dtype: torch.dtype = torch.float32, seed: int = 0):
    """A freshly built tiny Phi-3 with ``rope_type="longrope"`` (never called: long_inv_freq not yet set)."""
    half = TINY["hidden_size"] // TINY["num_attention_heads"] // 2  # one factor per rotary frequency
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [1.5 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": LONGROPE_ORIGINAL}
    # transformers 5 overwrites rope_parameters' original_max_position_embeddings with the config's own
    # (default 4096, so the switch would never be reached): set it at the top level too
    return tiny_model("phi3", dtype, seed, rope_parameters=rope, max_position_embeddings=64,
                      original_max_position_embeddings=LONGROPE_ORIGINAL)


@pytest.fixture
def llama():
    return tiny_model("llama")


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "the", "cat", "sat"]


def make_tiny_hf_dir(d: Path, *, max_position_embeddings: int = 64, model=None, words_only: bool = False):
    """Save a tiny random Llama (or ``model``) + WordLevel tokenizer.json + ChatML template in ``d``;
    return the model. ``words_only``: the model never picks a special token (<unk>, <s>, </s>: their
    output rows zeroed, their logits 0 below the words' maximum), so greedy answers are words that
    decode and re-encode to the same ids, and run to max_new_tokens."""
    import tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(d / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHATML,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(tok_config))
    if model is None:
        torch.manual_seed(0)
        config = LlamaConfig(**{**TINY, "vocab_size": len(WORDS), "max_position_embeddings": max_position_embeddings},
                             bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(config).eval()
        if words_only:
            with torch.no_grad():
                model.lm_head.weight[:3] = 0.0
                model.lm_head.weight[3:] *= 20  # decisive word logits
    model.save_pretrained(d)
    return model


BYTE_CORPUS = ['{"name": "cat", "age": 3}', '{"name": "hello world", "tags": ["a", "b"]}', "the cat sat on the mat 123",
               '{"ok": true, "n": null, "x": -1.5e3}']
BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2


def byte_tokenizer():
    """A byte-level BPE as real LLM tokenizers are (every byte a token, plus merges such as '{"' and 'name'), so
    any text, JSON included, can be spelled: what structured output needs (``runtime.grammar``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(BYTE_CORPUS * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=BYTE_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def make_byte_hf_dir(d: Path, *, max_position_embeddings: int = 256):
    """A tiny random Llama over ``byte_tokenizer`` (eos <|im_end|> = 2, ChatML template) saved in ``d``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "unk_token": None, "chat_template": CHATML}))
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": max_position_embeddings},
                         bos_token_id=None, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(d)
    return model


# --- Llama 3.2 Vision text decoder (MllamaForCausalLM): self- and cross-attention layers --------
MLLAMA_CROSS_LAYERS = (1, 3)
IMAGE_TOKENS = 6  # N: image tokens the cross-attention layers attend to


def tiny_mllama(dtype: torch.dtype = torch.float32, seed: int = 0):
    """A tiny random MllamaForCausalLM: 4 layers, cross-attention at layers 1 and 3.

    HF initialises the tanh gates of cross-attention layers to 0 (the image contributes nothing);
    they are set to non-zero values here so that image features visibly change the logits.
    """
    import transformers as tf

    cfg = tf.MllamaTextConfig(**{**TINY, "num_hidden_layers": 4}, cross_attention_layers=list(MLLAMA_CROSS_LAYERS),
                              rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = tf.MllamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)
        for i in MLLAMA_CROSS_LAYERS:
            layer = model.model.layers[i]
            layer.cross_attn_attn_gate.fill_(0.9)
            layer.cross_attn_mlp_gate.fill_(-0.7)
            layer.cross_attn.k_proj.weight.mul_(10)  # sharper attention over the image tokens
    return model.to(dtype)


def image_features(batch: int = 1, n: int = IMAGE_TOKENS, dim: int = TINY["hidden_size"], seed: int = 1,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Projected image features ``cross_attention_states [B, N, dim]`` (what the vision tower would emit)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, n, dim, generator=g) * 4).to(dtype)


def sigint_state() -> tuple[bool, bool]:
    """(ignored, blocked) of SIGINT in this process as the kernel holds them (``/proc/self/status``), which is what a
    child inherits; ``signal.getsignal`` shows only what Python set, not what a C library did."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    bit = 1 << (2 - 1)  # SIGINT
    return bool(int(fields["SigIgn"], 16) & bit), bool(int(fields["SigBlk"], 16) & bit)


def terminal_signals() -> None:
    """``preexec_fn`` for a child standing for a program started from a shell: SIGINT at its default disposition and
    unblocked. A child inherits an ignored or blocked SIGINT, and Python then never raises KeyboardInterrupt in it:
    the Ctrl-C tests (tiered, chat) timed out that way in full runs of the suite (stops 39, 42) and passed alone."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


_SIGINT_AT_START = sigint_state() if Path("/proc/self/status").exists() else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Name the test after which SIGINT is ignored or blocked in this worker (a warning in the summary, not a failure):
    whatever did it would leave a user's Ctrl-C dead in the processes they start."""
    if _SIGINT_AT_START is None:
        return
    now = sigint_state()
    if now != _SIGINT_AT_START and not getattr(item.config, "_kvtrace_sigint_warned", False):
        item.config._kvtrace_sigint_warned = True
        item.warn(pytest.PytestWarning(f"SIGINT (ignored, blocked) went from {_SIGINT_AT_START} to {now} in this "
                                       "process during or before this test; children inherit that"))
