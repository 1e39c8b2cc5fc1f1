"""kvtrace serve over HTTP: the real OpenAI client (streaming and not), raw HTTP for bad input, disconnects,
the queue bound, the API key, and a bounded load test whose every answer equals a solo run."""

from __future__ import annotations

import concurrent.futures
import json
import resource
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from tests.conftest import make_tiny_hf_dir
from tests.runtime.test_slots import assert_free_rows_hold_their_tokens

import kvtrace
from kvtrace.runtime.generate import Sampling, generate
from kvtrace.serve.app import app_for
from kvtrace.sources.chat import apply_chat_template

MAX_SEQ = 96
SLOTS = 4


@dataclass
class Server:
    url: str
    app: Any
    solo: Any  # the same model exported for one conversation: the reference
    art: Any

    @property
    def worker(self):
        return self.app.state.worker

    def solo_text(self, ids: list[int], max_tokens: int, sampling: Sampling | None = None) -> tuple[str, int]:
        tok = self.solo.tokenizer()
        res = generate(self.solo.session(), ids, max_new_tokens=max_tokens, sampling=sampling,
                       eos_ids=self.solo.manifest.eos_ids, decode_text=lambda t: tok.decode(t, skip_special_tokens=True))
        return res.text, len(res.tokens)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        m, tok = self.solo.manifest, self.solo.tokenizer()
        text = apply_chat_template(m.chat_template, messages, bos_token=tok.id_to_token(m.bos_id),
                                   eos_token=tok.id_to_token(m.eos_ids[0]))
        return tok.encode(text, add_special_tokens=False).ids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(app: Any) -> tuple[str, Any, threading.Thread]:
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    make_tiny_hf_dir(d, words_only=True, max_position_embeddings=128)
    kvtrace.export(str(d), d / "solo.kvt", max_seq_len=MAX_SEQ, prefill_logits="last")
    kvtrace.export(str(d), d / "slots.kvt", max_seq_len=MAX_SEQ, slots=SLOTS, prefill_logits="last")
    return d


@pytest.fixture(scope="module")
def server(artifacts):
    art = kvtrace.load(artifacts / "slots.kvt")
    # chunked prefill: chat prompts (> 16 tokens) are prefilled 16 tokens per call between decode steps, short
    # completion prompts whole; every answer is still checked against a solo run
    app = app_for(art, max_queue=6, prefill_chunk=16)
    url, srv, thread = start_server(app)
    yield Server(url, app, kvtrace.load(artifacts / "solo.kvt"), art)
    srv.should_exit = True
    thread.join(30)


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(server: Server, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while server.worker.running or server.worker.queued:
        assert time.time() < deadline, f"not idle: {server.worker.running} running, {server.worker.queued} queued"
        time.sleep(0.02)


def test_chat_completion_equals_a_solo_run(server, client):
    msgs = [{"role": "user", "content": "hello the cat"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    text, n = server.solo_text(server.chat_ids(msgs), 10)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(server.chat_ids(msgs)), n, len(server.chat_ids(msgs)) + n)
    assert r.model == server.art.manifest.model_name  # the served model's id
    # several messages, a system one included, content as text parts
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "world"},
            {"role": "assistant", "content": "cat"}, {"role": "user", "content": [{"type": "text", "text": "sat"}]}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=7, temperature=0)
    flat = [{**m, "content": "sat"} if isinstance(m["content"], list) else m for m in msgs]
    assert r.choices[0].message.content == server.solo_text(server.chat_ids(flat), 7)[0]


def test_a_chats_next_turn_is_prefilled_after_the_conversation_its_slot_holds(server, client):
    """The prefix cache over HTTP: turn 2 re-sends turn 1 and its answer; the slot that served turn 1 still holds
    them, so only the new tokens are prefilled (usage.prompt_tokens_details.cached_tokens, /metrics), and the
    answer is still the solo run's."""
    def cached_total() -> float:
        line = [x for x in httpx.get(server.url + "/metrics").text.splitlines()
                if x.startswith("kvtrace_prompt_tokens_cached_total ")]
        return float(line[0].split()[1])

    wait_idle(server)
    msgs = [{"role": "user", "content": "the cat sat on the world"}]
    r1 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "hello"}]
    before = cached_total()
    r2 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    first, second = server.chat_ids(msgs[:1]), server.chat_ids(msgs)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert len(first) <= cached < len(second) == r2.usage.prompt_tokens, "turn 1's prompt at least was kept"
    assert r2.choices[0].message.content == server.solo_text(second, 6)[0]
    assert cached_total() - before == cached


