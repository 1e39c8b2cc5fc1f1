"""kvtrace.jit is never silently wrong: trace-unsafe models match eager at every length, or are refused.

Each model below is the tiny Llama with one thing a trace can get wrong: a Python branch on the cache length
or on the new-token count, a Python int read from a position tensor, a length kept on ``self``. A generation
(an 8-token prompt, then 12 single-token decodes, crossing each branch's threshold) runs through
``kvtrace.jit`` and, call by call, through eager on its own cache: logits and the caller's cache must match
eager's after every call, or the call raises a one-line ``KvtraceError`` that names the model's line and
leaves the caller's cache as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from test_jit import assert_caches_close, greedy, kv, ones, tokens
from transformers import DynamicCache

import kvtrace
import kvtrace.runtime.jit
from conftest import TINY, tiny_model
from helpers import BakedLength, BranchOnLength, assert_close

BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.compile)]
PROMPT, DECODES = 8, 12  # cache lengths 8 .. 19 at the decodes: every threshold below is crossed
SELF = "test_jit_trust.py"


class BranchOnCacheLength(tf.LlamaForCausalLM):
    """(a) Reads the cache length into a Python int and branches on it (the reproduced bug of #12)."""

    def forward(self, input_ids=None, cache=None, **kwargs):
        past = int(cache.get_seq_length()) if cache is not None else 0
        out = super().forward(input_ids=input_ids, cache=cache, **kwargs)
        if past > 10:
            out.logits = out.logits + 1
        return out


class BranchOnSymbolicCacheLength(tf.LlamaForCausalLM):
    """(a') Branches on the cache length without int(): a guard the trace records, so it can be checked."""

    def forward(self, input_ids=None, cache=None, **kwargs):
        past = cache.get_seq_length() if cache is not None else 0
        out = super().forward(input_ids=input_ids, cache=cache, **kwargs)
        if past > 10:
            out.logits = out.logits + 1
        return out


class IntOfPosition(tf.LlamaForCausalLM):
    """(c) Reads the first position into a Python int and branches on it."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if int(kwargs["cache_position"][0]) > 10:
            out.logits = out.logits + 1
        return out


class ItemOfPosition(tf.LlamaForCausalLM):
    """(c') The same with .item(), the comparison used as a number instead of an if."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        start = kwargs["cache_position"][0].item()
        out.logits = out.logits + 0.5 * (start > 10)
        return out


class RemembersLength(tf.LlamaForCausalLM):
    """(d) Keeps the number of tokens seen on self during forward and uses it on the next call."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        self.seen = getattr(self, "seen", 0) + input_ids.shape[1]
        out.logits = out.logits + self.seen
        return out


class OneTokenFastPath(tf.LlamaForCausalLM):
    """(e) A separate path for one new token (``if T == 1``). torch.export traces every size as >= 2 and records
    no guard for this branch, so a program traced at T = 3 would take the T > 1 path for decodes."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if input_ids.shape[1] == 1:
            out.logits = out.logits - 3
        return out


class SinglePastTokenPath(tf.LlamaForCausalLM):
    """(e') Likewise for a cache holding exactly one token (``if P == 1``)."""

    def forward(self, input_ids=None, cache=None, **kwargs):
        out = super().forward(input_ids=input_ids, cache=cache, **kwargs)
        if cache is not None and cache.get_seq_length() - input_ids.shape[1] == 1:
            out.logits = out.logits * 0.5
        return out


def planted(cls: type) -> torch.nn.Module:
    torch.manual_seed(0)
    model = cls(tf.LlamaConfig(**TINY)).eval().requires_grad_(False)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20)  # decisive greedy picks, as conftest.tiny_model
    return model


def generation(model: torch.nn.Module, backend: str, positions: bool = False) -> tuple[Any, Exception | None, int]:
    """Prefill PROMPT tokens, then DECODES greedy steps, through jit and eager (own caches), compared each call.

    Returns (the jitted model, the KvtraceError a call raised or None, the number of calls that completed).
    A raising call must leave the caller's cache exactly as it was.
    """
    jm = kvtrace.jit(model, backend=backend)
    jc, ec = DynamicCache(), DynamicCache()
    ids = tokens(1, PROMPT)
    for i in range(1 + DECODES):
        past = ec.get_seq_length()
        kw: dict[str, Any] = dict(input_ids=ids, attention_mask=ones(1, past + ids.shape[1]))
        if positions:
            kw["cache_position"] = torch.arange(past, past + ids.shape[1])
        before = kv(jc)
        copies = [t.clone() for t in before]
        try:
            jo = jm(cache=jc, **kw)
        except kvtrace.KvtraceError as e:
            assert "\n" not in str(e), f"not one line: {e}"
            assert jc.get_seq_length() == past
            assert all(a is b and torch.equal(a, c) for a, b, c in zip(kv(jc), before, copies, strict=True))
            return jm, e, i
        eo = model(cache=ec, **kw)
        assert jo.past_key_values is jc
        assert_close(jo.logits, eo.logits, torch.float32, f"logits, call {i} (P = {past})")
        assert_caches_close(jc, ec, torch.float32)
        ids = greedy(eo.logits)
    return jm, None, 1 + DECODES


# --- the ordinary model: two programs, nothing specialised --------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_ordinary_llama_captures_two_programs_and_no_specialization(backend):
    jm, err, calls = generation(tiny_model("llama"), backend)
    assert err is None and calls == 1 + DECODES
    assert jm.stats.captures == 2 and jm.stats.specializations == []


# --- (a) the cache length -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_int_of_cache_length_is_refused_at_capture(backend):
    jm, err, calls = generation(planted(BranchOnCacheLength), backend)
    assert isinstance(err, kvtrace.CaptureError) and calls == 1, "must refuse the first decode, not run it"
    msg = str(err)
    assert "past length P" in msg and "constant 5" in msg
    assert f"{SELF}:" in msg and "past = int(cache.get_seq_length())" in msg
    assert jm.stats.captures == 1  # the prefill program; nothing was captured for the decode


def test_branch_on_symbolic_cache_length_is_checked_every_call_eager():
    jm, err, _ = generation(planted(BranchOnSymbolicCacheLength), "eager")
    assert err is None
    assert jm.stats.captures == 3  # prefill; decodes with P <= 10; decodes with P > 10
    assert len(jm.stats.specializations) == 1
    note = jm.stats.specializations[0]
    assert "<= 10" in note and "if past > 10:" in note and "= 11" in note


@pytest.mark.compile
def test_branch_on_symbolic_cache_length_is_checked_every_call_inductor():
    """AOTInductor programs carry no guards: the contract is what keeps the P <= 10 program off P = 11."""
    jm, err, _ = generation(planted(BranchOnSymbolicCacheLength), "inductor")
    assert err is None and jm.stats.captures == 3


# --- (b) the new-token count ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_branch_on_new_tokens_matches_eager(backend):
    jm, err, _ = generation(planted(BranchOnLength), backend)
    assert err is None
    assert jm.stats.captures == 2  # the prefill program is traced with the prompt's side of T > 4
    assert len(jm.stats.specializations) == 1 and "if input_ids.shape[1] > 4:" in jm.stats.specializations[0]


def test_int_of_new_tokens_gets_a_program_per_token_count():
    """A baked T (int() of a size) is checked per call: one program per count, each right for its count."""
    model = planted(BakedLength)
    jm, err, _ = generation(model, "eager")
    assert err is None
    assert jm.stats.captures == 2  # prefill at T = 8, decodes at T = 1: both captured with their own sizes
    assert all("n = int(input_ids.shape[1])" in s for s in jm.stats.specializations)
    for n, captures in [(5, 3), (4, 4), (5, 4), (4, 4)]:  # prompts without a mask: another key
        jo = jm(input_ids=tokens(1, n), cache=DynamicCache())
        eo = model(input_ids=tokens(1, n), cache=DynamicCache())
        assert_close(jo.logits, eo.logits, torch.float32, f"logits, {n} tokens")
        assert jm.stats.captures == captures


def test_a_key_holds_a_bounded_number_of_programs(monkeypatch):
    """Past _MAX_PROGRAMS programs for one key, the next length is refused, naming the line to change."""
    monkeypatch.setattr(kvtrace.runtime.jit, "_MAX_PROGRAMS", 2)
    jm = kvtrace.jit(planted(BakedLength), backend="eager")
    for n in (5, 4):
        jm(input_ids=tokens(1, n), cache=DynamicCache())
    assert jm.stats.captures == 2
    with pytest.raises(kvtrace.CaptureError) as err:
        jm(input_ids=tokens(1, 6), cache=DynamicCache())
    msg = str(err.value)
    assert "\n" not in msg and "captured 2 dynamic-fresh programs" in msg
    assert "input_ids.shape[1] == 4 (found 6)" in msg and "n = int(input_ids.shape[1])" in msg
    assert jm.stats.captures == 2


# --- (c) a Python int position ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [IntOfPosition, ItemOfPosition], ids=["int", "item"])
@pytest.mark.parametrize("backend", ["eager", "inductor"])  # refused while tracing: nothing is compiled
def test_python_int_position_matches_eager_or_is_refused(cls, backend):
    jm, err, calls = generation(planted(cls), backend, positions=True)
    if err is None:
        assert calls == 1 + DECODES
        return
    assert isinstance(err, kvtrace.CaptureError) and calls == 0
    assert f"{SELF}:" in str(err) and "cache_position" in str(err), str(err)
    assert jm.stats.captures == 0


def test_int_position_branch_is_refused_naming_the_line():
    _, err, _ = generation(planted(IntOfPosition), "eager", positions=True)
    assert isinstance(err, kvtrace.CaptureError)
    assert 'if int(kwargs["cache_position"][0]) > 10:' in str(err)
    assert "reads a value of a tensor into Python" in str(err)  # what to do about it


# --- (d) a length kept on self ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "inductor"])  # refused while tracing: nothing is compiled
def test_length_stored_on_self_is_refused_and_the_model_restored(backend):
    model = planted(RemembersLength)
    model(input_ids=tokens(1, 3), cache=DynamicCache())  # eager has run once: seen = 3
    jm, err, calls = generation(model, backend)
    assert isinstance(err, kvtrace.CaptureError) and calls == 0
    assert "RemembersLength.seen" in str(err) and "a traced size" in str(err)
    assert model.seen == 3 and type(model.seen) is int  # not a SymInt left behind by the trace
    assert jm.stats.captures == 0
    model(input_ids=tokens(1, 2), cache=DynamicCache())  # eager still works and counts on
    assert model.seen == 5


# --- (e) a branch on a size of 1: no guard records it, the size classes keep it apart ----------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_path_matches_eager(backend):
    """Decodes (T = 1) run a program traced at T = 1, never the prefill's T >= 2 one (CallKey.sizes)."""
    jm, err, calls = generation(planted(OneTokenFastPath), backend)
    assert err is None and calls == 1 + DECODES
    assert jm.stats.captures == 2
    assert sorted(k.sizes for k in jm._programs) == [(1, 2), (2, 0)]


def test_single_past_token_path_matches_eager():
    """A 1-token prompt, then decodes at P = 1, 2, 3: the P = 1 decode has its own program."""
    model = planted(SinglePastTokenPath)
    jm = kvtrace.jit(model, backend="eager")
    jc, ec = DynamicCache(), DynamicCache()
    ids = tokens(1, 1)
    for past in range(4):
        kw = dict(input_ids=ids, attention_mask=ones(1, past + 1))
        jo, eo = jm(cache=jc, **kw), model(cache=ec, **kw)
        assert_close(jo.logits, eo.logits, torch.float32, f"logits at P = {past}")
        assert_caches_close(jc, ec, torch.float32)
        ids = greedy(eo.logits)
    assert sorted(k.sizes for k in jm._programs) == [(1, 0), (1, 1), (1, 2)]
