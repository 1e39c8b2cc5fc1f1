"""serve.tools: OpenAI's tools / tool_choice checked, the constraint an answer is held to, history rendered as the
JSON the model answers in, and answers read back into tool calls."""

from __future__ import annotations

import json

import pytest

from kvtrace.runtime.grammar import ConstraintKind
from kvtrace.serve.protocol import ApiError, _messages
from kvtrace.serve.tools import parse_tools, read_answer, render_history

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_choices_decide_what_the_answer_may_be():
    auto = parse_tools({"tools": [WEATHER, TIME]})
    assert auto.choice == "auto" and auto.parallel and [f[0] for f in auto.offered()] == ["get_weather", "get_time"]
    schema = json.loads(auto.constraint().text)
    assert auto.constraint().kind is ConstraintKind.JSON_SCHEMA and len(schema["anyOf"]) == 2  # calls or a response
    assert schema["anyOf"][1]["required"] == ["response"]
    required = json.loads(parse_tools({"tools": [WEATHER], "tool_choice": "required",
                                       "parallel_tool_calls": False}).constraint().text)
    assert required["required"] == ["tool_calls"] and required["properties"]["tool_calls"]["maxItems"] == 1
    assert required["properties"]["tool_calls"]["items"]["properties"]["name"] == {"const": "get_weather"}
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert [f[0] for f in named.offered()] == ["get_time"] and "Call the tool get_time" in named.system_text()
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    loose = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"a": {"type": "string"}}}}}
    params = json.loads(parse_tools({"tools": [loose]}).functions[0][2])
    assert params["additionalProperties"] is False  # only the declared arguments, unless the schema says otherwise
    open_ = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": True}}}
    assert json.loads(parse_tools({"tools": [open_]}).functions[0][2])["additionalProperties"] is True


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": {"a": 1}}, "tools", "tools must be an array"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "calls functions only"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "1-64 letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters",
     "JSON schema object"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among tools ['get_weather']"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto", "required"'),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
])
def test_malformed_tools_are_refused_naming_the_field(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert words in str(e.value) and e.value.param == param


def test_history_is_rendered_as_the_json_answers_are_written_in():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = _messages({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call, {**call, "id": "call_2", "function": {
            "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14 C"},
    ]})
    out = render_history(msgs, parse_tools({"tools": [WEATHER]}))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]  # results: one user turn
    assert out[0]["content"].startswith("Be brief.\n\nYou can call these tools") and "get_weather" in out[0]["content"]
    said, calls = out[2]["content"].split("\n", 1)  # what the assistant said, then its calls (with their ids)
    assert said == "Checking." and json.loads(calls) == {"tool_calls": [
        {"id": "call_1", "name": "get_weather", "arguments": {"city": "Oslo"}},
        {"id": "call_2", "name": "get_weather", "arguments": {"city": "Rome"}}]}
    assert json.loads(out[3]["content"]) == {"tool_results": [{"tool_call_id": "call_1", "content": "-3 C"},
                                                              {"tool_call_id": "call_2", "content": "14 C"}]}
    plain = render_history(_messages({"messages": [{"role": "user", "content": "hi"}]}), None)
    assert plain == [{"role": "user", "content": "hi"}]  # no tools: as before
    for bad in ("{oops", "[" * 100_000):  # nested past the recursion limit: a 400 too, not a 500
        with pytest.raises(ApiError, match=r"arguments is not JSON"):
            _messages({"messages": [{"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": bad}}]}]})


def test_answers_are_read_back_into_calls_or_content():
    content, calls = read_answer('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert calls[0].id.startswith("call_") and calls[0].openai(0)["index"] == 0
    assert read_answer('{"response": "It is cold."}') == ("It is cold.", [])
    assert read_answer('{"tool_calls": [{"name": "get_w') == ('{"tool_calls": [{"name": "get_w', [])  # cut short


def test_parameters_that_refer_into_themselves_keep_their_meaning():
    """pydantic writes nested models as $defs + $ref; a recursive schema refers to its root "#". Inside the answer's
    schema those pointers must still resolve to the tool's own schema."""
    from tests.conftest import byte_tokenizer

    from kvtrace.runtime.grammar import Grammar

    person = {"type": "function", "function": {"name": "add_person", "parameters": {
        "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]}},
        "type": "object", "properties": {"name": {"type": "string"}, "pet": {"$ref": "#/$defs/Pet"}},
        "required": ["name", "pet"]}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["kids"]}}}
    tok = byte_tokenizer()
    grammar = Grammar(parse_tools({"tools": [person, tree], "tool_choice": "required"}).constraint(), tok, [2])

    def ok(text: str) -> bool:
        ids = tok.encode(text).ids
        return grammar.start()._m.validate_tokens(ids) == len(ids)

    call = '{"tool_calls": [{"name": %s, "arguments": %s}]}'
    assert ok(call % ('"add_person"', '{"name": "Al", "pet": {"kind": "cat"}}'))
    assert not ok(call % ('"add_person"', '{"name": "Al", "pet": {"kind": "cow"}}'))
    assert ok(call % ('"tree"', '{"kids": [{"kids": []}, {"kids": [{"kids": []}]}]}'))
    assert not ok(call % ('"tree"', '{"kids": [{"tool_calls": []}]}'))  # "#" is the tool's root, not the answer's
