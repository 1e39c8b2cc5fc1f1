"""SlotEngine: N conversations over one batched cache; each request's output equals a solo Session run."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import tiny_model

import kvtrace
from kvtrace._errors import CacheOverflowError, UnsupportedError, UsageError
from kvtrace.runtime.generate import Sampling, generate
from kvtrace.runtime.slots import FinishReason, SlotEngine, SlotRequest

MAX_SEQ = 64
SLOTS = 4


def _prompts(lengths, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def export_pair(d) -> tuple[kvtrace.Artifact, kvtrace.Artifact]:
    """(solo batch-1 artifact, SLOTS-slot artifact) of one tiny Llama in ``d``, backend exported."""
    m = tiny_model("llama")
    kvtrace.export(m, d / "solo.kvt", max_seq_len=MAX_SEQ, prefill_logits="last")
    kvtrace.export(m, d / "slots.kvt", max_seq_len=MAX_SEQ, slots=SLOTS, prefill_logits="last")
    return kvtrace.load(d / "solo.kvt"), kvtrace.load(d / "slots.kvt")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_pair(tmp_path_factory.mktemp("slots"))


def _held_slots(spec, state, position):
    """Per layer, the slots of a batch-1 ``state`` holding data at ``position`` (``KindOps.valid``): k, v (raw int8
    for an int8 cache) and, int8, the scales."""
    from kvtrace.cache.kinds import kind_of

    out = []
    for i, layer in enumerate(spec.layers):
        st = spec.layer_state(state, i)
        kind = kind_of(layer)
        out += kind.valid(st.k, st.v, position, False)
        if st.scales is not None:
            out += kind.valid(*st.scales, position, False)
    return out


def assert_free_rows_hold_their_tokens(engine: SlotEngine, solo) -> None:
    """The prefix cache's invariant: every free row holds what a solo prefill of its ``held`` tokens writes (the
    slots holding data at that position; int8 values may sit one step away, as a batched call rounds them), and a
    row holding no tokens is at its initial values. Then ``reset()`` brings every row back to them."""
    spec, buffers = engine.spec, engine.spec.buffers()
    for slot in engine.free:
        row = [t[slot : slot + 1] for t in engine.state]  # [1, H_kv, S, D] each
        held = list(engine.held(slot))
        if not held:
            assert all(bool((t == b.init).all()) for t, b in zip(row, buffers, strict=True)), f"empty row {slot}"
            continue
        s = solo.session()
        s.prefill(torch.tensor([held]))
        for mine, theirs in zip(_held_slots(spec, row, len(held)), _held_slots(solo.cache_spec, s.state, len(held)),
                                strict=True):
            if mine.dtype == torch.int8:
                step = (mine.int() - theirs.int()).abs()
                assert int(step.max()) <= 1 and float((step > 0).float().mean()) < 0.02, f"row {slot}"
            else:
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4, msg=lambda m, s=slot: f"row {s}: {m}")
    engine.reset()
    assert all(bool((t == b.init).all()) for t, b in zip(engine.state, buffers, strict=True))
    assert all(engine.held(i) == () for i in range(engine.n_slots))


def run_staggered(engine: SlotEngine, requests: list[SlotRequest], join_every: int = 2) -> dict[int, list[int]]:
    """Admit one request every ``join_every`` steps while slots are free (requests join mid-stream);
    returns request index -> tokens. Checks that every request finished exactly once."""
    out: dict[int, list[int]] = {}
    finished: dict[int, FinishReason] = {}
    owner: dict[int, int] = {}
    pending = list(range(len(requests)))
    step = 0
    while pending or engine.active:
        if pending and engine.free and step % join_every == 0:
            i = pending.pop(0)
            slot, ev = engine.admit(requests[i])
            assert slot not in owner
            owner[slot], out[i] = i, []
            events = [ev] if ev is not None else []  # None: a chunked prefill goes on in the next steps
        else:
            events = []
        events += engine.step()
        for ev in events:
            i = owner[ev.slot]
            if ev.token is not None:
                out[i].append(ev.token)
            if ev.finish is not None:
                assert i not in finished
                finished[i] = ev.finish
                del owner[ev.slot]
        step += 1
        assert step < 10_000
    assert sorted(finished) == list(range(len(requests)))
    return out


def test_slot_programs_are_declared_program_specs(exported):
    _, art = exported
    pre, dec = art.manifest.programs["prefill"], art.manifest.programs["decode"]
    assert (pre.slots, dec.slots, pre.key_pos, dec.single_token) == (True, True, True, True)
    assert art.cache_spec.batch_size == SLOTS
    assert pre.signature() == ("(tokens[R,T] int64, input_pos[R,T] int64, key_pos[L] int64, slots[R] int64, *cache) "
                               "-> logits[R,1,V]")
    assert dec.signature().startswith("(tokens[R,1] int64, input_pos[R,1] int64, key_pos[L] int64, slots[R] int64")
    with pytest.raises(UsageError, match=r"conversation slots.*slot_engine"):
        art.session()


def test_greedy_outputs_equal_solo_runs_with_requests_joining_mid_stream(exported):
    solo, art = exported
    prompts = _prompts((5, 11, 3, 20, 7, 2, 9, 30))
    maxes = [12, 6, 20, 9, 15, 30, 4, 33]
    reqs = [SlotRequest(p, max_tokens=m) for p, m in zip(prompts, maxes, strict=True)]
    engine = art.slot_engine()
    out = run_staggered(engine, reqs)
    for i, (p, m) in enumerate(zip(prompts, maxes, strict=True)):
        assert out[i] == generate(solo.session(), p, max_new_tokens=m).tokens, f"request {i}"
    assert engine.active == () and engine.free == tuple(range(SLOTS))
    assert_free_rows_hold_their_tokens(engine, solo)


def test_seeded_sampling_and_stop_ids_per_request_equal_solo(exported):
    solo, art = exported
    prompts = _prompts((4, 9, 6), seed=1)
    samplings = [Sampling(temperature=0.9, top_p=0.8, seed=7), Sampling(), Sampling(temperature=1.3, top_k=20, seed=3)]
    ref = [generate(solo.session(), p, max_new_tokens=25, sampling=s) for p, s in zip(prompts, samplings, strict=True)]
    # a stop id that the greedy request emits mid-way ends it there, the id itself not output
    stop = ref[1].tokens[5]
    cut = ref[1].tokens.index(stop)
    reqs = [SlotRequest(p, max_tokens=25, sampling=s, stop_ids=(stop,) if i == 1 else ())
            for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))]
    out = run_staggered(art.slot_engine(), reqs, join_every=3)
    assert out[0] == ref[0].tokens and out[2] == ref[2].tokens
    assert out[1] == ref[1].tokens[:cut]


def test_penalized_requests_beside_plain_ones_equal_solo_runs(exported):
    """Penalties (greedy and sampled) keep their own counts per request; batched beside plain greedy rows, every
    answer is its solo run's with the same Sampling."""
    solo, art = exported
    prompts = _prompts((6, 9, 4, 12), seed=31)
    samplings = [Sampling(repetition_penalty=1.5), Sampling(), Sampling(temperature=0.9, seed=4, frequency_penalty=1.0,
                                                                        presence_penalty=0.5), Sampling()]
    reqs = [SlotRequest(p, max_tokens=20, sampling=s) for p, s in zip(prompts, samplings, strict=True)]
    out = run_staggered(art.slot_engine(), reqs)
    refs = [generate(solo.session(), p, max_new_tokens=20, sampling=s).tokens
            for p, s in zip(prompts, samplings, strict=True)]
    assert [out[i] for i in range(4)] == refs
    assert refs[0] != generate(solo.session(), prompts[0], max_new_tokens=20).tokens, "the penalty changed the answer"


