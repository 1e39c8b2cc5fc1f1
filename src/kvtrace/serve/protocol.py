"""The OpenAI API's request and response shapes: bodies checked into a ``SlotRequest``, responses built.

Every malformed body is an ``ApiError`` (HTTP 4xx, in OpenAI's error shape ``{"error": {"message",
"type", "param", "code"}}``) naming the field, what it must be and what was found. Known fields must have
their documented types; unknown fields are ignored (as vLLM and llama.cpp do, so clients sending newer
parameters keep working); known parameters kvtrace does not implement (``n`` > 1, the legacy ``functions``,
``echo``, ...) are refused by name rather than silently ignored. ``tools`` / ``tool_choice``: ``serve.tools``.
Structured output: ``response_format`` (OpenAI's), or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` (Lark) or llama.cpp's ``json_schema`` / ``grammar`` (GBNF); one per request. Three extensions other servers share:
``top_k``, ``repetition_penalty`` and ``ignore_eos`` (generate past the end-of-turn token, for benchmarks).
``presence_penalty`` / ``frequency_penalty`` (OpenAI's) and ``repetition_penalty`` are ``Sampling``'s.

Log-probabilities (chat: ``logprobs: true`` and ``top_logprobs`` 0-20; completions: ``logprobs`` 0-5) are the
model's own (``TokenLogprobs``: the log-softmax of its logits, before temperature and top-k/p), per generated
token; a token's text is what it adds to the text after the token before it (``Renderer.token_text``), so the
entries of an answer join to its text; a character split over several tokens shows as U+FFFD in each (its
``bytes`` are those of that text).

Chat prompts are rendered with the artifact's own chat template (``sources.chat``), exactly as
``kvtrace run --prompt`` renders its one user message, so a one-message chat equals ``kvtrace run``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtrace._errors import KvtraceError, UnsupportedError, UsageError
from kvtrace.runtime.generate import MAX_LOGIT_BIAS, MAX_PENALTY, Sampling
from kvtrace.runtime.grammar import Constraint, Grammar
from kvtrace.runtime.slots import MAX_TOP_LOGPROBS, FinishReason, SlotRequest, TokenLogprobs
from kvtrace.serve.tools import ToolCall, Tools, assistant_calls, parse_tools, render_history

__all__ = ["MAX_STOP", "ApiError", "Prompted", "Renderer", "chat_request", "completion_request", "detokenize",
           "error_body", "tokenize"]

MAX_STOP = 4  # OpenAI's bound on stop sequences
GRAMMAR_CACHE = 64  # compiled response formats a server keeps (each ~1 ms to compile, a few KiB)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions endpoint's documented default
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(UsageError):
    """A request the API refuses: ``status`` (4xx), OpenAI's error ``type``, the offending ``param``, a ``code``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or an ApiError saying what was wrong with it."""
    if not raw:
        raise ApiError("the request body is empty; send a JSON object (Content-Type: application/json)")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(f"the request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got a JSON {_json_type(body)}")
    return body


def _json_type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(v), type(v).__name__)


