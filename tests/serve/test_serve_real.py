"""The real model (SmolLM2-135M-Instruct) in conversation slots: every greedy answer equals a solo Session run,
with requests of different lengths joining mid-stream (real weights: near-tied logits are where a batched
matmul's rounding could show)."""

from __future__ import annotations

import pytest
from tests.runtime.test_slots import assert_free_rows_hold_their_tokens, run_staggered

import kvtrace
from kvtrace.runtime.generate import generate
from kvtrace.runtime.slots import SlotRequest
from kvtrace.sources.chat import encode_prompt

pytestmark = pytest.mark.slow

QUESTIONS = ("Who's the founder of Meta?", "Why is the sky blue?", "Write a haiku about the sea.",
             "List three uses of a hash map.", "What is 12 times 7?", "Name a famous painting.")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("real_slots")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTRACE_CACHE", str(d / "cache"))
        kvtrace.export("smollm2-135m-instruct", d / "solo.kvt", max_seq_len=256, prefill_logits="last")
        kvtrace.export("smollm2-135m-instruct", d / "slots.kvt", max_seq_len=256, slots=4, prefill_logits="last")
    return kvtrace.load(d / "solo.kvt"), kvtrace.load(d / "slots.kvt")


def test_real_model_slots_equal_solo_runs(artifacts):
    solo, art = artifacts
    tok, m = art.tokenizer(), art.manifest
    prompts = [encode_prompt(tok, q, chat=True, template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids)
               for q in QUESTIONS]
    maxes = [40, 24, 32, 16, 28, 36]
    reqs = [SlotRequest(p, max_tokens=n, stop_ids=m.eos_ids) for p, n in zip(prompts, maxes, strict=True)]
    engine = art.slot_engine()
    out = run_staggered(engine, reqs, join_every=3)
    for i, (p, n) in enumerate(zip(prompts, maxes, strict=True)):
        assert out[i] == generate(solo.session(), p, max_new_tokens=n, eos_ids=m.eos_ids).tokens, QUESTIONS[i]
    assert_free_rows_hold_their_tokens(engine, solo)  # the prompts share the system prompt: rows were reused