def test_max_seq_len_is_checked_per_slot_before_anything_runs(exported):
    _, art = exported
    engine = art.slot_engine(max_seq_len=32)
    with pytest.raises(CacheOverflowError, match="max_seq_len=32"):
        engine.admit(SlotRequest(list(range(3, 35))))
    with pytest.raises(CacheOverflowError, match=r"max_tokens \(30\).*max_seq_len=32.*at most 22"):
        engine.admit(SlotRequest(list(range(3, 13)), max_tokens=30))
    with pytest.raises(UsageError, match="outside the vocabulary"):
        engine.admit(SlotRequest([5, 128]))
    with pytest.raises(UsageError, match="empty"):
        engine.admit(SlotRequest([]))
    with pytest.raises(UsageError, match="max_tokens must be"):
        engine.admit(SlotRequest([5], max_tokens=0))
    with pytest.raises(UsageError, match="max_seq_len must be"):
        art.slot_engine(max_seq_len=MAX_SEQ + 1)
    assert engine.active == () and all(bool((t == 0).all()) for t in engine.state)
    # no max_tokens: until the slot's context is full (prompt + completion = max_seq_len)
    _slot, ev = engine.admit(SlotRequest(list(range(3, 23))))
    n = 1
    while ev.finish is None:
        (ev,) = engine.step()
        n += 1
    assert (n, ev.finish, ev.finish.openai) == (12, FinishReason.MAX_SEQ_LEN, "length")