def test_logprobs_chat_and_completions_streaming_and_not(server, client):
    """logprobs over HTTP: one entry per generated token, its top alternatives most likely first (greedy: the token
    itself), the same streamed and not; the legacy completions shape with text offsets."""
    msgs = [{"role": "user", "content": "hello the cat"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.logprob == e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob and e.logprob <= 0
        assert bytes(e.bytes).decode() == e.token
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # this prompt again: its slot's prefix kept,
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)  # its end prefilled
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content

    c = client.completions.create(model="tiny", prompt="hello world the", max_tokens=6, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) == 3 and max(top.values()) == p for top, p in zip(lp.top_logprobs, lp.token_logprobs,
                                                                           strict=True))
    parts = list(client.completions.create(model="tiny", prompt="hello world the", max_tokens=6, temperature=0,
                                           logprobs=3, stream=True))
    offsets = [o for p in parts if p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_chat_streaming_equals_non_streaming(server, client):
    msgs = [{"role": "user", "content": "the world sat"}]
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == server.solo_text(server.chat_ids(msgs), 12)[0] and finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1 and chunks[1].object == "chat.completion.chunk"


def test_completions_streaming_and_not(server, client):
    prompt = "hello world the"
    ids = server.solo.tokenizer().encode(prompt, add_special_tokens=True).ids
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0)
    assert r.choices[0].text == server.solo_text(ids, 9)[0] and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].finish_reason == "length"
    parts = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
    # the default max_tokens of the completions endpoint is 16; token ids are a prompt too
    r = client.completions.create(model="tiny", prompt=ids, temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].text == server.solo_text(ids, 16)[0]


def test_stop_sequences_and_seeded_sampling(server, client):
    msgs = [{"role": "user", "content": "cat"}]
    full = server.solo_text(server.chat_ids(msgs), 20)[0]
    stop = full.split()[4]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[: full.index(stop)]
    sampled = [client.chat.completions.create(model="tiny", messages=msgs, max_tokens=15, temperature=1.0, top_p=0.9,
                                              seed=11).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1] == server.solo_text(server.chat_ids(msgs), 15,
                                                        Sampling(temperature=1.0, top_p=0.9, seed=11))[0]


def test_penalties_over_http_equal_a_solo_run(server, client):
    msgs = [{"role": "user", "content": "cat"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0, frequency_penalty=1.5,
                                       presence_penalty=0.5, extra_body={"repetition_penalty": 1.3})
    want = server.solo_text(server.chat_ids(msgs), 20, Sampling(frequency_penalty=1.5, presence_penalty=0.5,
                                                               repetition_penalty=1.3))[0]
    assert r.choices[0].message.content == want != server.solo_text(server.chat_ids(msgs), 20)[0]
    for body, words in [({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2.0, 2.0]"),
                        ({"repetition_penalty": 0}, "repetition_penalty must be in (0.0, inf]"),
                        ({"presence_penalty": "high"}, "presence_penalty must be a number")]:
        bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, **body})
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], bad.text


def test_logit_bias_over_http_equals_a_solo_run(server, client):
    msgs = [{"role": "user", "content": "cat"}]
    plain = server.solo_text(server.chat_ids(msgs), 12)[0]
    ban = {server.solo.tokenizer().token_to_id(w): -100 for w in plain.split()[:2]}  # its first two words, banned
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                       logit_bias={str(k): v for k, v in ban.items()})
    want = server.solo_text(server.chat_ids(msgs), 12, Sampling(logit_bias=ban))[0]
    assert r.choices[0].message.content == want != plain
    assert not set(want.split()) & set(plain.split()[:2])
    for bias, words in [([1], "logit_bias must be an object"), ({"x": 1}, "keys are token ids"),
                        ({"3": 101}, "logit_bias[3] must be a number in [-100, 100]"),
                        ({"3": "a"}, "must be a number"), ({"99": 1}, "token id 99, outside the vocabulary [0, 8)")]:
        bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "logit_bias": bias})
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], bad.text


