"""Prompt-lookup speculative decoding (``runtime.speculate``): the drafter, how far a draft may reach, and
generations that equal plain ones token for token, with the session left where a plain one leaves it."""

from __future__ import annotations

import pytest
from tests.conftest import tiny_model

import kvtrace
from kvtrace._errors import UsageError
from kvtrace.runtime.generate import Sampling, generate, stream
from kvtrace.runtime.speculate import NgramDrafter, draft_room
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

MAX_SEQ = 96


def test_the_drafter_copies_what_followed_the_longest_match():
    d = NgramDrafter(4)
    d.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert d.propose() == [4, 5, 9, 2]  # the tail (1, 2, 3) beats the later (2, 3), which 7 followed


def test_a_proposal_can_start_after_tokens_taken_to_follow_the_history():
    d = NgramDrafter(4)
    d.extend([7, 2, 3, 4, 5, 6, 1])
    assert d.propose() == []  # (6, 1) never occurred before
    assert d.propose(after=[2, 3]) == [4, 5, 6, 1]  # as if 2, 3 came next (a grammar forces them): what followed them
    assert d.propose(2, after=[9]) == [] and d.tokens == [7, 2, 3, 4, 5, 6, 1]  # nothing indexed from `after`


def test_longest_ngram_wins_and_the_latest_occurrence_of_it():
    d = NgramDrafter(3)
    d.extend([5, 6, 7, 1, 5, 6, 8, 2, 9, 5, 6])
    assert d.propose() == [8, 2, 9]  # (5, 6) occurred twice: the later one, followed by 8
    d.extend([7])  # tail (5, 6, 7) matches the first occurrence, 3 tokens long
    assert d.propose() == [1, 5, 6]
    assert d.propose(most=2) == [1, 5] and d.propose(most=0) == []
    d.extend([42])  # never seen: no draft
    assert d.propose() == []


def test_the_drafter_indexes_as_it_goes_what_a_batch_index_would_hold():
    import random

    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(300)]
    a, b = NgramDrafter(5), NgramDrafter(5)
    a.extend(toks)
    for i, t in enumerate(toks):
        b.extend([t])
        tail = toks[: i + 1]
        for n in (3, 2):  # brute force: the latest earlier occurrence of the longest matching tail (>= MIN_NGRAM)
            starts = [j for j in range(len(tail) - n) if tail[j : j + n] == tail[-n:]]
            if starts:
                want = tail[starts[-1] + n : starts[-1] + n + 5]
                break
        else:
            want = []
        assert b.propose() == want, i
    assert a.propose() == b.propose()


def test_drafting_stops_when_it_does_not_pay_and_is_tried_again_later():
    from kvtrace.runtime.speculate import PROBE_SHARE, Pace

    p = Pace()
    assert p.worth() and p.draft_len(8) == 8  # nothing measured: a verify call first,
    p.verified(0.030, 4)
    assert not p.worth()  # then a decode step, even while drafts keep coming
    p.decoded(0.010)
    assert p.worth() and p.draft_len(8) == 5  # 4 tokens in 30 ms beat 1 in 10 ms; drafts near the yield
    for _ in range(10):
        p.verified(0.040, 1)  # the drafts stopped matching: 1 token in 40 ms
    assert p.draft_len(8) == 3  # ceil(~1.1) + 1
    waited = []
    while not p.worth():
        p.decoded(0.010)
        waited.append(0.010)
    assert sum(waited) == pytest.approx(p.verify_s / PROBE_SHARE, abs=0.011)  # probes cost ~PROBE_SHARE
    for _ in range(10):
        p.verified(0.012, 3)  # the probe found a repeating part again
    assert p.worth() and p.worth()


def test_bad_draft_sizes_are_refused():
    with pytest.raises(UsageError, match=r"1 \.\. 16 draft tokens; got 17"):
        NgramDrafter(17)
    with pytest.raises(UsageError, match="got 0"):
        NgramDrafter(0)


def _At(spec, position):  # a Session over these layers at ``position`` (its programs compute nothing)
    import torch

    from kvtrace.runtime.session import Session

    def noop(tokens, input_pos, *state):
        return torch.zeros(tokens.shape[0], tokens.shape[1], 4)

    s = Session(spec, noop, noop)
    if position:
        s.prefill([[1] * position])
    return s