def test_all_slots_busy_is_refused_and_cancel_frees_and_resets_a_slot(exported):
    _, art = exported
    engine = art.slot_engine(prefix_cache=False)  # freed rows are reset at once
    slots = [engine.admit(SlotRequest([5, 6, 7], max_tokens=40))[0] for _ in range(SLOTS)]
    assert sorted(slots) == list(range(SLOTS)) and engine.free == ()
    with pytest.raises(UsageError, match=f"all {SLOTS} slots are busy"):
        engine.admit(SlotRequest([5]))
    engine.step()
    assert engine.position(2) == 4
    ev = engine.cancel(2)
    assert ev.finish is FinishReason.CANCELLED and engine.free == (2,)
    assert all(bool((t[2] == 0).all()) for t in engine.state) and any(bool(t[1].any()) for t in engine.state)
    assert engine.cancel(2) is None
    assert len(engine.step()) == SLOTS - 1
    engine.reset()
    assert engine.active == () and all(bool((t == 0).all()) for t in engine.state)


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunked_prefill_outputs_equal_solo_runs_with_requests_joining_mid_stream(exported, chunk):
    """prefill_chunk=C: prompts longer than C are prefilled C tokens per call, between decode steps; every
    answer is still the solo run's, and the freed rows hold their tokens."""
    solo, art = exported
    prompts = _prompts((5, 11, 3, 20, 7, 2, 9, 30), seed=6)
    maxes = [12, 6, 20, 9, 15, 30, 4, 25]
    engine = art.slot_engine(prefill_chunk=chunk)
    out = run_staggered(engine, [SlotRequest(p, max_tokens=m) for p, m in zip(prompts, maxes, strict=True)])
    for i, (p, m) in enumerate(zip(prompts, maxes, strict=True)):
        assert out[i] == generate(solo.session(), p, max_new_tokens=m).tokens, f"request {i}"
    assert engine.active == ()
    assert_free_rows_hold_their_tokens(engine, solo)


def test_each_step_prefills_at_most_one_chunk_while_the_others_decode(exported):
    _, art = exported
    whole, chunked = art.slot_engine(prefix_cache=False), art.slot_engine(prefill_chunk=8, prefix_cache=False)
    short, long_ = _prompts((4, 30), seed=7)
    wshort, wev_short = whole.admit(SlotRequest(short, max_tokens=20))
    wslot, wev = whole.admit(SlotRequest(long_, max_tokens=5))
    assert whole.position(wslot) == 30 and wev is not None
    assert chunked.admit(SlotRequest(short, max_tokens=20)) == (wshort, None)  # admit only takes the slot
    assert chunked.admit(SlotRequest(long_, max_tokens=5)) == (wslot, None)
    assert chunked.prefilling == (wshort, wslot) and chunked.last_step.prefill_tokens == 0
    (ev,) = chunked.step()  # the short prompt whole (4 tokens), the long one's first 4: one chunk of 8
    assert (ev.slot, ev.token) == (wshort, wev_short.token) and chunked.prefilling == (wslot,)
    assert (chunked.last_step.prefill_tokens, chunked.last_step.decode_rows, chunked.position(wslot)) == (8, 0, 4)
    for n in (12, 20, 28, 30):  # the long prompt's tokens in the cache after each step
        before = chunked.position(wslot)
        events = chunked.step()
        st = chunked.last_step
        assert (st.decode_rows, st.prefill_tokens, chunked.position(wslot)) == (1, n - before, n)
        assert [e.slot for e in events] == ([wshort] if n < 30 else [wshort, wslot]), "the short one decodes on"
    assert events[-1].token == wev.token and chunked.prefilling == ()
    for a, b in zip(chunked.state, whole.state, strict=True):  # the long prompt's row, prefilled either way
        torch.testing.assert_close(a[wslot, :, :30], b[wslot, :, :30], rtol=1e-5, atol=1e-5)
    # a request cancelled mid-prefill frees its slot and resets its row
    chunked.cancel(wshort)
    assert chunked.admit(SlotRequest(long_, max_tokens=5)) == (wshort, None)
    chunked.step()
    assert chunked.position(wshort) == 8 and chunked.prefilling == (wshort,)
    assert chunked.cancel(wshort).finish is FinishReason.CANCELLED and chunked.position(wshort) == 0
    assert all(bool((t[wshort] == 0).all()) for t in chunked.state)
    with pytest.raises(UsageError, match="prefill_chunk must be a whole number >= 1"):
        art.slot_engine(prefill_chunk=0)


