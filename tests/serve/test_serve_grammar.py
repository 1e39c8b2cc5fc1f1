"""Structured output over HTTP: OpenAI's ``response_format`` (json_object, json_schema) on both endpoints, through the
real OpenAI client, equal to a solo constrained run; malformed formats are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.conftest import make_byte_hf_dir
from tests.runtime.test_grammar import PERSON, _check_person
from tests.serve.test_serve import start_server

import kvtrace
from kvtrace.runtime.generate import generate
from kvtrace.serve.app import app_for
from kvtrace.sources.chat import apply_chat_template

SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_grammar")
    make_byte_hf_dir(d)
    kvtrace.export(str(d), d / "solo.kvt", max_seq_len=192, backend="exported")
    kvtrace.export(str(d), d / "slots.kvt", max_seq_len=192, backend="exported", slots=3)
    app = app_for(kvtrace.load(d / "slots.kvt"), max_queue=8)
    url, srv, thread = start_server(app)
    yield url, kvtrace.load(d / "solo.kvt")
    srv.should_exit = True
    thread.join(30)


@pytest.fixture
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _solo(solo, messages, constraint, max_tokens=96) -> str:
    m, tok = solo.manifest, solo.tokenizer()
    ids = tok.encode(apply_chat_template(m.chat_template, messages, bos_token=None,
                                         eos_token=tok.id_to_token(m.eos_ids[0])), add_special_tokens=False).ids
    res = generate(solo.session(), ids, max_new_tokens=max_tokens, eos_ids=m.eos_ids,
                   decode_text=lambda t: tok.decode(t, skip_special_tokens=True), grammar=solo.grammar(constraint))
    return res.text


def test_a_json_schema_answer_is_valid_and_equals_a_solo_constrained_run(served, client):
    msgs = [{"role": "user", "content": "the cat: give its name and age"}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=96, response_format=SCHEMA_FORMAT)
    text = r.choices[0].message.content
    _check_person(json.loads(text))
    assert r.choices[0].finish_reason == "stop"
    assert text == _solo(served[1], msgs, kvtrace.Constraint.json_schema(PERSON))
    chunks = client.chat.completions.create(model="m", messages=msgs, max_tokens=96, response_format=SCHEMA_FORMAT,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_json_object_mode_on_chat_and_completions(served, client):
    for seed in range(3):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "json please"}],
                                           max_tokens=150, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.lstrip().startswith("{")
    r = httpx.post(served[0] + "/v1/completions", json={
        "prompt": "the cat", "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
                                    "additionalProperties": False}}}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["text"])["n"] in (1, 2, 3)


@pytest.mark.parametrize(("fmt", "param", "words"), [
    ({"type": "xml"}, "response_format", "one of ['text', 'json_object', 'json_schema']"),
    ("json", "response_format", "must be an object"),
    ({"type": "json_schema"}, "response_format.json_schema", "must be an object {name, schema, strict}"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema",
     "must be a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "response_format.json_schema.name",
     "must be a string"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "response_format",
     "invalid json schema"),
])
def test_malformed_response_formats_are_400s_naming_the_field(served, fmt, param, words):
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})]:
        r = httpx.post(served[0] + path, json={**body, "response_format": fmt})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert words in err["message"] and err["param"] == param, err
