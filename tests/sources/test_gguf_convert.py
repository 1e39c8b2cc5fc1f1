"""The fast GGUF conversion (kvtrace.sources.gguf_convert, used by sources.load) against transformers' own:
the cached checkpoint holds bit-identical weights, the same config, generation config, tokenizer and
special ids."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import write_gguf
from kvtrace.sources import gguf as _gguf
from kvtrace.sources.load import _tok_meta, load_model
from kvtrace.sources.resolve import resolve_source
from kvtrace.sources.store import cache_dir


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))


def _transformers_conversion(path):
    """What the conversion wrote before: transformers' from_pretrained(gguf_file=...) and AutoTokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    state, seen = {}, set()
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            state[k] = v
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(architectures=[type(model).__name__], dtype="float32")
    return (state, json.loads(json.dumps(config)), model.generation_config.to_dict(), tok.backend_tokenizer.to_str(),
            _tok_meta(tok, model.config, model.generation_config))


def _kvtrace_conversion(path):
    lm = load_model(path)
    assert not lm.cache_hit
    entry = cache_dir() / "models" / lm.source.digest
    meta = json.loads((entry / "kvtrace.json").read_text())
    from transformers import GenerationConfig

    return (load_file(entry / "model.safetensors"), json.loads((entry / "config.json").read_text()),
            GenerationConfig.from_pretrained(entry).to_dict(), (entry / "tokenizer.json").read_text(),
            {k: meta[k] for k in ("chat_template", "bos_id", "eos_ids")})


def _assert_same(path):
    (s0, c0, g0, t0, m0), (s1, c1, g1, t1, m1) = _transformers_conversion(path), _kvtrace_conversion(path)
    assert sorted(s0) == sorted(s1)
    for name in s0:
        assert s0[name].dtype == s1[name].dtype and torch.equal(s0[name], s1[name]), name  # bit-identical
    assert c1 == c0
    assert g1 == g0
    assert json.loads(t1) == json.loads(t0)
    assert m1 == m0


@pytest.mark.parametrize("arch", [a for a in _gguf.SUPPORTED_GGUF_ARCHS if a != "mistral"])
def test_the_conversion_is_transformers_own_bit_for_bit(arch, tmp_path):
    _assert_same(write_gguf(tmp_path / f"{arch}.gguf", arch))


@pytest.mark.slow
def test_the_default_models_conversion_is_transformers_own_bit_for_bit():
    _assert_same(resolve_source(None).path)  # Q4_1, Q8_0 and F32 tensors


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_torch_dequantization_is_ggufs_bit_for_bit(name):
    import gguf
    import numpy as np

    from kvtrace.sources.gguf_convert import _dequantize

    qtype = gguf.GGMLQuantizationType[name]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(7, 3 * nbytes), dtype=np.uint8)  # 7 rows of 3 blocks
    scales = rng.standard_normal((7, 3, 2)).astype(np.float16).view(np.uint8)  # finite scales (d, m)
    blocks = raw.reshape(7, 3, nbytes)
    blocks[:, :, :4 if name == "Q4_1" else 2] = scales.reshape(7, 3, 4)[:, :, : 4 if name == "Q4_1" else 2]
    ours, theirs = _dequantize(raw, qtype), gguf.dequantize(raw, qtype)
    assert ours.shape == theirs.shape == (7, 3 * block) and ours.dtype == theirs.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