def test_tokenize_and_detokenize_as_vllm_and_llama_cpp_offer_them(server):
    tok = server.solo.tokenizer()
    post = lambda path, body: httpx.post(server.url + path, json=body)  # noqa: E731
    r = post("/tokenize", {"prompt": "hello the cat"}).json()
    want = tok.encode("hello the cat", add_special_tokens=True).ids
    assert r == {"tokens": want, "count": len(want), "max_model_len": MAX_SEQ}
    assert post("/tokenize", {"content": "hello the cat", "add_special": False}).json()["tokens"] == \
        tok.encode("hello the cat", add_special_tokens=False).ids  # llama.cpp's spelling
    msgs = [{"role": "user", "content": "hello the cat"}]
    assert post("/tokenize", {"messages": msgs}).json()["tokens"] == server.chat_ids(msgs)  # as chat renders it
    back = post("/detokenize", {"tokens": want}).json()
    assert back["prompt"] == back["content"] == tok.decode(want, skip_special_tokens=False)
    for path, body, words in [("/tokenize", {"prompt": 3}, "prompt (a string) or messages"),
                              ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "true or false"),
                              ("/detokenize", {"tokens": [1, "x"]}, "array of token ids"),
                              ("/detokenize", {"tokens": [99]}, "token id 99 is outside the vocabulary [0, 8)")]:
        bad = post(path, body)
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], bad.text


def test_models_health_and_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.art.manifest.model_name]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["slots"] == SLOTS and h["max_seq_len"] == MAX_SEQ
    text = httpx.get(server.url + "/metrics").text
    for series in ("kvtrace_requests_total", "kvtrace_prompt_tokens_total", "kvtrace_completion_tokens_total",
                   "kvtrace_queue_depth", "kvtrace_prefill_seconds_bucket", "kvtrace_decode_step_seconds_count",
                   "kvtrace_time_to_first_token_seconds_sum"):
        assert series in text


BAD = [  # (body, status, words the message must contain)
    (b"{not json", 400, "not valid JSON"),
    (b"", 400, "empty"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"messages": []}), 400, "must not be empty"),
    (json.dumps({"messages": "hi"}), 400, "messages must be an array"),
    (json.dumps({"model": "m"}), 400, "messages is required"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), 400, "role must be one of"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}), 400, "content must be a string"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400, "text part"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}), 400, "max_tokens must be an integer"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}), 400, "max_tokens must be"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}), 400, "temperature must be a number"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}), 400, "temperature must be in"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}), 400, "top_p must be in"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}), 400, "stream must be true or false"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2}), 400, "n=2 is not supported"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}), 400, "needs logprobs: true"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}), 400,
     "top_logprobs must be an integer in [0, 20]"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}), 400, "logprobs must be true or false"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}), 400, "stop must be a string"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}), 400, "at most 4"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}), 400, "seed must be an integer"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": 7}), 400, "model must be a string"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}), 400, "tools"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}), 400,
     "only allowed with stream"),
    (json.dumps({"messages": [{"role": "user", "content": " ".join(["cat"] * 200)}]}), 400, "max_seq_len=96"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}), 400, "max_seq_len=96"),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD, ids=[w for _, _, w in BAD])
def test_bad_chat_requests_get_openai_shaped_4xx(server, body, status, words):
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error" and set(err) == {
        "message", "type", "param", "code"}


def test_bad_completions_routes_and_sizes(server):
    post = lambda path, body: httpx.post(server.url + path, content=body)  # noqa: E731
    for body, words in [({"prompt": ""}, "prompt is empty"), ({"prompt": ["a", "b"]}, "one prompt"),
                        ({"prompt": [1, "x"]}, "prompt must be"), ({}, "prompt is required"),
                        ({"prompt": "hi", "echo": True}, "echo=true is not supported"),
                        ({"prompt": "hi", "logprobs": 6}, "logprobs must be an integer in [0, 5]"),
                        ({"prompt": "hi", "logprobs": True}, "logprobs must be an integer"),
                        ({"prompt": [3, 99]}, "outside the vocabulary"),
                        ({"prompt": "cat " * 120}, "max_seq_len=96")]:
        r = post("/v1/completions", json.dumps(body))
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "method not allowed" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and "/v1/chat/completions" in r.json()["error"]["message"]
    r = post("/v1/completions", b"x" * (5 << 20))
    assert r.status_code == 413 and "body" in r.json()["error"]["message"]
    assert server.worker.running == 0 and httpx.get(server.url + "/health").json()["status"] == "ok"


