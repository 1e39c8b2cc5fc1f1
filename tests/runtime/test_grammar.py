"""Structured output (``runtime.grammar``): every generation under a constraint matches it, whatever the model
prefers; the stop id is allowed exactly where the output may end; bad constraints are refused before any token."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tests.conftest import byte_tokenizer

from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.runtime.generate import Sampling, generate, sample
from kvtrace.runtime.grammar import Constraint, Grammar
from kvtrace.runtime.session import Session
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

EOS = 2  # <|im_end|>


TOK = byte_tokenizer()
V = TOK.get_vocab_size() + 5  # a model's vocabulary is often padded past its tokenizer's


def _session(seed: int = 0, max_seq_len: int = 256, eos_bias: float = 0.0, writes: tuple[int, list[int]] = (0, []),
             favour: tuple[int, float] = (0, 0.0)) -> Session:
    """A random 'model': logits depend on the last token and the position only (the same whatever the call's
    shape, so speculative and plain runs agree), wide enough that unconstrained output is noise. ``writes``
    (p, ids): it prefers to write ids from position p on."""
    g = torch.Generator().manual_seed(seed)
    by_token = torch.randn(V, V, generator=g) * 4  # [V, V]
    by_pos = torch.randn(max_seq_len, V, generator=g)  # [S, V]
    by_token[:, EOS] += eos_bias
    by_token[:, favour[0]] += favour[1]
    start, ids = writes
    for i, t in enumerate(ids):
        by_pos[start + i - 1, t] += 30.0  # the logits at position p - 1 predict the token at p

    def run(tokens, input_pos, *state):  # tokens [1, T], input_pos [T] -> logits [1, T, V]
        state[0].add_(1)
        return by_token[tokens] + by_pos[input_pos][None]

    spec = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, max_seq_len),), batch_size=1, max_seq_len=max_seq_len,
                     dtype="float32")
    return Session(spec, run, run)


def _text(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=False)


PROMPT = TOK.encode('Answer in JSON: {"name": "cat", "age": 3}').ids
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


def _check_person(value) -> None:
    assert isinstance(value, dict) and set(value) <= {"name", "age", "tags"} and {"name", "age"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert all(t in ("a", "b", "c") for t in value.get("tags", [])) and len(value.get("tags", [])) <= 3
    assert list(value) == [k for k in PERSON["properties"] if k in value]  # in the schema's order, as OpenAI's


def test_unconstrained_the_random_model_writes_no_json():
    res = generate(_session(), PROMPT, max_new_tokens=40)
    with pytest.raises(ValueError):
        json.loads(_text(res.tokens))


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, seed=1), Sampling(temperature=0.7, top_p=0.9,
                                                                                             seed=2),
                                      Sampling(temperature=1.0, top_k=5, seed=3, repetition_penalty=1.3)],
                         ids=["greedy", "t1", "top_p", "top_k_penalized"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_answer_under_a_json_schema_is_valid_under_it(sampling, seed):
    grammar = Grammar(Constraint.json_schema(PERSON), TOK, eos_ids=[EOS])
    res = generate(_session(seed), PROMPT, max_new_tokens=200, sampling=sampling, eos_ids=[EOS], grammar=grammar)
    assert res.stats.stop_reason in ("grammar", "eos"), res.stats.stop_reason
    _check_person(json.loads(_text(res.tokens)))


def test_the_stop_id_is_allowed_exactly_where_the_output_may_end():
    # a model that would rather stop at once: under [0-9]{2,4} it gets two digits first, then may stop
    grammar = Grammar(Constraint.regex(r"[0-9]{2,4}"), TOK, eos_ids=[EOS])
    s = _session(eos_bias=100.0)
    res = generate(s, PROMPT, max_new_tokens=50, eos_ids=[EOS], grammar=grammar)
    assert res.stats.stop_reason == "eos" and re.fullmatch(r"[0-9]{2,4}", _text(res.tokens))
    state = grammar.start()
    assert not state.allowed(V)[EOS]  # nothing yet: the stop id is masked
    state.advance(TOK.token_to_id("1"))
    state.advance(TOK.token_to_id("2"))
    ok = state.allowed(V)
    assert ok[EOS] and state.accepting and not state.done and not ok[V - 1]  # padded ids: never
    for d in "34":
        state.advance(TOK.token_to_id(d))
    assert state.done and state.allowed(V).nonzero().flatten().tolist() == [EOS]


def test_a_complete_constraint_ends_the_generation_without_a_stop_id():
    grammar = Grammar(Constraint.regex(r"(yes|no)!"), TOK)  # no stop ids: ends when nothing more is allowed
    s = _session()
    res = generate(s, PROMPT, max_new_tokens=50, grammar=grammar)
    assert res.stats.stop_reason == "grammar" and _text(res.tokens) in ("yes!", "no!")
    assert s.position == len(PROMPT) + len(res.tokens) - 1  # as any stop: the last token is not fed


def test_without_stop_ids_llguidances_own_end_token_is_never_sampled():
    grammar = Grammar(Constraint.regex(r"[0-9]+"), TOK)  # complete after one digit, and open-ended
    assert grammar._tok.eos_tokens == [0]  # llguidance's guess for this tokenizer: <|endoftext|>
    res = generate(_session(favour=(0, 100.0)), PROMPT, max_new_tokens=10, grammar=grammar)  # the model wants 0
    assert 0 not in res.tokens and re.fullmatch("[0-9]+", _text(res.tokens))
    assert res.stats.stop_reason == "max_new_tokens" and len(res.tokens) == 10


def test_max_new_tokens_cuts_a_constrained_answer_short():
    grammar = Grammar(Constraint.lark('start: "[" ITEM ("," ITEM)* "]"\nITEM: /[a-z]+/'), TOK, eos_ids=[EOS])
    res = generate(_session(eos_bias=-100.0), PROMPT, max_new_tokens=12, eos_ids=[EOS], grammar=grammar)
    assert res.stats.stop_reason == "max_new_tokens" and len(res.tokens) == 12
    assert re.fullmatch(r"\[[a-z]+(,[a-z]+)*(,|\]|,?[a-z]*)", _text(res.tokens))  # a prefix of the language


def test_json_object_mode_gives_an_object():
    grammar = Grammar(Constraint.json_object(), TOK, eos_ids=[EOS])
    finished = 0
    for seed in range(4):
        res = generate(_session(seed, eos_bias=6.0), PROMPT, max_new_tokens=200, eos_ids=[EOS], grammar=grammar,
                       sampling=Sampling(temperature=0.8, seed=seed))
        if res.stats.stop_reason in ("eos", "grammar"):
            assert isinstance(json.loads(_text(res.tokens)), dict)
            finished += 1
        else:  # cut short: still the start of an object
            assert _text(res.tokens).lstrip().startswith("{")
    assert finished, "no answer finished in 200 tokens: the check above never ran"


def test_a_schemas_own_whitespace_options_replace_the_bounded_default():
    compact = Grammar(Constraint.json_schema(PERSON), TOK, eos_ids=[EOS])  # x-guidance: whitespace_flexible false
    loose = Grammar(Constraint.json_schema({k: v for k, v in PERSON.items() if k != "x-guidance"}), TOK, eos_ids=[EOS])
    spaced = TOK.encode('{ "name"').ids
    assert compact.start()._m.validate_tokens(spaced) < len(spaced)
    assert loose.start()._m.validate_tokens(spaced) == len(spaced)
    many = TOK.encode('{' + "\n" * 3 + '"name"').ids  # past the default's one line break
    assert loose.start()._m.validate_tokens(many) < len(many)


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_constrained_answers_are_the_plain_ones_and_draft_what_the_schema_forces(k):
    grammar = Grammar(Constraint.json_schema(PERSON), TOK, eos_ids=[EOS])
    accepted = 0
    for seed in range(3):
        s = _session(seed)
        plain = generate(s, PROMPT * 2, max_new_tokens=60, eos_ids=[EOS], grammar=grammar)
        pos = s.position
        s.reset()
        spec = generate(s, PROMPT * 2, max_new_tokens=60, eos_ids=[EOS], grammar=grammar, speculate=k)
        assert spec.tokens == plain.tokens and s.position == pos
        assert spec.stats.stop_reason == plain.stats.stop_reason
        accepted += spec.stats.accepted
    # this random model copies nothing from its prompt: what it accepts are the keys and punctuation the schema
    # forces ('name":"' after '{"', '","age":' after the name), drafted by GrammarState.forced
    assert accepted >= 3 * min(k, 2)


def test_forced_tokens_are_what_the_constraint_leaves_no_choice_about():
    state = Grammar(Constraint.json_schema(PERSON), TOK, eos_ids=[EOS]).start()
    # compact, properties in order, name first; the opening quote of the value not yet: a token may join it to text
    assert _text(state.forced()) == '{"name":'
    state.advance(TOK.token_to_id('{"'))
    assert _text(state.forced()) == 'name":'
    for t in TOK.encode('name":"cat').ids:
        state.advance(t)
    assert state.forced() == []  # the name may go on, or end: no forced token


def test_drafts_copied_from_the_prompt_are_accepted_under_the_constraint():
    example = TOK.encode('{"name": "hello world", "age": 3}').ids
    prompt = TOK.encode("Like this: ").ids + example + TOK.encode(" Now you: ").ids
    schema = {k: v for k, v in PERSON.items() if k != "x-guidance"}  # the example's spaces allowed
    grammar = Grammar(Constraint.json_schema(schema), TOK, eos_ids=[EOS])
    writes = (len(prompt), [*example, EOS])  # the model would copy the example (which the drafter proposes)
    plain = generate(_session(writes=writes), prompt, max_new_tokens=60, eos_ids=[EOS], grammar=grammar)
    spec = generate(_session(writes=writes), prompt, max_new_tokens=60, eos_ids=[EOS], grammar=grammar, speculate=8)
    assert json.loads(_text(spec.tokens)) == {"name": "hello world", "age": 3}
    assert spec.tokens == plain.tokens and spec.stats.stop_reason == plain.stats.stop_reason
    assert spec.stats.accepted >= len(example) // 2 and spec.stats.calls < len(spec.tokens) // 2


def test_sample_masks_and_advances_in_one_place():
    grammar = Grammar(Constraint.regex("ab"), TOK)
    state = grammar.start()
    logits = torch.zeros(1, V)
    logits[0, TOK.token_to_id("b")] = 50.0  # the model wants "b"; only "a" (or "ab") may come first
    tok = int(sample(logits, Sampling(), None, grammar=state))
    assert _text([tok]) in ("a", "ab") and state.tokens == 1


def test_a_choice_answers_exactly_one_of_its_texts_and_gbnf_is_llama_cpps_grammar():
    labels = ["positive", 'neg"ative', "a|b", "line\nbreak"]  # quotes, regex metacharacters, a newline: as written
    grammar = Grammar(Constraint.choice(labels), TOK, eos_ids=[EOS])
    seen = set()
    for seed in range(12):
        res = generate(_session(seed), PROMPT, max_new_tokens=20, eos_ids=[EOS], grammar=grammar,
                       sampling=Sampling(temperature=1.0, seed=seed))
        assert _text(res.tokens) in labels and res.stats.stop_reason in ("grammar", "eos")
        seen.add(_text(res.tokens))
    assert len(seen) >= 2  # the random model's own preference picks among them
    gbnf = Grammar(Constraint.gbnf('root ::= "id-" [0-9]{3} ("-" [a-z]+)?'), TOK, eos_ids=[EOS])
    for seed in range(3):
        res = generate(_session(seed), PROMPT, max_new_tokens=20, eos_ids=[EOS], grammar=gbnf)
        assert re.fullmatch("id-[0-9]{3}(-[a-z]+)?", _text(res.tokens))


@pytest.mark.parametrize("make, match", [
    (lambda: Constraint.json_schema('{"type": '), "not valid JSON"),
    (lambda: Constraint.json_schema([1, 2]), "is an object"),
    (lambda: Constraint.regex(""), "empty"),
    (lambda: Constraint.lark("  "), "empty"),
    (lambda: Constraint.choice([]), "a list of strings"),
    (lambda: Constraint.choice("yes"), "a list of strings"),
    (lambda: Constraint.choice(["yes", ""]), "non-empty string"),
    (lambda: Constraint.gbnf("root ::= ("), r"invalid GBNF grammar: Expected '\)'"),
    (lambda: Constraint.gbnf("root ::= foo"), "invalid GBNF grammar: Rule 'foo' not found"),
])
def test_malformed_constraints_are_refused_when_made(make, match):
    with pytest.raises(UsageError, match=match):
        make()


@pytest.mark.parametrize("constraint, match", [
    (Constraint.regex("[a-"), "invalid regex"),
    (Constraint.lark("start: foo"), "invalid lark"),
    (Constraint.json_schema({"type": "nonsense"}), "invalid json schema"),
])
def test_constraints_llguidance_rejects_are_refused_before_any_token(constraint, match):
    with pytest.raises(UsageError, match=match):
        Grammar(constraint, TOK, eos_ids=[EOS])


def test_a_grammar_must_stop_where_the_generation_stops():
    grammar = Grammar(Constraint.regex("[0-9]+"), TOK, eos_ids=[EOS])
    with pytest.raises(UsageError, match=r"stop ids \[2\], which this generation does not stop at"):
        generate(_session(), PROMPT, max_new_tokens=5, eos_ids=[1], grammar=grammar)
    with pytest.raises(UsageError, match=r"takes a kvtrace\.Grammar"):
        generate(_session(), PROMPT, max_new_tokens=5, grammar=Constraint.regex("a"))


def test_without_llguidance_the_error_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(UnsupportedError, match=r"needs llguidance: pip install 'kvtrace\[grammar\]'"):
        Grammar(Constraint.regex("a+"), TOK.to_str() + " ")  # another tokenizer text: not the cached one


# --- on exported artifacts: a Session and a SlotEngine ------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_arts(tmp_path_factory):
    from tests.conftest import make_byte_hf_dir

    import kvtrace

    d = tmp_path_factory.mktemp("bytes")
    make_byte_hf_dir(d)
    solo = kvtrace.load(kvtrace.export(str(d), d / "solo.kvt", max_seq_len=160, backend="exported"))
    slots = kvtrace.load(kvtrace.export(str(d), d / "slots.kvt", max_seq_len=160, backend="exported", slots=3))
    return solo, slots


def test_an_artifact_binds_its_own_tokenizer_and_stop_ids(byte_arts):
    solo, _ = byte_arts
    grammar = solo.grammar(Constraint.json_schema(PERSON))
    assert grammar.eos_ids == tuple(solo.manifest.eos_ids) == (EOS,)
    for seed in range(3):
        res = generate(solo.session(), PROMPT, max_new_tokens=120, eos_ids=solo.manifest.eos_ids, grammar=grammar,
                       sampling=Sampling(temperature=1.0, seed=seed))
        assert res.stats.stop_reason in ("grammar", "eos")
        _check_person(json.loads(_text(res.tokens)))


def test_constrained_requests_batched_with_plain_ones_answer_as_solo_runs(byte_arts):
    from kvtrace.runtime.slots import FinishReason, SlotRequest

    solo, slots = byte_arts
    schema = solo.grammar(Constraint.json_schema(PERSON))
    digits = solo.grammar(Constraint.regex("[0-9]{3}-[0-9]{4}"))
    prompts = [PROMPT, TOK.encode("the cat sat").ids, TOK.encode('{"ok": true}').ids]
    grammars = [schema, None, digits]
    want = []
    for p, g in zip(prompts, grammars, strict=True):
        want.append(generate(solo.session(), p, max_new_tokens=40, eos_ids=[EOS], grammar=g).tokens)
    eng = slots.slot_engine()
    got: dict[int, list[int]] = {}
    finish: dict[int, FinishReason] = {}
    by_slot = {}
    for i, (p, g) in enumerate(zip(prompts, grammars, strict=True)):
        slot, ev = eng.admit(SlotRequest(p, max_tokens=40, stop_ids=[EOS], grammar=g))
        by_slot[slot] = i
        got[i] = [ev.token] if ev.token is not None else []
    while eng.active:
        for ev in eng.step():
            i = by_slot[ev.slot]
            if ev.token is not None:
                got[i].append(ev.token)
            if ev.finish is not None:
                finish[i] = ev.finish
    assert [got[i] for i in range(3)] == want
    _check_person(json.loads(_text(got[0])))
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", _text(got[2])) and finish[2] is FinishReason.GRAMMAR
    assert finish[2].openai == "stop" and finish[1] is FinishReason.MAX_TOKENS
    with pytest.raises(UsageError, match=r"stop ids \[2\]"):  # refused before a slot is touched
        eng.admit(SlotRequest(PROMPT, max_tokens=4, stop_ids=[], grammar=schema))
    assert not eng.active


def test_a_request_whose_grammar_fails_ends_alone_and_frees_its_slot(byte_arts, monkeypatch):
    """A grammar that allows no token (llguidance at a limit, a tokenizer that cannot spell it) fails its own request
    only: the others in the batch go on, and the slot is freed and reset (never left behind)."""
    from kvtrace.runtime.grammar import GrammarState
    from kvtrace.runtime.slots import FinishReason, SlotRequest

    solo, slots = byte_arts
    real = GrammarState.mask

    def failing(self, logits):  # "9+" fails at once (in admit), "8+" at its third token (in a step)
        if self.grammar.constraint.text == "9+" or (self.grammar.constraint.text == "8+" and self.tokens == 2):
            raise UsageError(f"the regex allows no token after {self.tokens} generated")
        return real(self, logits)

    monkeypatch.setattr(GrammarState, "mask", failing)
    bad = solo.grammar(Constraint.regex("9+"))
    plain_ids = TOK.encode("the cat sat").ids
    want = generate(solo.session(), plain_ids, max_new_tokens=12, eos_ids=[EOS]).tokens
    eng = slots.slot_engine()
    s1, ev1 = eng.admit(SlotRequest(plain_ids, max_tokens=12, stop_ids=[EOS]))
    s2, ev2 = eng.admit(SlotRequest(PROMPT, max_tokens=12, stop_ids=[EOS], grammar=bad))  # fails at its first token
    assert ev2.finish is FinishReason.ERROR and "allows no token" in ev2.error and ev2.token is None
    assert s2 in eng.free and eng.active == (s1,)
    s3, ev3 = eng.admit(SlotRequest(PROMPT, max_tokens=12, stop_ids=[EOS], grammar=solo.grammar(Constraint.regex("8+"))))
    assert ev3.finish is None and _text([ev3.token]) == "8"
    got, third = [ev1.token], [ev3.token]
    while eng.active:
        for ev in eng.step():
            if ev.slot == s3:
                third.append(ev)
            elif ev.token is not None:
                got.append(ev.token)
    assert got == want  # the plain request never noticed
    assert [e.token for e in third[1:]] == [TOK.token_to_id("8"), None] and third[-1].finish is FinishReason.ERROR
    assert "after 2 generated" in third[-1].error
    assert eng.held(s2) == eng.held(s3) == ()  # reset, not kept for the prefix cache
