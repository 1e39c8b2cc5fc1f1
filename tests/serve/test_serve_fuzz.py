"""Fuzz: random request bodies for both generation endpoints are answered 200 or a 4xx in OpenAI's error shape —
never a 500, never a dead server; every 200 is well formed. In-process (Starlette's TestClient) on a tiny
slots artifact."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import make_tiny_hf_dir

import kvtrace
from kvtrace.serve.app import app_for

FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=150,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["hello the cat", "", "user", "text", "\x00", "😀"]))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=10)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), JSON),
                                 "content": st.one_of(st.sampled_from(["hello", "world the", ""]), JSON,
                                                      st.lists(st.fixed_dictionaries(
                                                          {"type": st.sampled_from(["text", "image_url"]),
                                                           "text": st.one_of(st.just("cat"), JSON)}), max_size=2))})
FIELDS = {
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON),
    "prompt": st.one_of(st.sampled_from(["hello world", "cat sat"]), st.lists(st.integers(-3, 12), max_size=5), JSON),
    "max_tokens": st.one_of(st.integers(-2, 120), JSON),
    "max_completion_tokens": st.one_of(st.integers(0, 8), st.none()),
    "temperature": st.one_of(st.floats(-1, 3), JSON),
    "top_p": st.one_of(st.floats(-0.5, 1.5), JSON),
    "top_k": st.one_of(st.integers(-1, 50), JSON),
    "seed": st.one_of(st.integers(-(2**64), 2**64), JSON),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6), JSON),
    "stream": st.one_of(st.booleans(), JSON),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "n": st.one_of(st.integers(0, 3), JSON),
    "presence_penalty": st.one_of(st.floats(-3, 3), JSON), "frequency_penalty": st.one_of(st.floats(-3, 3), JSON),
    "repetition_penalty": st.one_of(st.floats(-1, 3), JSON),
    "model": st.one_of(st.text(max_size=8), JSON),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 7), JSON), "top_logprobs": st.one_of(st.integers(-1, 22), JSON),
    "tools": JSON, "response_format": JSON, "echo": JSON, "ignore_eos": JSON, "logit_bias": JSON,
    "unknown_field": JSON,
}
GOOD_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                      "content": st.sampled_from(["hello", "world the", "", "cat sat sat"])})
GOOD_FIELDS = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(1, 8),
    "seed": st.integers(0, 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "stream": st.booleans(), "max_completion_tokens": st.integers(1, 8), "n": st.just(1), "ignore_eos": st.booleans(),
    "model": st.text(max_size=8), "user": st.text(max_size=5), "unknown_field": JSON,
}
VALID = st.fixed_dictionaries({"messages": st.lists(GOOD_MESSAGE, min_size=1, max_size=3),
                               "prompt": st.sampled_from(["hello world", "cat", "the the the"]),
                               "max_tokens": st.integers(1, 8)}, optional=GOOD_FIELDS)
# a valid body with one field replaced by anything: the error must name that field, or the body still works
MUTATED = st.tuples(VALID, st.sampled_from(sorted(FIELDS)), JSON).map(lambda t: {**t[0], t[1]: t[2]})
BODY = st.one_of(VALID, MUTATED, st.fixed_dictionaries({}, optional=FIELDS), JSON, st.binary(max_size=30))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from starlette.testclient import TestClient

    d = tmp_path_factory.mktemp("fuzz_serve")
    make_tiny_hf_dir(d, words_only=True, max_position_embeddings=128)
    kvtrace.export(str(d), d / "slots.kvt", max_seq_len=64, slots=2, prefill_logits="last")
    app = app_for(kvtrace.load(d / "slots.kvt"), max_queue=4)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@FUZZ
@given(body=BODY, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_random_bodies_get_200_or_an_openai_4xx(client, body, path):
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), (r.status_code, r.text[:300])
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])
    else:
        out = r.json()
        assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
        assert out["choices"][0]["finish_reason"] in ("stop", "length")
    assert client.get("/health").json()["status"] == "ok"