def test_a_draft_fits_the_cache_and_what_a_ring_can_rewind():
    full = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, 32),), batch_size=1, max_seq_len=32, dtype="float32")
    ring = CacheSpec(layers=(LayerSpec(LayerKind.SLIDING, 1, 2, 8, window=8), LayerSpec(LayerKind.FULL, 1, 2, 32)),
                     batch_size=1, max_seq_len=32, dtype="float32")
    assert draft_room(_At(full, 10), 4) == 4
    assert draft_room(_At(full, 28), 8) == 3  # tok + 3 drafts fill slots 28..31
    assert draft_room(_At(full, 31), 4) == 0
    assert draft_room(_At(ring, 2), 4) == 4  # within the window: anything can be rewound
    assert draft_room(_At(ring, 20), 4) == 1  # past it: one token only (KindOps.max_rewind)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    model = tiny_model("llama")
    return {lg: kvtrace.load(kvtrace.export(model, d / f"{lg}.kvt", max_seq_len=MAX_SEQ, backend="exported",
                                            prefill_logits=lg)) for lg in ("all", "last")}


def _prompt(seed: int = 0, n: int = 30) -> list[int]:
    import torch

    base = torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return base + base[: n // 2]  # repeats itself: drafts from the first go


# penalties mild enough that the tiny model still repeats itself (stronger ones leave nothing to accept)
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(frequency_penalty=0.03), Sampling(repetition_penalty=1.05),
                                      Sampling(temperature=0.8, top_k=1, seed=3)],
                         ids=["greedy", "frequency", "repetition", "top1"])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_speculative_greedy_answers_are_the_plain_ones_and_leave_the_session_there(art, sampling, k):
    s = art["all"].session()
    accepted, calls = 0, 0
    for seed in (0, 1, 2):
        prompt = _prompt(seed)
        s.reset()
        plain = generate(s, prompt, max_new_tokens=40, sampling=sampling)
        pos = s.position
        s.reset()
        spec = generate(s, prompt, max_new_tokens=40, sampling=sampling, speculate=k)
        assert spec.tokens == plain.tokens and s.position == pos == len(prompt) + 39
        st = spec.stats
        assert st.stop_reason == "max_new_tokens" and 0 <= st.accepted <= st.drafted
        assert st.calls == 39 - st.accepted  # every accepted draft token saved one program call
        accepted, calls = accepted + st.accepted, calls + st.calls
        if st.drafted:
            assert st.to_dict()["drafted"] == st.drafted and "draft tokens accepted" in st.line()
    assert accepted > 0 and calls < 3 * 39


def test_eos_and_max_new_tokens_inside_a_draft_stop_where_a_plain_generation_stops(art):
    s = art["all"].session()
    prompt = _prompt(2)
    plain = generate(s, prompt, max_new_tokens=40)
    for cut in (3, 10, 17):  # a token of the answer as the stop id: it falls inside an accepted run
        eos = plain.tokens[cut]
        want = plain.tokens[: plain.tokens.index(eos)]
        s.reset()
        got = generate(s, prompt, max_new_tokens=40, eos_ids=[eos], speculate=6)
        assert got.tokens == want and got.stats.stop_reason == "eos"
        assert s.position == len(prompt) + len(want)  # the answer fed back, the stop id not
    for n in (1, 5, 13):
        s.reset()
        got = generate(s, prompt, max_new_tokens=n, speculate=6)
        assert got.tokens == plain.tokens[:n] and s.position == len(prompt) + n - 1


def test_stopping_early_leaves_the_session_at_the_tokens_yielded(art):
    s = art["all"].session()
    prompt = _prompt(3)
    plain = generate(s, prompt, max_new_tokens=30)
    for stop_after in (2, 7, 15):
        s.reset()
        g = stream(s, prompt, max_new_tokens=30, speculate=8)
        got = [c.token for _, c in zip(range(stop_after), g, strict=False)]
        assert got == plain.tokens[:stop_after]
        assert s.position == len(prompt) + stop_after - 1  # as after a plain generation's stop_after-th token


def test_the_cache_end_stops_a_speculative_generation_as_a_plain_one(art):
    s = art["all"].session()
    prompt = _prompt(4, n=40) * 1  # 60 tokens: 36 slots left
    plain = generate(s, prompt, max_new_tokens=100)
    s.reset()
    got = generate(s, prompt, max_new_tokens=100, speculate=8)
    assert got.tokens == plain.tokens and got.stats.stop_reason == plain.stats.stop_reason == "max_seq_len"
    assert s.position == MAX_SEQ


