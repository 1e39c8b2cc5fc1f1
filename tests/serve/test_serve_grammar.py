"""Structured output over HTTP: OpenAI's ``response_format`` (json_object, json_schema) on both endpoints, through the
real OpenAI client, equal to a solo constrained run; malformed formats are 400s naming the field."""

from __future__ import annotations

import json
import re

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
    make_byte_hf_dir(d, max_position_embeddings=1024)  # room for the tools' description (~500 byte-level tokens)
    kvtrace.export(str(d), d / "solo.kvt", max_seq_len=1024, backend="exported")
    kvtrace.export(str(d), d / "slots.kvt", max_seq_len=1024, backend="exported", slots=3)
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
    finished = 0
    for seed in range(4):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "json please"}],
                                           max_tokens=150, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            finished += 1
        else:
            assert r.choices[0].message.content.lstrip().startswith("{")
    assert finished, "no answer finished within max_tokens: the check above never ran"
    r = httpx.post(served[0] + "/v1/completions", json={
        "prompt": "the cat", "max_tokens": 60, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
                                    "additionalProperties": False}}}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["text"])["n"] in (1, 2, 3)


def test_vllm_and_llama_cpp_fields_constrain_the_answer_too(served, client):
    for extra, check in [
        ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
        ({"guided_regex": "[0-9]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{2}", t)),
        ({"guided_json": PERSON}, lambda t: _check_person(json.loads(t)) is None),
        ({"json_schema": json.dumps(PERSON)}, lambda t: _check_person(json.loads(t)) is None),
        ({"guided_grammar": 'start: "[" W ("," W)* "]"\nW: /cat|mat/'}, lambda t: re.fullmatch(r"\[(cat|mat)(,(cat|mat))*\]", t)),
        ({"grammar": 'root ::= "id-" [0-9]{3}'}, lambda t: re.fullmatch("id-[0-9]{3}", t)),
    ]:
        r = client.chat.completions.create(model="m", messages=ASK, max_tokens=120, extra_body=extra)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and check(text), (extra, text)
    r = httpx.post(served[0] + "/v1/completions", json={"prompt": "the cat", "max_tokens": 20,
                                                          "guided_choice": ["yes", "no"]})
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    for body, param, words in [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "guided_regex and guided_choice both"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json", "both constrain"),
        ({"guided_choice": "yes"}, "guided_choice", "a list of strings"),
        ({"guided_json": 3}, "guided_json", "must be a JSON schema"),
        ({"grammar": "root ::= ("}, "grammar", "invalid GBNF grammar"),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"guided_choice": ["a"], "tools": [WEATHER]}, "guided_choice", "cannot be combined"),
    ]:
        r = httpx.post(served[0] + "/v1/chat/completions", json={"messages": ASK, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["param"] == param, (body, err)


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
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}}, "response_format.json_schema.schema",
     "no value is valid under"),
])
def test_malformed_response_formats_are_400s_naming_the_field(served, fmt, param, words):
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})]:
        r = httpx.post(served[0] + path, json={**body, "response_format": fmt})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert words in err["message"] and err["param"] == param, err
    r = httpx.post(served[0] + "/v1/completions", json={"prompt": "hi", "response_format": {"type": "json_object"},
                                                          "stop": ["\n"]})
    assert r.status_code == 400 and "stop with response_format" in r.json()["error"]["message"]


# --- tool calling (serve.tools): answers held to the tool-call JSON, read back into OpenAI's shapes ---------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "the weather in the cat city?"}]


def _check_call(call, names=("get_weather", "get_time")) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and len(args["city"]) <= 12 and args["unit"] in ("c", "f")
    else:
        assert args["zone"] in ("utc", "cet")
    return args


def test_a_required_tool_call_is_returned_as_tool_calls_streaming_and_not(served, client):
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=120, tools=[WEATHER, TIME],
                                       tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    args = _check_call(choice.message.tool_calls[0])
    chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=120, tools=[WEATHER, TIME],
                                                 tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = deltas[0].tool_calls[0]
    assert streamed.index == 0 and streamed.function.name == choice.message.tool_calls[0].function.name
    assert json.loads(streamed.function.arguments) == args  # greedy: the same call


def test_a_named_tool_is_the_one_called_and_its_result_continues_the_conversation(served, client):
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=120, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    _check_call(call, names=("get_time",))
    follow = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    r2 = client.chat.completions.create(model="m", messages=follow, max_tokens=60, tools=[WEATHER, TIME],
                                        tool_choice="none")
    assert r2.choices[0].message.tool_calls is None and isinstance(r2.choices[0].message.content, str)


def test_auto_answers_either_call_tools_or_reply(served, client):
    kinds = set()
    for seed in range(6):
        r = client.chat.completions.create(model="m", messages=ASK, max_tokens=150, tools=[WEATHER, TIME],
                                           temperature=1.0, seed=seed)
        choice = r.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            for call in choice.message.tool_calls:
                _check_call(call)
            kinds.add("calls")
        elif choice.finish_reason == "stop":
            assert isinstance(choice.message.content, str) and not choice.message.content.startswith('{"response"')
            kinds.add("reply")
        else:  # cut short by max_tokens: the raw JSON so far, finish_reason length
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    assert kinds, "no answer finished in 150 tokens"


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"logprobs": True}, "logprobs", "logprobs with tools is not supported"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among tools"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"stop": ["\n"]}, "stop", "stop with tools is not supported"),
])
def test_tools_refusals_are_400s_naming_the_field(served, extra, param, words):
    r = httpx.post(served[0] + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err


def test_a_request_whose_grammar_fails_gets_an_error_and_the_server_goes_on(served, client, monkeypatch):
    from kvtrace._errors import UsageError
    from kvtrace.runtime.grammar import GrammarState

    def failing(self, logits):
        raise UsageError("the json object allows no token after 0 generated")

    monkeypatch.setattr(GrammarState, "mask", failing)
    for stream in (False, True):
        r = httpx.post(served[0] + "/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 8, "response_format": {"type": "json_object"}, "stream": stream})
        body = r.text
        assert ("generation failed: the json object allows no token" in body
                and (r.status_code == 500 if not stream else '"server_error"' in body)), (r.status_code, body)
    monkeypatch.undo()
    health = httpx.get(served[0] + "/health").json()
    assert health["active"] == 0 and health["queued"] == 0  # no slot left behind
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")