def slowed(server: Server, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make every decode step take ``seconds`` (the model thread stays the only caller)."""
    engine = server.app.state.engine
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def test_a_client_that_disconnects_frees_its_slot(server, monkeypatch):
    wait_idle(server)
    slowed(server, monkeypatch, 0.05)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 60, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        data = (line for line in r.iter_lines() if line.startswith("data: "))
        next(data)  # the role chunk
        assert '"content": "' in next(data)  # a token: the request holds a slot now
        assert server.worker.running == 1
    wait_idle(server, timeout=3)  # 60 tokens would take 3 s more
    # not streaming: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
    wait_idle(server, timeout=3)
    engine = server.app.state.engine
    assert engine.active == () and engine.free == tuple(range(SLOTS))  # freed (kept for the prefix cache)


def test_a_full_queue_is_429(server, monkeypatch):
    wait_idle(server)
    slowed(server, monkeypatch, 0.1)  # every request holds its slot for 7 s
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 70, "stream": True}
    streams = []
    try:
        for _ in range(SLOTS + 6):  # every slot busy, then the queue's bound of 6
            cm = httpx.stream("POST", server.url + "/v1/chat/completions", json=body)
            r = cm.__enter__()
            assert r.status_code == 200
            streams.append(cm)
        r = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 429 and "busy" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
    wait_idle(server, timeout=5)  # closing the streams cancelled them all


def test_api_key_is_enforced(artifacts):
    from starlette.testclient import TestClient

    app = app_for(kvtrace.load(artifacts / "slots.kvt"), api_key="sk-test")
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}):
            r = c.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401 and c.get("/metrics").status_code == 401
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-test"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_load_32_requests_from_8_clients_all_equal_solo_runs(server):
    """32 requests of different lengths from 8 concurrent clients, streaming and not, chat and completions; every
    answer equals a solo run; afterwards every slot is free and holds its last conversation, nothing queued, memory
    back to idle."""
    from openai import OpenAI

    wait_idle(server)
    words = ["hello", "world", "the", "cat", "sat"]
    g = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(32):
        n = int(torch.randint(1, 30, (1,), generator=g))
        text = " ".join(words[int(j)] for j in torch.randint(0, 5, (n,), generator=g))
        jobs.append((i, text, 5 + int(torch.randint(0, 40, (1,), generator=g)), i % 4))
    rss0 = _rss_mib()
    requests0 = server.app.state.metrics.counter("requests_total", endpoint="chat", status="200")
    prefills0 = server.app.state.metrics.histogram_count("prefill_seconds")

    def run(job):
        _i, text, max_tokens, kind = job
        c = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": text}]
        if kind == 0:
            return c.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, temperature=0
                                             ).choices[0].message.content
        if kind == 1:
            s = c.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, temperature=0, stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
        if kind == 2:
            return c.completions.create(model="m", prompt=text, max_tokens=max_tokens, temperature=0).choices[0].text
        s = c.completions.create(model="m", prompt=text, max_tokens=max_tokens, temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in s)

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(run, jobs))
    seconds = time.time() - t0
    tok = server.solo.tokenizer()
    mismatches = []
    for (i, text, max_tokens, kind), got in zip(jobs, answers, strict=True):
        ids = (server.chat_ids([{"role": "user", "content": text}]) if kind < 2
               else tok.encode(text, add_special_tokens=True).ids)
        want = server.solo_text(ids, max_tokens)[0]
        if got != want:
            mismatches.append((i, kind, got, want))
    print(f"load test: 32 requests from 8 clients in {seconds:.1f}s, {len(mismatches)} mismatches")
    assert mismatches == []
    wait_idle(server)
    assert server.app.state.engine.active == () and server.worker.queued == 0
    assert_free_rows_hold_their_tokens(server.app.state.engine, server.solo)  # then reset: all initial values
    assert server.app.state.metrics.counter("requests_total", endpoint="chat", status="200") - requests0 == 16
    assert server.worker.steps > 0 and server.app.state.metrics.histogram_count("decode_batch_rows") > 0
    assert server.app.state.metrics.histogram_count("prefill_seconds") - prefills0 > 32, "long prompts were chunked"
    assert _rss_mib() - rss0 < 64, "memory returned to about where it was"
    assert seconds < 120


def test_cli_serve_refuses_a_parallel_its_artifact_lacks(artifacts, capsys):
    from kvtrace.cli.main import main

    assert main(["serve", str(artifacts / "slots.kvt"), "--parallel", "2", "--port", "1"]) == 2
    assert "holds 4 conversation slot(s), --parallel asks for 2" in capsys.readouterr().err
    assert main(["serve", str(artifacts / "solo.kvt"), "--max-seq-len", "999"]) == 2
    assert "more than solo.kvt's cache holds (96)" in capsys.readouterr().err
    assert main(["serve", str(artifacts / "slots.kvt"), "--kv-dtype", "int8", "--port", "1"]) == 2
    assert ("slots.kvt holds a float32 KV cache, --kv-dtype asks for int8: export it with `kvtrace export SOURCE "
            "--slots 4 --kv-dtype int8`") in capsys.readouterr().err
    assert main(["serve", str(artifacts / "slots.kvt"), "--quant", "int8", "--port", "1"]) == 2
    assert ("slots.kvt holds unquantized weights, --quant asks for int8: export it with `kvtrace export SOURCE "
            "--slots 4 --quant int8`") in capsys.readouterr().err


def test_a_source_is_served_with_int8_weights(artifacts, tmp_path, monkeypatch):
    """`kvtrace serve SOURCE --quant int8 --parallel 2`: the cached slots artifact holds int8 weights, and a slot
    answers as a solo run of the same int8 weights."""
    import argparse

    from kvtrace.cli.serve import load_served
    from kvtrace.cli.ui import UI
    from kvtrace.runtime.slots import SlotRequest

    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    args = argparse.Namespace(model=str(artifacts), parallel=2, backend="exported", max_seq_len=48, dtype="float32",
                              kv_dtype="auto", quant="int8", quant_group_size=None, quant_head=True, huge_pages=False,
                              expected_sha256=None)
    art = load_served(args, UI(quiet=True, json_mode=False))
    assert art.manifest.quant.scheme == "int8" and art.manifest.programs["decode"].slots
    kvtrace.export(str(artifacts), tmp_path / "solo.kvt", max_seq_len=48, prefill_logits="last", quant="int8")
    solo = kvtrace.load(tmp_path / "solo.kvt")
    engine = art.slot_engine()
    ids = [3, 4, 5, 6, 7, 3]
    _, ev = engine.admit(SlotRequest(ids, max_tokens=12))
    tokens = [ev.token]
    while engine.active:
        tokens += [e.token for e in engine.step() if e.token is not None]
    assert tokens == generate(solo.session(), ids, max_new_tokens=12).tokens
    from kvtrace.cli.serve import rounding_steps

    assert rounding_steps(art) == ["int8 weights with bfloat16 activations"]


def test_a_hybrid_sliding_source_is_served_with_an_int8_cache(tmp_path, monkeypatch, capsys):
    """`kvtrace serve SOURCE --parallel 2 --kv-dtype int8` on a Gemma 2 (sliding and full layers, window 8):
    the cached slots artifact holds an int8 cache, and concurrent answers longer than the window equal solo runs
    of the same int8 cache."""
    import argparse

    import transformers
    from tests.conftest import FAMILY_ARCHS, TINY, WORDS

    from kvtrace.cli.serve import load_served
    from kvtrace.cli.ui import UI

    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "gemma2"
    d.mkdir()
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(**{**TINY, **FAMILY_ARCHS["gemma2"][2], "vocab_size": len(WORDS),
                                       "max_position_embeddings": 128})
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight[:3] = -1.0  # words only (the head is tied: special tokens embed oddly, never picked)
        model.lm_head.weight[3:] *= 20
    make_tiny_hf_dir(d, model=model)
    args = argparse.Namespace(model=str(d), parallel=2, backend="exported", max_seq_len=64, dtype="float32",
                              kv_dtype="int8", huge_pages=False, expected_sha256=None)
    art = load_served(args, UI(quiet=True, json_mode=False))
    assert (art.cache_spec.kv_dtype, art.cache_spec.batch_size, art.manifest.programs["decode"].slots) == ("int8", 2, True)
    assert {layer.kind.value for layer in art.cache_spec.layers} == {"sliding", "full"}
    kvtrace.export(str(d), tmp_path / "solo.kvt", max_seq_len=64, prefill_logits="last", kv_dtype="int8")
    url, srv, thread = start_server(app_for(art, prefill_chunk=4))
    try:
        ref = Server(url, None, kvtrace.load(tmp_path / "solo.kvt"), art)
        asks = [("hello the cat sat", 20), ("world", 14), ("the cat the cat sat on the world hello", 9)]

        def ask(prompt_tokens):
            prompt, n = prompt_tokens
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0}
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, asks))
        for (prompt, n), got in zip(asks, answers, strict=True):
            text, count = ref.solo_text(ref.chat_ids([{"role": "user", "content": prompt}]), n)
            assert got["choices"][0]["message"]["content"] == text and got["usage"]["completion_tokens"] == count == n
    finally:
        srv.should_exit = True
        thread.join(30)
    # the CLI says, as it starts, that batched answers of an int8 cache may leave solo ones at near-ties
    from kvtrace.cli.main import main
    from kvtrace.serve import app as serve_app

    monkeypatch.setattr(serve_app, "serve", lambda app, **kw: None)
    assert main(["serve", str(art.path), "--port", "1"]) == 0
    err = capsys.readouterr().err
    assert "int8 KV cache: an answer can leave the one `kvtrace run` gives where two tokens nearly tie" in err


def test_serve_picks_the_backend_for_the_weights_it_is_asked_to_keep(monkeypatch):
    """A source served with GGUF blocks compiles on aoti (a decode program of one token a row); otherwise on
    aoti-packed; a --backend given is kept. The quantization reaches the build."""
    import argparse
    from types import SimpleNamespace

    from kvtrace.artifact import store
    from kvtrace.cli.serve import load_served
    from kvtrace.cli.ui import UI

    asked = []
    monkeypatch.setattr(store, "cached_artifact", lambda source, **kw: asked.append(kw) or SimpleNamespace(
        cache_hit=True, path="x.kvt", artifact="art", seconds=0.0))
    for quant, backend in (("gguf", None), ("int8", None), ("none", None), ("gguf", "exported")):
        args = argparse.Namespace(model="m.gguf", parallel=4, backend=backend, max_seq_len=None, dtype="float32",
                                  kv_dtype="auto", quant=quant, quant_group_size=None, quant_head=True,
                                  huge_pages=False, expected_sha256=None)
        assert load_served(args, UI(quiet=True, json_mode=False)) == "art"
    assert [(kw["backend"], kw.get("quant")) for kw in asked] == [
        ("aoti", "gguf"), ("aoti-packed", "int8"), ("aoti-packed", None), ("exported", "gguf")]
    assert all(kw["slots"] == 4 and kw["max_seq_len"] == 1024 for kw in asked)


def test_the_cli_serves_an_artifact_in_its_own_process(artifacts):
    import subprocess
    import sys

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "serve", str(artifacts / "slots.kvt"), "--port",
                             str(port), "--api-key", "sk-cli", "--prefill-chunk", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-cli"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        prompt = r.json()["usage"]["prompt_tokens"]
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-cli"}).text
        calls = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("kvtrace_prefill_seconds_count"))
        assert calls == -(-prompt // 3), "--prefill-chunk 3: the prompt prefilled 3 tokens per call"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert f"on http://127.0.0.1:{port}/v1" in err and "4 conversation slot(s), max_seq_len 96" in err
    assert "prompts prefilled 3 tokens per step" in err
