"""Conversation (runtime/chat.py): each turn prefills only its own tokens on the kept cache, and the cache
always holds exactly the templated conversation; undo, reset, save/load, overflow."""

from __future__ import annotations

import pytest
import torch

import kvtrace
from conftest import make_tiny_hf_dir
from kvtrace.runtime.chat import Conversation
from kvtrace.runtime.generate import generate

MAX_SEQ_LEN = 96


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_chat")
    make_tiny_hf_dir(d, max_position_embeddings=128, words_only=True)
    path = d / "chat.kvt"
    kvtrace.export(str(d), path, max_seq_len=MAX_SEQ_LEN, backend="exported")
    return kvtrace.load(path)


def _conv(art, **kw) -> Conversation:
    m = art.manifest
    return Conversation(art.session(), art.tokenizer(), template=m.chat_template, bos_id=m.bos_id,
                        eos_ids=m.eos_ids, **kw)


def _say(conv: Conversation, text: str, n: int = 6):
    with conv.ask(text, max_new_tokens=n) as turn:
        chunks = [c.token for c in turn]
    return turn, chunks


def _one_shot(art, conv: Conversation, messages, n: int = 6) -> list[int]:
    """The answer to ``messages`` generated from scratch on a fresh session over the whole templated conversation."""
    ids = conv.encode(messages)
    return generate(art.session(), ids, max_new_tokens=n, eos_ids=art.manifest.eos_ids).tokens


def test_second_turn_prefills_only_its_own_tokens_and_answers_as_a_one_shot_run(art):
    conv = _conv(art)
    first, tokens1 = _say(conv, "hello world")
    assert first.stats.reused == 0 and first.stats.prefilled == first.stats.conversation_tokens
    assert tokens1 == _one_shot(art, conv, conv.messages[:1])
    assert conv.tokens == conv.encode(conv.messages[:1]) + tokens1[:-1]  # the cache: prompt + answer fed back
    assert conv.session.position == len(conv.tokens)

    cached = list(conv.tokens)
    second, tokens2 = _say(conv, "the cat sat")
    whole = conv.encode(conv.messages[:3])  # user, assistant, user
    s = second.stats
    # the cache is reused up to where the whole conversation's tokens first differ from it (the answer
    # re-encoded from its text may split otherwise than it was generated); only the rest is prefilled
    same = next((i for i, (a, b) in enumerate(zip(cached, whole, strict=False)) if a != b), len(cached))
    assert s.conversation_tokens == len(whole) and (s.reused, s.prefilled) == (same, len(whole) - same)
    assert s.rewound == len(cached) - same and s.reused >= len(conv.encode(conv.messages[:1]))
    # this model answers in words, which re-encode to the ids generated: the whole first turn is reused
    # (prompt + the answer tokens decoded into the cache: all but the last), and none rewound
    assert first.text and first.stats.generation.stop_reason == "max_new_tokens"
    assert (s.reused, s.rewound) == (len(cached), 0) and len(cached) == len(conv.encode(conv.messages[:1])) + 5
    assert tokens2 == _one_shot(art, conv, conv.messages[:3])  # same tokens as templating the whole conversation
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    assert conv.messages[1]["content"] == first.text and conv.turns == 2


def test_the_cache_holds_exactly_the_templated_conversation_after_every_turn(art):
    conv = _conv(art, system="the cat")
    for text in ("hello", "world", "the cat sat"):
        turn, toks = _say(conv, text)
        whole = conv.encode(conv.messages[:-1])  # what this turn prefilled up to
        assert conv.tokens == whole + toks[:-1] if turn.stats.generation.stop_reason != "eos" else whole + toks
    assert conv.messages[0] == {"role": "system", "content": "the cat"}


def test_undo_forgets_the_last_turn_and_the_next_answer_is_as_if_it_never_happened(art):
    conv = _conv(art)
    _say(conv, "hello world")
    before = (list(conv.tokens), [dict(m) for m in conv.messages])
    _say(conv, "the cat")
    conv.undo()
    assert conv.turns == 1 and conv.messages == before[1]
    assert conv.tokens == before[0][:len(conv.tokens)] and conv.session.position == len(conv.tokens)
    _, again = _say(conv, "sat sat")
    assert again == _one_shot(art, conv, conv.messages[:3])
    conv.undo()
    conv.undo()
    assert conv.turns == 0 and conv.session.position == 0 and conv.messages == []
    with pytest.raises(kvtrace.UsageError, match="nothing to undo"):
        conv.undo()


def test_reset_keeps_the_system_message_and_empties_the_cache(art):
    conv = _conv(art, system="hello")
    _say(conv, "world")
    conv.reset()
    assert conv.messages == [{"role": "system", "content": "hello"}] and conv.tokens == []
    assert conv.session.position == 0


def test_save_and_load_round_trip_the_conversation_and_its_cache(art, tmp_path):
    conv = _conv(art)
    _say(conv, "hello world")
    path = conv.save(tmp_path / "c.safetensors")
    state = [t.clone() for t in conv.session.state]
    _, expected = _say(conv, "the cat")
    other = _conv(art)
    other.load(path)
    assert other.turns == 1 and other.session.position == len(other.tokens)
    assert all(torch.equal(a, b) for a, b in zip(other.session.state, state, strict=True))
    _, got = _say(other, "the cat")
    assert got == expected
    (tmp_path / "junk").write_bytes(b"not a file")
    with pytest.raises(kvtrace.UsageError, match="is not a saved conversation"):
        other.load(tmp_path / "junk")
    assert other.turns == 2  # a refused load leaves the conversation as it was


def test_a_conversation_past_max_seq_len_says_so_and_keeps_its_state(art):
    conv = _conv(art)
    with pytest.raises(kvtrace.CacheOverflowError, match=r"max_seq_len is 96.*/reset"):
        conv.ask(" ".join(["hello"] * 200))
    assert conv.turns == 0 and conv.session.position == 0
    with pytest.raises(kvtrace.UsageError, match="empty"):
        conv.ask("   ")


def test_an_answer_broken_off_keeps_the_text_so_far(art):
    conv = _conv(art)
    with conv.ask("hello world", max_new_tokens=6) as turn:
        for _ in turn:
            break  # what Ctrl-C does in the CLI
    assert conv.turns == 1 and conv.messages[-1]["role"] == "assistant"
    assert conv.session.position == len(conv.tokens)
    _, toks = _say(conv, "the cat")
    assert toks == _one_shot(art, conv, conv.messages[:3])