def test_a_batch_1_artifact_runs_as_one_slot(exported):
    solo, _ = exported
    engine = solo.slot_engine()
    assert engine.n_slots == 1
    p = _prompts((6,), seed=3)[0]
    out = run_staggered(engine, [SlotRequest(p, max_tokens=10), SlotRequest(p[:3], max_tokens=5)])
    assert out[0] == generate(solo.session(), p, max_new_tokens=10).tokens
    assert out[1] == generate(solo.session(), p[:3], max_new_tokens=5).tokens
    # its prefill program at positions past 0: chunked prefill
    assert run_staggered(solo.slot_engine(prefill_chunk=4), [SlotRequest(p, max_tokens=10)])[0] == out[0]


def test_logprobs_are_the_models_own_at_every_step(exported):
    """logprobs=k: each token's event carries the log-softmax of the model's logits at that step (a solo Session fed
    the same tokens) for the sampled token, whatever sampling chose, and the k most likely ids in order."""
    solo, art = exported
    p = _prompts((7,), seed=21)[0]
    engine = art.slot_engine()
    req = SlotRequest(p, max_tokens=6, logprobs=3, sampling=Sampling(temperature=1.5, seed=3))
    _slot, ev = engine.admit(req)
    events = [ev]
    engine.admit(SlotRequest(_prompts((4,), seed=22)[0], max_tokens=9))  # a neighbour without logprobs
    while len(events) < 6:
        for e in engine.step():
            assert e.slot == _slot or e.logprobs is None
            events += [e] if e.slot == _slot else []
    session = solo.session()
    logits = session.prefill(torch.tensor([p]))[0, -1]  # [V]
    for e in events:
        lp = torch.log_softmax(logits.float(), dim=-1)
        assert e.logprobs.logprob == pytest.approx(float(lp[e.token]), abs=1e-4)
        top = lp.topk(3)
        assert [i for i, _ in e.logprobs.top] == top.indices.tolist()
        assert [v for _, v in e.logprobs.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        logits = session.decode(torch.tensor([[e.token]]))[0, -1]
    assert any(e.logprobs.top[0][0] != e.token for e in events), "temperature 1.5 sampled beside the top token"
    _slot, ev = engine.admit(SlotRequest(p, max_tokens=1, logprobs=0))
    assert ev.logprobs.top == () and ev.logprobs.logprob <= 0
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(UsageError, match=r"logprobs must be None or a whole number of alternatives in \[0, 20\]"):
            engine.check(SlotRequest(p, logprobs=bad))


def test_text_and_stop_strings(tmp_path):
    from tests.conftest import make_tiny_hf_dir

    make_tiny_hf_dir(tmp_path, words_only=True)
    kvtrace.export(str(tmp_path), tmp_path / "solo.kvt", max_seq_len=48, prefill_logits="last")
    kvtrace.export(str(tmp_path), tmp_path / "s.kvt", max_seq_len=48, slots=2, prefill_logits="last")
    solo, art = kvtrace.load(tmp_path / "solo.kvt"), kvtrace.load(tmp_path / "s.kvt")
    tok = art.tokenizer()
    prompt = tok.encode("hello world the cat", add_special_tokens=False).ids
    engine = art.slot_engine()

    def text_of(req):
        _slot, ev = engine.admit(req)
        parts, finish = [ev.text], ev.finish
        while finish is None:
            (ev,) = engine.step()
            parts.append(ev.text)
            finish = ev.finish
        return "".join(parts), finish

    full, finish = text_of(SlotRequest(prompt, max_tokens=12))
    ref = generate(solo.session(), prompt, max_new_tokens=12, decode_text=lambda t: tok.decode(t, skip_special_tokens=True))
    assert finish is FinishReason.MAX_TOKENS and full == ref.text and len(full.split()) == 12
    words = full.split()
    stop = " ".join(words[3:5])  # two words mid-way, spanning a space
    text, finish = text_of(SlotRequest(prompt, max_tokens=12, stop=[stop, "never appears"]))
    assert finish is FinishReason.STOP and text == full[: full.index(stop)]
    with pytest.raises(UsageError, match="stop must be a list of non-empty strings"):
        engine.admit(SlotRequest(prompt, stop="cat"))


def test_models_that_cannot_run_slots_are_refused_by_name():
    from tests.conftest import tiny_mllama

    with pytest.raises(UnsupportedError, match=r"MllamaDecoder does not run per-row positions; its cache has cross "
                                                r"layers.*shared state \['cross.mask', 'cross.active'\]"):
        kvtrace.export(tiny_mllama(), "/nonexistent/x.kvt", max_seq_len=32, slots=2)
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedError, match=r"its RoPE \('dynamic'\) depends on the sequence length.*--parallel 1"):
        kvtrace.export(dynamic, "/nonexistent/x.kvt", max_seq_len=32, slots=2)  # the general HF decoder's
    with pytest.raises(UsageError, match="slots must be a whole number"):
        kvtrace.export(tiny_model("llama"), "/nonexistent/x.kvt", max_seq_len=32, slots=0)


