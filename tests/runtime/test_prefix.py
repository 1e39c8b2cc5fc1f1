"""The prefix cache: how much of a cache holding some tokens a new prompt keeps (``runtime.prefix``), and
``SlotEngine``'s use of it (``kvtrace serve``'s prefix cache): which free slot a request takes, what it prefills,
rings past their window. The random schedules with shared openings and follow-ups are in test_slots.py."""

from __future__ import annotations

import pytest
from tests.conftest import tiny_model
from tests.runtime.test_slots import MAX_SEQ, _prompts, assert_free_rows_hold_their_tokens, export_pair

import kvtrace
from kvtrace.runtime.generate import generate
from kvtrace.runtime.prefix import common_prefix, reusable
from kvtrace.runtime.slots import SlotEngine, SlotRequest
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec


def test_common_prefix_and_what_a_cache_may_keep():
    full = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, 32),), batch_size=1, max_seq_len=32, dtype="float32")
    ring = CacheSpec(layers=(LayerSpec(LayerKind.SLIDING, 1, 2, 8, window=8), LayerSpec(LayerKind.FULL, 1, 2, 32)),
                     batch_size=1, max_seq_len=32, dtype="float32")
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0 and common_prefix([1], [1]) == 1
    held = list(range(20))
    assert reusable(full, held, [*held[:12], 99]) == 12  # diverges after 12: rewind 8
    assert reusable(full, held, held) == 19  # the same tokens: all but one, whose logits start the answer
    assert reusable(full, held, [*held, 5, 6]) == 20  # extends it: nothing rewound
    assert reusable(full, held, [7]) == 0 and reusable(full, [], held) == 0
    # a ring of 8 past its window: 0 or 1 token rewound, else nothing kept; within its window, anything
    assert reusable(ring, held, [*held, 5]) == 20 and reusable(ring, held, held) == 19
    assert reusable(ring, held, [*held[:12], 99]) == 0
    assert reusable(ring, held[:6], [*held[:3], 99]) == 3


def test_a_cache_with_shared_extra_state_keeps_nothing():
    """The vision decoder's cross-attention flags belong to the whole cache: Session.rewind refuses it, so neither
    a prefix nor a one-slot engine's row is kept (the engine resets it when a request ends)."""
    from tests.conftest import tiny_mllama

    from kvtrace.models.registry import make_decoder
    from kvtrace.spec.program import program_specs

    decoder = make_decoder(tiny_mllama(), max_seq_len=32)
    spec = decoder.cache_spec
    assert spec.extra and reusable(spec, list(range(10)), [*range(10), 5]) == 0
    programs = {p.name: (p, None) for p in program_specs(decoder) if p.name in ("prefill", "decode")}
    assert not SlotEngine(spec, programs, prefix_cache=True).prefix_cache


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_pair(tmp_path_factory.mktemp("prefix"))


def _answer(engine: SlotEngine, request: SlotRequest) -> tuple[int, int, list[int]]:
    """Admit ``request`` and step until it finishes: (its slot, prompt tokens kept from the row, its tokens)."""
    slot, ev = engine.admit(request)
    cached, tokens, events = engine.last_step.cached_tokens, [], [ev] if ev is not None else []
    while True:
        for ev in events:  # only this request runs
            tokens += [ev.token] if ev.token is not None else []
            if ev.finish is not None:
                return slot, cached, tokens
        events = engine.step()