def _short(v: Any, n: int = 60) -> str:
    r = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _number(body: dict[str, Any], name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(f"{name} must be a number, got {_short(v)}", param=name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ApiError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=name)
    return float(v)


def _int(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise ApiError(f"{name} must be an integer, got {_short(v)}", param=name)
    if v < lo or (hi is not None and v > hi):
        raise ApiError(f"{name} must be an integer {'>= ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}, got {v}",
                       param=name)
    return v


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(f"{name} must be true or false, got {_short(v)}", param=name)
    return v


def _refuse_unsupported(body: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Known parameters kvtrace does not implement: accepted only at their no-op value."""
    for name, ok in defaults.items():
        v = body.get(name)
        if v is None or v == ok or (isinstance(ok, tuple) and v in ok):
            continue
        raise ApiError(f"{name}={_short(v)} is not supported by kvtrace serve (leave it out)", param=name,
                       code="unsupported_parameter")


_UNSUPPORTED_COMMON = {"n": 1, "best_of": 1}
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions endpoint's bound on ``logprobs``
_UNSUPPORTED_CHAT = {**_UNSUPPORTED_COMMON, "functions": [], "function_call": "none", "audio": {}, "prediction": {},
                     "modalities": (["text"],)}
_UNSUPPORTED_COMPLETIONS = {**_UNSUPPORTED_COMMON, "echo": False, "suffix": ""}
# A scored token for a response: its text, its logprob, and the top alternatives as (text, logprob)
Scored = tuple[str, float, tuple[tuple[str, float], ...]]


@dataclass(frozen=True)
class Prompted:
    """A checked request: what the model thread runs, and how to answer it."""

    request: SlotRequest
    stream: bool
    include_usage: bool
    model: str
    tools: Tools | None = None  # tool calls may answer it (serve.tools): the answer is read back before it is sent


class Renderer:
    """Turns prompts into token ids with the artifact's tokenizer and chat template."""

    def __init__(self, tokenizer: Any, template: str | None, bos_id: int | None, eos_ids: Sequence[int],
                 temperature: float = 0.0):
        self.tokenizer, self.template, self.bos_id, self.eos_ids = tokenizer, template, bos_id, tuple(eos_ids)
        self.temperature = temperature  # when a request gives none: the artifact's generation default
        self._grammars: dict[tuple[Constraint, tuple[int, ...]], Grammar] = {}  # the last GRAMMAR_CACHE compiled
        self._tokenizer_json: str | None = None

    def warm(self) -> None:
        """Build llguidance's view of the tokenizer now (a server calls this in a thread as it starts)."""
        from kvtrace.runtime.grammar import warm

        if self.tokenizer is not None:
            warm(self._json(), self.eos_ids)

    def _json(self) -> str:
        """The tokenizer as JSON text, made once (llguidance's views of it are keyed by this string)."""
        if self._tokenizer_json is None:
            self._tokenizer_json = self.tokenizer.to_str()
        return self._tokenizer_json

    def grammar(self, constraint: Constraint, stop_ids: Sequence[int], param: str = "response_format") -> Grammar:
        """``constraint`` compiled for the tokenizer (kept: clients repeat their schemas); an ApiError naming
        ``param`` (where the constraint came from) if it is bad."""
        from kvtrace.runtime.grammar import Grammar

        key = (constraint, tuple(stop_ids))
        if key in self._grammars:
            return self._grammars[key]
        try:
            grammar = Grammar(constraint, self._json(), stop_ids)
        except UnsupportedError as e:
            raise ApiError(f"{param}: {e}", param=param, code="unsupported_parameter") from None
        except UsageError as e:
            raise ApiError(f"{param}: {e}", param=param) from None
        while len(self._grammars) >= GRAMMAR_CACHE:
            self._grammars.pop(next(iter(self._grammars)))
        self._grammars[key] = grammar
        return grammar

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        from kvtrace.sources.chat import apply_chat_template

        if self.template is None:
            raise ApiError("this model has no chat template; use /v1/completions with a plain prompt", status=400)
        name = lambda i: self.tokenizer.id_to_token(i) if i is not None else None  # noqa: E731
        try:
            text = apply_chat_template(self.template, messages, bos_token=name(self.bos_id),
                                       eos_token=name(self.eos_ids[0] if self.eos_ids else None))
        except KvtraceError as e:
            raise ApiError(str(e), param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def token_text(self, prev: int | None, token: int) -> str:
        """What ``token`` adds to the answer's text after ``prev`` (the answer's token before it, None for its first;
        special tokens kept): the text of a log-probability entry. Decoded after one token of context, as
        decoders put spaces between tokens; the first alone, as the answer's text is decoded without the prompt."""
        dec = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        if prev is None:
            return dec([token])
        before, both = dec([prev]), dec([prev, token])
        return both[len(before):] if both.startswith(before) else dec([token])

    def scorer(self) -> Callable[[int, TokenLogprobs], Scored]:
        """For one answer: each generated token in turn and its log-probabilities -> texts for a response (the
        token before it remembered here)."""
        prev: int | None = None

        def score(token: int, lp: TokenLogprobs) -> Scored:
            nonlocal prev
            out = (self.token_text(prev, token), lp.logprob, tuple((self.token_text(prev, i), v) for i, v in lp.top))
            prev = token
            return out

        return score


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError("messages is required: a non-empty array of {role, content}", param="messages")
    if not isinstance(msgs, list):
        raise ApiError(f"messages must be an array of {{role, content}}, got a JSON {_json_type(msgs)}",
                       param="messages")
    if not msgs:
        raise ApiError("messages must not be empty; give at least one {role, content}", param="messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object {{role, content}}, got {_short(m)}", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be one of {list(ROLES)}, got {_short(role)}", param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}} "
                                   f"(this model reads text only), got {_short(part)}", param=f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(f"{where}.content must be a string or an array of text parts, got {_short(content)}",
                           param=f"{where}.content")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["_calls"] = assistant_calls(m, where)  # rendered as the JSON an answer calls tools with
        if role == "tool":
            call_id = m.get("tool_call_id", "")
            if not isinstance(call_id, str):
                raise ApiError(f"{where}.tool_call_id must be a string, got {_short(call_id)}",
                               param=f"{where}.tool_call_id")
            msg["_call_id"] = call_id
        out.append(msg)
    return out


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(f"stop must be a string or an array of strings, got {_short(v)}", param="stop")
    if len(stops) > MAX_STOP:
        raise ApiError(f"stop takes at most {MAX_STOP} sequences, got {len(stops)}", param="stop")
    return tuple(s for s in stops if s)


def _common(body: dict[str, Any], default_max: int | None, renderer: Renderer,
            ids: list[int], logprobs: int | None, tools: Tools | None = None) -> tuple[SlotRequest, bool, bool]:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"model must be a string, got {_short(model)}", param="model")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(f"stream_options must be an object, got {_short(opts)}", param="stream_options")
    if opts is not None and not stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    include_usage = _bool(opts or {}, "include_usage")
    max_tokens = _int(body, "max_completion_tokens", 1)
    legacy = _int(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = legacy if legacy is not None else default_max
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 1)  # not OpenAI's, but llama.cpp's and vLLM's
    seed = _int(body, "seed", -(2**63), 2**63 - 1)
    for name in ("user", "model"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(f"{name} must be a string, got {_short(body[name])}", param=name)
    penalties = {name: v for name in ("presence_penalty", "frequency_penalty")
                 if (v := _number(body, name, -MAX_PENALTY, MAX_PENALTY)) is not None}
    repetition = _number(body, "repetition_penalty", 0.0, math.inf, lo_open=True)  # vLLM's and llama.cpp's
    sampling = Sampling(temperature=renderer.temperature if temperature is None else temperature, top_k=top_k,
                        top_p=top_p, seed=None if seed is None else seed % 2**63,
                        repetition_penalty=1.0 if repetition is None else repetition, logit_bias=_logit_bias(body),
                        **penalties)
    stop_ids = () if _bool(body, "ignore_eos") else renderer.eos_ids  # vLLM's and llama.cpp's extension
    source, constraint = _constraint(body)
    if constraint is not None and _stop(body):
        raise ApiError(f"stop with {source} is not supported by kvtrace serve: a stop string could cut the answer "
                       "short of its constraint and still end as finish_reason stop; leave out one of them",
                       param="stop", code="unsupported_parameter")
    if tools is not None:
        if constraint is not None:
            raise ApiError(f"{source} and tools cannot be combined: an answer that may call tools is held to the "
                           'tool-call JSON; leave out one of them (or send tool_choice: "none")', param=source)
        if logprobs is not None:
            raise ApiError("logprobs with tools is not supported by kvtrace serve (the answer is read back from "
                           "JSON); leave out one of them", param="logprobs", code="unsupported_parameter")
        if _stop(body):
            raise ApiError("stop with tools is not supported by kvtrace serve: a stop string could cut the tool-call "
                           "JSON the answer is read back from; leave out one of them", param="stop",
                           code="unsupported_parameter")
        constraint = tools.constraint()
        source = "tools"
    grammar = None if constraint is None else renderer.grammar(constraint, stop_ids, source)
    req = SlotRequest(ids, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids, stop=_stop(body),
                      logprobs=logprobs, grammar=grammar)
    return req, stream, include_usage


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: {"token id": bias in [-100, 100]} (ids as JSON object keys, so strings)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ApiError(f"logit_bias must be an object mapping token ids to biases, got {_short(v)}", param="logit_bias")
    out = {}
    for key, b in v.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            raise ApiError(f"logit_bias keys are token ids (e.g. \"50256\"), got {_short(key)}", param="logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise ApiError(f"logit_bias[{key}] must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                           f"got {_short(b)}", param="logit_bias")
        if int(key) in out:
            raise ApiError(f"logit_bias names token {int(key)} twice (as {key!r} and another spelling); give each "
                           "token one bias", param="logit_bias")
        out[int(key)] = float(b)
    return out


# Other servers' fields for the same thing, so their clients' code runs unchanged: vLLM's guided decoding and
# llama.cpp's json_schema / grammar (GBNF). At most one constraint per request.
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "json_schema", "grammar")


def _constraint(body: dict[str, Any]) -> tuple[str, Constraint | None]:
    """(the field it came from, the Constraint) of a request's answer, or ("", None); an ApiError naming the field
    when one is malformed or two are given."""
    given = [k for k in CONSTRAINT_FIELDS[1:] if body.get(k) is not None]
    fmt = _response_format(body)
    if fmt is not None:
        given.insert(0, "response_format")
    if len(given) > 1:
        raise ApiError(f"{given[0]} and {given[1]} both constrain the answer; give one of them", param=given[1])
    if not given:
        return "", None
    name = given[0]
    v = body[name]
    try:
        if name == "response_format":
            return name, fmt
        if name in ("guided_json", "json_schema"):
            if not isinstance(v, (dict, str)):
                raise ApiError(f"{name} must be a JSON schema (an object, or its JSON text), got {_short(v)}", param=name)
            return name, Constraint.json_schema(v)
        if name == "guided_choice":
            return name, Constraint.choice(v)
        if not isinstance(v, str):
            raise ApiError(f"{name} must be a string, got {_short(v)}", param=name)
        if name == "guided_regex":
            return name, Constraint.regex(v)
        return name, Constraint.gbnf(v) if name == "grammar" else Constraint.lark(v)
    except UnsupportedError as e:
        raise ApiError(f"{name}: {e}", param=name, code="unsupported_parameter") from None
    except UsageError as e:
        if isinstance(e, ApiError):
            raise
        raise ApiError(f"{name}: {e}", param=name) from None


def _response_format(body: dict[str, Any]) -> Constraint | None:
    """OpenAI's ``response_format`` -> a Constraint (None: text). ``{"type": "json_object"}``: any JSON object;
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: JSON valid under ``schema`` (strict
    or not: kvtrace always enforces it). Also on /v1/completions, as vLLM accepts it."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kinds = ["text", "json_object", "json_schema"]
    if not isinstance(fmt, dict) or fmt.get("type") not in kinds:
        got = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise ApiError(f"response_format must be an object whose type is one of {kinds}, got {_short(got)}",
                       param="response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return Constraint.json_object()
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(f"response_format.json_schema must be an object {{name, schema, strict}}, got {_short(spec)}",
                       param="response_format.json_schema")
    name, schema = spec.get("name"), spec.get("schema")
    if name is not None and not isinstance(name, str):
        raise ApiError(f"response_format.json_schema.name must be a string, got {_short(name)}",
                       param="response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ApiError(f"response_format.json_schema.strict must be true or false, got {_short(spec['strict'])}",
                       param="response_format.json_schema.strict")
    if schema is None:
        return Constraint.json_schema({})  # no schema: any JSON value
    if not isinstance(schema, (dict, bool)):
        raise ApiError(f"response_format.json_schema.schema must be a JSON schema object, got {_short(schema)}",
                       param="response_format.json_schema.schema")
    try:
        return Constraint.json_schema(schema)
    except UsageError as e:  # e.g. the schema false, which nothing is valid under
        raise ApiError(f"response_format.json_schema.schema: {e}", param="response_format.json_schema.schema") from None


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """``logprobs: true`` (and ``top_logprobs``, 0-20, which needs it) -> how many alternatives, or None."""
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top or 0


def chat_request(body: dict[str, Any], renderer: Renderer, model: str) -> Prompted:
    """A /v1/chat/completions body -> the request to run (no temperature: the artifact's default, greedy for
    kvtrace's exports, so an unadorned request answers as ``kvtrace run`` does)."""
    _refuse_unsupported(body, _UNSUPPORTED_CHAT)
    _constraint(body)  # a malformed one: refused before the prompt is rendered
    tools = parse_tools(body)
    messages = _messages(body)
    _validate_scalars(body)
    ids = renderer.chat(render_history(messages, tools))
    req, stream, usage = _common(body, None, renderer, ids, _chat_logprobs(body), tools)
    return Prompted(req, stream, usage, model, tools)


def completion_request(body: dict[str, Any], renderer: Renderer, model: str) -> Prompted:
    """A /v1/completions body (``prompt``: a string, a one-string array, or token ids) -> the request to run."""
    _refuse_unsupported(body, _UNSUPPORTED_COMPLETIONS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("prompt is empty; give some text", param="prompt")
        _validate_scalars(body)
        ids = renderer.text(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        _validate_scalars(body)
        ids = list(prompt)
    elif prompt is None:
        raise ApiError("prompt is required: a string (or an array of token ids)", param="prompt")
    else:
        raise ApiError(f"prompt must be a string, a one-string array or a non-empty array of token ids (one prompt "
                       f"per request), got {_short(prompt)}", param="prompt")
    logprobs = body.get("logprobs")
    if logprobs is False:  # some clients send false for "none"
        logprobs = None
    req, stream, usage = _common(body, COMPLETIONS_DEFAULT_MAX_TOKENS, renderer, ids,
                                 _int({"logprobs": logprobs}, "logprobs", 0, MAX_COMPLETION_LOGPROBS))
    return Prompted(req, stream, usage, model)


def tokenize(body: dict[str, Any], renderer: Renderer, max_seq_len: int) -> dict[str, Any]:
    """POST /tokenize (vLLM's and llama.cpp's): ``prompt`` (or llama.cpp's ``content``) encoded as /v1/completions
    encodes it (``add_special_tokens``, default true), or ``messages`` rendered as /v1/chat/completions renders
    them -> {"tokens", "count", "max_model_len"}: what to count a prompt with, or to find logit_bias ids."""
    if body.get("messages") is not None:
        ids = renderer.chat(render_history(_messages(body), None))
    else:
        text = body.get("prompt", body.get("content"))
        if not isinstance(text, str):
            raise ApiError(f"tokenize takes prompt (a string) or messages, got prompt {_short(text)}", param="prompt")
        add = body.get("add_special_tokens", body.get("add_special", True))
        if not isinstance(add, bool):
            raise ApiError(f"add_special_tokens must be true or false, got {_short(add)}", param="add_special_tokens")
        ids = renderer.tokenizer.encode(text, add_special_tokens=add).ids
    return {"tokens": ids, "count": len(ids), "max_model_len": max_seq_len}


def detokenize(body: dict[str, Any], renderer: Renderer, vocab: int | None) -> dict[str, Any]:
    """POST /detokenize: ``tokens`` (ids in the vocabulary) -> their text, special tokens kept, under vLLM's key
    ``prompt`` and llama.cpp's ``content``."""
    ids = body.get("tokens")
    if (not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ApiError(f"tokens must be an array of token ids, got {_short(ids)}", param="tokens")
    bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise ApiError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    text = renderer.tokenizer.decode(ids, skip_special_tokens=False)
    return {"prompt": text, "content": text}


def _validate_scalars(body: dict[str, Any]) -> None:
    """Type errors in the sampling fields before any tokenization work (``_common`` reads them again)."""
    for name in ("max_tokens", "max_completion_tokens", "seed", "top_k", "top_logprobs"):
        _int(body, name, -(2**63))
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _number(body, name, -math.inf, math.inf)


# --- responses ---------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the slot's cache already held (not prefilled)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(finish: FinishReason | None) -> str | None:
    return None if finish is None else finish.openai


def chat_logprobs(items: Sequence[Scored]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}, ...], "refusal": None}."""
    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(s, lp), "top_logprobs": [entry(a, v) for a, v in top]} for s, lp, top in items],
            "refusal": None}


def completion_logprobs(items: Sequence[Scored], offset: int = 0) -> dict[str, Any]:
    """A completion choice's legacy ``logprobs``: parallel lists of tokens, their logprobs, {token: logprob} of the
    most likely, and each token's character offset in the completion text (from ``offset``)."""
    offsets = []
    for s, _, _ in items:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": [s for s, _, _ in items], "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [dict(top) for _, _, top in items], "text_offset": offsets}


def chat_response(rid: str, model: str, text: str | None, finish: FinishReason | None,
                  usage_: dict[str, Any], logprobs_: dict[str, Any] | None = None,
                  tool_calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    """A chat completion; with ``tool_calls`` the message calls them (content null, finish_reason "tool_calls")."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": None, "tool_calls": [c.openai() for c in tool_calls]}
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs_,
                         "finish_reason": "tool_calls" if tool_calls else finish_reason(finish)}],
            "usage": usage_, "system_fingerprint": None}


def completion_response(rid: str, model: str, text: str, finish: FinishReason | None,
                        usage_: dict[str, Any], logprobs_: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs_, "finish_reason": finish_reason(finish)}],
            "usage": usage_, "system_fingerprint": None}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
               usage_: dict[str, Any] | None = None, choices: bool = True,
               logprobs_: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": None,
                           "choices": [{"index": 0, "delta": delta, "logprobs": logprobs_, "finish_reason": finish}]
                           if choices else []}
    if usage_ is not None or not choices:
        out["usage"] = usage_
    return out


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None,
                     usage_: dict[str, Any] | None = None, choices: bool = True,
                     logprobs_: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                           "system_fingerprint": None,
                           "choices": [{"index": 0, "text": text, "logprobs": logprobs_, "finish_reason": finish}]
                           if choices else []}
    if usage_ is not None or not choices:
        out["usage"] = usage_
    return out


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` as is)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