# Decoders and caches beyond the plain Llama one: (name, model, kv_dtype, the general HF decoder forced).
# Sliding rings (window 8: the 19-token prompt wraps them), hybrid sliding/full caches, int8 K/V, Gemma's
# soft-capped attention, HF's own modules (GPT-NeoX's partial rotary, Gemma 3 through the general path, GPT-OSS's
# sinks, GPT-2's learned positions).
ROW_CASES = {
    "llama-int8": (lambda: tiny_model("llama"), "int8", False),
    "mistral-sliding": (lambda: tiny_model("mistral", sliding_window=8), None, False),
    "mistral-sliding-int8": (lambda: tiny_model("mistral", sliding_window=8), "int8", False),
    "qwen2-hybrid": (lambda: tiny_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1),
                     None, False),
    "gemma2": (lambda: tiny_model("gemma2"), None, False),
    "gemma3-int8": (lambda: tiny_model("gemma3_text"), "int8", False),
    "hf-gemma2": (lambda: tiny_model("gemma2"), None, True),
    "hf-gemma3-int8": (lambda: tiny_model("gemma3_text"), "int8", True),
    "hf-gpt_neox": (lambda: tiny_model("gpt_neox"), None, False),
    "hf-gpt_oss": (lambda: _hf_generic_model("gpt_oss"), None, False),  # attention sinks, MoE, a sliding layer
    "hf-gpt2": (lambda: _hf_generic_model("gpt2"), None, False),  # learned absolute positions, per row
}


def _hf_generic_model(arch: str):
    from tests.models.test_hf_generic import make

    return make(arch)


def _decoders(case: str, slots: int):
    from kvtrace.models.hf_generic import HFDecoder
    from kvtrace.models.registry import make_decoder

    make, kv, hf = ROW_CASES[case]
    m = make()
    build = (lambda b: HFDecoder(m, max_seq_len=32, batch_size=b, kv_dtype=kv)) if hf else (
        lambda b: make_decoder(m, max_seq_len=32, batch_size=b, kv_dtype=kv))
    return build(1), build(slots)


