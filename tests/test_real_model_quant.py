"""Quantized weights on the embedded real model (SmolLM2-135M-Instruct, a Q4_1 GGUF with a Q8_0 embedding).

GGUF-native: its own blocks kept as stored, compiled with AOTInductor, verified step by step against eager over
the dequantized GGUF weights (float32 tolerance) and its 128 greedy tokens equal theirs; int4: verified against
the same int4 weights eager. Marked slow (each compiles the real model: minutes on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

import kvtrace
from kvtrace.tools.runners import EagerRunner, SessionRunner
from kvtrace.tools.verify import render
from kvtrace.tools.verify_kv import verify_by_cache

pytestmark = [pytest.mark.slow, pytest.mark.compile]

QUESTION = "Who's the founder of Meta?"
FP32_WEIGHT_BYTES = 134_515_008 * 4  # SmolLM2-135M's parameters (tied embedding once) in float32


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from kvtrace.sources.load import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTRACE_CACHE", str(tmp_path_factory.mktemp("kvtrace_cache")))
        yield load_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def prompts(smol):
    from kvtrace.sources.chat import encode_prompt

    first = encode_prompt(smol.tokenizer, QUESTION, chat=True, template=smol.chat_template, bos_id=smol.bos_id,
                          eos_ids=smol.eos_ids)
    return [first, smol.tokenizer.encode("The capital of France is").ids]


def _check(smol, prompts, art, name: str, steps: int):
    report = verify_by_cache(smol.model, EagerRunner(smol.model), [SessionRunner(art.session(), name)], prompts,
                             steps=steps)
    from rich.console import Console

    Console(width=180).print(render(report))
    assert report.passed, report.summary()
    return report


def test_gguf_native_q4_1_aoti_computes_with_the_gguf_numbers(smol, prompts, tmp_path):
    path = kvtrace.export("smollm2-135m-instruct", tmp_path / "gguf.kvt", max_seq_len=256, backend="aoti",
                          quant="gguf", prefill_logits="last")
    art = kvtrace.load(path)
    q = art.manifest.quant
    assert set(q.tensors.values()) == {"q4_1", "q8_0", "tied:tok_embeddings"} and not q.dequantized
    assert len([f for f in q.tensors.values() if f == "q4_1"]) == 30 * 4  # every layer's four fused matmuls
    report = _check(smol, prompts, art, "aoti-gguf", steps=16)
    assert report.tolerance["atol"] == "0.0001"  # float32: the same numbers as eager over the dequantized GGUF
    # 128 greedy tokens, free-running, equal eager's over the dequantized weights
    from transformers import DynamicCache

    from kvtrace.runtime.generate import generate

    ids = torch.tensor([prompts[0]])
    got = generate(art.session(), ids, max_new_tokens=128, eos_ids=()).tokens
    ref, cur, cache = [], ids, DynamicCache()
    with torch.inference_mode():
        for _ in range(128):
            logits = smol.model(input_ids=cur, past_key_values=cache, use_cache=True).logits
            cur = logits[:, -1:].argmax(-1)
            ref.append(int(cur))
    assert list(got) == ref
    assert path.stat().st_size <= 0.35 * FP32_WEIGHT_BYTES  # 1 byte per 4-bit value (unpacked) + float16 d, m


@pytest.mark.parametrize("backend", ["aoti", "aoti-packed"])
def test_int4_verifies_against_the_same_int4_weights(smol, prompts, tmp_path, backend):
    """aoti: torch's int4 kernel; aoti-packed: Inductor's int4 GEMM template (``models.quant.template_ops``), which
    dequantizes to bf16 blocks, on a step program and a one-token decode program of its own."""
    path = kvtrace.export("smollm2-135m-instruct", tmp_path / "int4.kvt", max_seq_len=256, backend=backend,
                          quant="int4", prefill_logits="last")
    art = kvtrace.load(path)
    report = _check(smol, prompts, art, f"{backend}-int4", steps=8)
    (s,) = report.summary()
    assert s["reference"] == "decoder-eager-int4-g32"
    if backend == "aoti":
        assert path.stat().st_size <= 0.2 * FP32_WEIGHT_BYTES  # 4-bit linears + bf16 scales/zeros + an int8 head
    else:
        assert art.manifest.programs["decode"].served_by is None and set(art.manifest.signatures) == {"step", "decode"}