def test_prefix_cache_keeps_the_longest_held_prefix_and_answers_as_solo_runs(exported):
    """A freed row keeps the K/V of its prompt and fed-back output; a request that begins alike takes that row and
    prefills only the rest (a chat's next turn: all of the earlier conversation); others take an empty row, then
    the one freed longest ago. Every answer is its solo run's."""
    solo, art = exported
    engine = art.slot_engine()
    a, b, c = _prompts((12, 9, 7), seed=11)

    def solo_of(p, n):
        return generate(solo.session(), p, max_new_tokens=n).tokens

    slot, cached, out = _answer(engine, SlotRequest(a, max_tokens=6))
    assert (slot, cached, out) == (0, 0, solo_of(a, 6))
    assert engine.held(0) == tuple(a + out[:5])  # max_tokens: the last token was sampled, never fed
    turn2 = a + out + [7, 8, 9]  # the next turn: the conversation so far and a new message
    slot, cached, out2 = _answer(engine, SlotRequest(turn2, max_tokens=5))
    assert (slot, cached, engine.held(0)[: len(turn2)]) == (0, 17, tuple(turn2)) and out2 == solo_of(turn2, 5)
    assert _answer(engine, SlotRequest(b, max_tokens=4))[:2] == (1, 0)  # unrelated: an empty row, row 0 kept
    slot, cached, out3 = _answer(engine, SlotRequest(a[:8] + c, max_tokens=4))  # diverges after 8 tokens
    assert (slot, cached, out3) == (0, 8, solo_of(a[:8] + c, 4))
    held = list(engine.held(0))
    slot, cached, out4 = _answer(engine, SlotRequest(held, max_tokens=3))  # all of it again: all but one kept
    assert (slot, cached, out4) == (0, len(held) - 1, solo_of(held, 3))
    engine.admit(SlotRequest(c, max_tokens=3))  # rows 2, 3 were empty: taken first
    assert engine.last_step.cached_tokens == 0 and engine.active == (2,)
    assert_free_rows_hold_their_tokens(engine, solo)  # and reset() empties them

    # every row held: a request without a reusable prefix takes the row freed longest ago
    for p in _prompts((5, 6, 7, 8), seed=12):
        _answer(engine, SlotRequest(p, max_tokens=2))
    assert _answer(engine, SlotRequest(b, max_tokens=2))[:2] == (0, 0)
    assert _answer(engine, SlotRequest(c, max_tokens=2))[:2] == (1, 0)

    off = art.slot_engine(prefix_cache=False)  # freed rows reset, nothing kept
    _answer(off, SlotRequest(a, max_tokens=6))
    slot, cached, out2_off = _answer(off, SlotRequest(turn2, max_tokens=5))
    assert (cached, off.held(slot), out2_off) == (0, (), out2)
    assert all(bool((t == 0).all()) for t in off.state)


def test_prefix_cache_of_a_sliding_ring_keeps_a_prefix_only_where_the_ring_still_holds_it(tmp_path):
    """Past its window a ring holds only the last W positions: a prompt that extends the whole held conversation
    keeps it all, one that diverges inside it keeps nothing (KindOps.max_rewind); a conversation within the window
    keeps any prefix. Answers as solo runs throughout."""
    m = tiny_model("mistral", sliding_window=8)
    kvtrace.export(m, tmp_path / "solo.kvt", max_seq_len=MAX_SEQ, prefill_logits="last")
    kvtrace.export(m, tmp_path / "slots.kvt", max_seq_len=MAX_SEQ, slots=2, prefill_logits="last")
    solo, art = kvtrace.load(tmp_path / "solo.kvt"), kvtrace.load(tmp_path / "slots.kvt")
    engine = art.slot_engine(prefill_chunk=4)
    a, b = _prompts((14, 3), seed=13)

    def solo_of(p, n):
        return generate(solo.session(), p, max_new_tokens=n).tokens

    _, _, out = _answer(engine, SlotRequest(a, max_tokens=5))  # 18 positions held: the ring has wrapped
    turn2 = a + out + [9, 10]
    assert _answer(engine, SlotRequest(turn2, max_tokens=4))[1:] == (18, solo_of(turn2, 4))
    diverging = a[:10] + b
    assert _answer(engine, SlotRequest(diverging, max_tokens=4))[1:] == (0, solo_of(diverging, 4))
    engine.reset()
    short = a[:4]  # 4 + 3 - 1 = 6 positions held, within the window of 8
    _answer(engine, SlotRequest(short, max_tokens=3))
    assert _answer(engine, SlotRequest(a[:2] + b, max_tokens=3))[1:] == (2, solo_of(a[:2] + b, 3))
    assert_free_rows_hold_their_tokens(engine, solo)