@pytest.mark.parametrize("case", list(ROW_CASES))
def test_forward_slots_rows_match_solo_runs_for_every_slot_kind_and_family(case):
    """Two slots at different positions (one prompt longer than the window, one prefilled in two chunks) decode
    10 tokens in one call each, every row's logits and cache row as a solo forward_live run's; row 1 untouched."""
    solo, multi = _decoders(case, 3)
    assert multi.slots_refusal() is None
    g = torch.Generator().manual_seed(5)
    p, q = (torch.randint(3, 100, (n,), generator=g).tolist() for n in (19, 4))
    state = multi.cache_spec.allocate()
    refs = []
    with torch.no_grad():
        multi.forward_slots(torch.tensor([p]), torch.arange(19)[None], torch.arange(19), torch.tensor([2]), *state)
        multi.forward_slots(torch.tensor([q[:2]]), torch.arange(2)[None], torch.arange(2), torch.tensor([0]), *state)
        multi.forward_slots(torch.tensor([q[2:]]), torch.arange(2, 4)[None], torch.arange(4), torch.tensor([0]), *state)
        for prompt in (p, q):
            s = solo.cache_spec.allocate()
            solo.forward_live(torch.tensor([prompt]), torch.arange(len(prompt)), torch.arange(len(prompt)), *s)
            refs.append([s, len(prompt)])
        for _ in range(10):
            toks = torch.randint(3, 100, (2, 1), generator=g)
            pos = torch.tensor([[refs[0][1]], [refs[1][1]]])
            out = multi.forward_slots(toks, pos, torch.arange(int(pos.max()) + 1), torch.tensor([2, 0]), *state)
            for row, (s, n) in enumerate(refs):
                ref = solo.forward_live(toks[row : row + 1], torch.tensor([n]), torch.arange(n + 1), *s)
                torch.testing.assert_close(out[row : row + 1], ref, rtol=1e-4, atol=1e-4)
                refs[row][1] += 1
    for row, (s, _) in zip((2, 0), refs, strict=True):
        for mine, theirs in zip(state, s, strict=True):  # every buffer: K/V, rings, int8 scales
            if mine.dtype == torch.int8:  # a value on a rounding edge may land one step away in a batched call
                step = (mine[row].int() - theirs[0].int()).abs()
                assert int(step.max()) <= 1 and float((step > 0).float().mean()) < 0.02
            else:
                torch.testing.assert_close(mine[row], theirs[0], rtol=1e-4, atol=1e-4)
    assert all(bool((t[1] == b.init).all()) for t, b in zip(state, multi.cache_spec.buffers(), strict=True))


# Exported slots artifacts of the other decoders and caches, greedy answers against solo runs (the default suite
# runs three: a sliding int8 ring, Gemma 2's hybrid soft-capped cache, the general HF decoder).
ARTIFACT_CASES = ("mistral-sliding-int8", "gemma2", "hf-gpt_neox")


@pytest.mark.parametrize("case", ARTIFACT_CASES)
def test_slots_artifacts_of_sliding_int8_and_other_families_answer_as_solo_runs(tmp_path, case):
    make, kv, _ = ROW_CASES[case]
    m = make()
    kvtrace.export(m, tmp_path / "solo.kvt", max_seq_len=MAX_SEQ, prefill_logits="last", kv_dtype=kv)
    kvtrace.export(m, tmp_path / "slots.kvt", max_seq_len=MAX_SEQ, slots=SLOTS, prefill_logits="last", kv_dtype=kv)
    solo, art = kvtrace.load(tmp_path / "solo.kvt"), kvtrace.load(tmp_path / "slots.kvt")
    assert art.manifest.programs["decode"].slots and art.cache_spec.kv_dtype == kv
    prompts = _prompts((5, 11, 3, 20, 7, 1), seed=2)  # 20 > the window of 8
    maxes = [12, 6, 20, 30, 15, 8]
    solo_out = [generate(solo.session(), p, max_new_tokens=n).tokens for p, n in zip(prompts, maxes, strict=True)]
    for chunk in (None, 4):
        engine = art.slot_engine(prefill_chunk=chunk)
        out = run_staggered(engine, [SlotRequest(p, max_tokens=n) for p, n in zip(prompts, maxes, strict=True)])
        assert [out[i] for i in range(len(prompts))] == solo_out, f"prefill_chunk={chunk}"
        assert_free_rows_hold_their_tokens(engine, solo)
    # one slot driven like a Session under verify: logits and every cache layer (rings, int8) against eager
    # (an int8 cache: against the same decoder with the same cache, eager: ``verify_by_cache``)
    from kvtrace.tools.runners import EagerRunner, SessionRunner
    from kvtrace.tools.verify_kv import verify_by_cache

    session = art.slot_session()
    report = verify_by_cache(m, EagerRunner(m), [SessionRunner(session, "slots")], _prompts((6, 12), seed=4), steps=6)
    assert report.passed, report.summary()
    assert session.untouched()