def test_an_artifact_without_every_positions_logits_is_refused(art):
    with pytest.raises(UsageError, match="export it with --prefill-logits all"):
        stream(art["last"].session(), _prompt(), max_new_tokens=4, speculate=4)
    with pytest.raises(UsageError, match=r"1 \.\. 16 draft tokens"):
        stream(art["all"].session(), _prompt(), max_new_tokens=4, speculate=20)


def test_a_sliding_window_past_its_window_speculates_within_what_it_can_rewind(tmp_path):
    model = tiny_model("mistral", sliding_window=8)
    a = kvtrace.load(kvtrace.export(model, tmp_path / "m.kvt", max_seq_len=MAX_SEQ, backend="exported",
                                    prefill_logits="all"))
    s = a.session()
    prompt = _prompt(5)
    plain = generate(s, prompt, max_new_tokens=40)
    s.reset()
    got = generate(s, prompt, max_new_tokens=40, speculate=4)  # every rewind within KindOps.max_rewind
    assert got.tokens == plain.tokens and got.stats.drafted > 0


def test_kvtrace_run_speculates_on_an_artifact_with_every_positions_logits(tmp_path, monkeypatch, capsys):
    import json

    from tests.conftest import make_tiny_hf_dir

    from kvtrace.cli.main import main

    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    make_tiny_hf_dir(tmp_path, words_only=True)
    prompt = "hello world the cat sat hello world the cat sat hello world"
    outs = {}
    for logits in ("all", "last"):
        art = tmp_path / f"{logits}.kvt"
        assert main(["export", str(tmp_path), "-o", str(art), "--max-seq-len", "64", "--backend", "exported",
                     "--prefill-logits", logits, "--quiet"]) == 0
        outs[logits] = art
    capsys.readouterr()
    run = ["run", str(outs["all"]), "--prompt", prompt, "--max-len", "60", "--raw", "--json", "--quiet"]
    assert main(run) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*run, "--speculate", "4"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"] and len(spec["tokens"]) > 10
    assert spec["drafted"] >= spec["accepted"] > 0 and "drafted" not in plain
    assert main(["run", str(outs["last"]), "--prompt", prompt, "--speculate", "4", "--raw", "--quiet"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ": error: " in ln]
    assert len(err) == 1 and "--prefill-logits all" in err[0]


def test_a_chat_speculates_from_the_whole_conversation_and_answers_as_without(tmp_path):
    from tests.conftest import make_tiny_hf_dir

    make_tiny_hf_dir(tmp_path, words_only=True, max_position_embeddings=256)
    a = kvtrace.load(kvtrace.export(str(tmp_path), tmp_path / "c.kvt", max_seq_len=256, backend="exported",
                                    prefill_logits="all"))
    messages = ["hello world the cat sat", "the cat sat hello world", "world world the cat"]
    answers = {}
    for k in (0, 4):
        conv = a.conversation()
        answers[k] = []
        for m in messages:
            with conv.ask(m, max_new_tokens=12, speculate=k) as turn:
                tokens = [c.token for c in turn]
            answers[k].append((tokens, turn.stats.to_dict()))
        assert conv.session.position == len(conv.tokens)
    assert [t for t, _ in answers[4]] == [t for t, _ in answers[0]]
    assert sum(st.get("accepted", 0) for _, st in answers[4]) > 0


def test_a_ring_refuses_a_rewind_over_slots_a_rejected_draft_overwrote(tmp_path):
    """Past its window a ring's slot for position p+1-W holds whatever p+1 wrote: after a call wrote p and p+1
    and one token was rewound (a rejected one-token draft), the ring lost p+1-W, so no more can be rewound."""
    import torch

    model = tiny_model("mistral", sliding_window=8)
    s = kvtrace.load(kvtrace.export(model, tmp_path / "r.kvt", max_seq_len=MAX_SEQ, backend="exported",
                                    prefill_logits="all")).session()
    s.prefill(torch.arange(3, 23).reshape(1, 20))
    s.prefill([[5, 6]])  # tok and a one-token draft at 20, 21
    s.rewind(1)  # the draft rejected: position 21, slot of 13 overwritten by 21
    with pytest.raises(UsageError, match=r"at most 0 token\(s\) can be rewound"):
        s.rewind(1)
    s.decode([[7]])  # position 21 written again: the ring holds 14..21
    s.rewind(1)  # one token past the window, as before
    assert s.position == 21
    s.reset()
    s.prefill(torch.arange(3, 23).reshape(1, 20))
    s.decode([[5]])
    s.rewind(1)
    with pytest.raises(UsageError, match="can be rewound"):  # the older hole: rewind(1) twice past the window
        s.rewind(1)