@pytest.mark.compile
def test_aoti_slots_artifact_of_a_hybrid_int8_cache_answers_as_solo_runs(tmp_path):
    """Gemma 3's sliding and full layers, int8 K/V, compiled: every request as a solo run, chunked or not."""
    make, kv, _ = ROW_CASES["gemma3-int8"]
    m = make()
    kvtrace.export(m, tmp_path / "solo.kvt", max_seq_len=MAX_SEQ, prefill_logits="last", kv_dtype=kv)
    kvtrace.export(m, tmp_path / "slots.kvt", max_seq_len=MAX_SEQ, slots=SLOTS, prefill_logits="last", kv_dtype=kv,
                   backend="aoti")
    solo, art = kvtrace.load(tmp_path / "solo.kvt"), kvtrace.load(tmp_path / "slots.kvt")
    prompts, maxes = _prompts((5, 11, 3, 20, 7, 1), seed=2), [12, 6, 20, 30, 15, 8]
    for chunk in (None, 4):
        out = run_staggered(art.slot_engine(prefill_chunk=chunk),
                            [SlotRequest(p, max_tokens=n) for p, n in zip(prompts, maxes, strict=True)])
        for i, (p, n) in enumerate(zip(prompts, maxes, strict=True)):
            assert out[i] == generate(solo.session(), p, max_new_tokens=n).tokens, f"request {i}, chunk {chunk}"


@pytest.mark.compile
@pytest.mark.parametrize("backend", ["aoti", "aoti-packed"])
def test_aoti_slot_artifact_matches_solo_runs(tmp_path, backend):
    """A compiled slots artifact (aoti: two programs; aoti-packed: one frozen program, R and T symbolic, serving
    the one-slot prefill and the every-slot decode) answers every request as a solo run does."""
    m = tiny_model("llama")
    kvtrace.export(m, tmp_path / "solo.kvt", max_seq_len=MAX_SEQ, prefill_logits="last")  # exported: the reference
    kvtrace.export(m, tmp_path / "slots.kvt", max_seq_len=MAX_SEQ, slots=SLOTS, backend=backend, prefill_logits="last")
    solo, art = kvtrace.load(tmp_path / "solo.kvt"), kvtrace.load(tmp_path / "slots.kvt")
    assert art.manifest.backend == backend and art.manifest.cache_spec.batch_size == SLOTS
    prompts = _prompts((5, 11, 3, 20, 7, 1), seed=2)
    maxes = [12, 6, 20, 9, 15, 8]
    engine = art.slot_engine()
    out = run_staggered(engine, [SlotRequest(p, max_tokens=m) for p, m in zip(prompts, maxes, strict=True)])
    for i, (p, m) in enumerate(zip(prompts, maxes, strict=True)):
        assert out[i] == generate(solo.session(), p, max_new_tokens=m).tokens, f"request {i}"
    assert_free_rows_hold_their_tokens(engine, solo)


def test_verify_checks_one_slot_of_a_slots_artifact_against_eager(exported):
    """A slots artifact under kvtrace.verify: its last slot, driven like a Session, logits and every cache layer
    against the HF model step by step; the other rows stay at their initial values."""
    from kvtrace.tools.runners import EagerRunner, SessionRunner
    from kvtrace.tools.verify import verify

    _, art = exported
    session = art.slot_session()
    assert session.slot == SLOTS - 1 and session.spec.batch_size == 1 and session.state[0].shape[0] == 1
    report = verify(EagerRunner(tiny_model("llama")), [SessionRunner(session, "slots")], _prompts((6, 9), seed=4),
                    steps=6)
    assert report.passed, report.summary()
    assert session.untouched()
    with pytest.raises(UsageError, match="slot must be in"):
        art.slot_session(SLOTS)


# --- random schedules: rows never mix --------------------------------------------------------------------
# KVTRACE_FUZZ_EXAMPLES=N: a longer, random (not derandomized) search
_LONG = int(__import__("os").environ.get("KVTRACE_FUZZ_EXAMPLES", "0"))


@pytest.fixture(scope="module")
def hybrid_int8(tmp_path_factory):
    """(solo, 3-slot) exported artifacts of Gemma 2's sliding (window 8) and full layers over an int8 cache, and a
    memo of solo greedy answers."""
    d = tmp_path_factory.mktemp("hybrid_int8")
    m = tiny_model("gemma2")
    kvtrace.export(m, d / "solo.kvt", max_seq_len=48, prefill_logits="last", kv_dtype="int8")
    kvtrace.export(m, d / "slots.kvt", max_seq_len=48, slots=3, prefill_logits="last", kv_dtype="int8")
    return kvtrace.load(d / "solo.kvt"), kvtrace.load(d / "slots.kvt"), {}


_BASE = list(range(40, 64))  # a prompt opening several requests share (a system prompt, say)


def _schedule():
    from hypothesis import strategies as st

    tail = st.lists(st.integers(3, 127), min_size=1, max_size=6)
    prompt = st.one_of(  # a follow-up of request k (mostly after it ended); a shared opening; fresh (longer than
        st.tuples(st.just("follow"), st.integers(0, 5), tail),  # the window too)
        st.tuples(st.just("shared"), st.integers(1, len(_BASE)), tail),
        st.tuples(st.just("fresh"), st.lists(st.integers(3, 127), min_size=1, max_size=20)))
    request = st.tuples(prompt, st.integers(1, 12), st.integers(0, 10))  # prompt, max_tokens, the step it arrives
    return st.tuples(st.lists(request, min_size=1, max_size=6), st.sampled_from([None, 1, 3, 8]),
                     st.one_of(st.none(), st.tuples(st.integers(0, 5), st.integers(0, 12))))  # cancel (who, when)


@pytest.mark.parametrize("which", ["hybrid_int8", "exported"])
def test_random_schedules_answer_as_solo_runs(request, which):
    """Random arrivals, prompt lengths (rings wrapped or not), max_tokens, prefill chunks and a cancel: every request
    answers as its solo run (a cancelled one: a prefix of it), and the engine ends with every free row holding its
    tokens (the prefix cache). Prompts open alike or follow up an earlier request (its prompt, its solo answer and
    more), so rows are reused at every prefix length. Sliding and full layers, int8 K/V: the rows of update_rows
    never mix, and a kept prefix is the one a solo prefill would have written."""
    from hypothesis import HealthCheck, given, settings

    solo, art, *memo = request.getfixturevalue(which)  # and Llama's full-attention layers, 4 slots
    memo = memo[0] if memo else {}
    limit = art.cache_spec.max_seq_len
    reused = []

    def alone(prompt, n):
        key = (tuple(prompt), n)
        if key not in memo:
            memo[key] = generate(solo.session(), prompt, max_new_tokens=n).tokens
        return memo[key]

    @settings(max_examples=_LONG or 15, deadline=None, derandomize=not _LONG, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(_schedule())
    def run(case):
        drawn, chunk, cancel = case
        requests = []  # (prompt, max_tokens, arrival), the prompts built in order (a follow-up reads an earlier one)
        for how, n, at in drawn:
            if how[0] == "fresh":
                p = how[1]
            elif how[0] == "shared":
                p = _BASE[: how[1]] + how[2]
            elif requests:
                prev, m, prev_at = requests[how[1] % len(requests)]
                p = prev + alone(prev, m) + how[2]
                at = max(at, prev_at + m + 2)  # usually once it has answered (a chat's next turn)
            else:
                p = how[2]
            requests.append((p[: limit - n], n, at))
        engine = art.slot_engine(prefill_chunk=chunk)
        out: dict[int, list[int]] = {}
        owner: dict[int, int] = {}
        done: set[int] = set()
        cancelled = None
        pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
        def take(ev):  # one event, as it comes: a slot freed by it may be taken by the next admission
            i = owner[ev.slot]
            if ev.token is not None:
                out[i].append(ev.token)
            if ev.finish is not None:
                done.add(i)
                del owner[ev.slot]

        step = 0
        while pending or engine.active:
            while pending and requests[pending[0]][2] <= step and engine.free:
                i = pending.pop(0)
                slot, ev = engine.admit(SlotRequest(requests[i][0], max_tokens=requests[i][1]))
                owner[slot], out[i] = i, []
                reused.append(engine.last_step.cached_tokens)
                if ev is not None:
                    take(ev)
            if cancel is not None and step == cancel[1] and cancelled is None and engine.active:
                slot = engine.active[cancel[0] % len(engine.active)]
                cancelled = owner[slot]
                take(engine.cancel(slot))
            for ev in engine.step():
                take(ev)
            step += 1
            assert step < 500
        for i, (prompt, n, _) in enumerate(requests):
            ref = alone(prompt, n)
            if i == cancelled:
                assert out[i] == ref[: len(out[i])], f"cancelled request {i}"
            else:
                assert out[i] == ref, f"request {i} of {requests}, chunk {chunk}"
        assert_free_rows_hold_their_tokens(engine, solo)

    run()
    assert sum(n > 0 for n in reused) >= len(reused) // 10, "the schedules exercise the prefix cache"
