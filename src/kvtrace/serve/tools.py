"""Tool calling for any model: OpenAI's ``tools`` / ``tool_choice`` over constrained JSON.

A model's own tool-call format (Qwen's ``<tool_call>`` tags, Llama 3.1's ``ipython`` role, ...) differs by family
and needs a parser per family. kvtrace uses one format every model can be held to instead (llama.cpp calls its
version "generic"): the tools are described in a system message, and the answer is constrained (``runtime.grammar``)
to one JSON object, either

    {"tool_calls": [{"name": "<a tool>", "arguments": {...valid under its parameters schema...}}, ...]}
    {"response": "<text for the user>"}

(``tool_choice="auto"``, the default with tools); only the first with ``"required"`` or a named function (then
that one); neither with ``"none"`` (no tools offered, plain text). ``parallel_tool_calls: false`` allows one call.
A parameters schema with ``properties`` but no ``additionalProperties`` allows no others (a function takes the
arguments it declares; JSON schema's default would let a model invent more).
The answer is then read back into OpenAI's shapes: ``message.tool_calls`` (finish_reason ``tool_calls``) or
``message.content``. Earlier turns are rendered the same way: an assistant message's ``tool_calls`` as that JSON,
consecutive ``tool`` messages as one user message ``{"tool_results": [{"tool_call_id", "content"}, ...]}`` (every
template takes user messages; many refuse a ``tool`` role or two user turns in a row).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvtrace.runtime.grammar import Constraint

__all__ = ["ToolCall", "Tools", "parse_tools", "read_answer", "render_history"]

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


def _error(message: str, param: str) -> Exception:
    from kvtrace.serve.protocol import ApiError

    return ApiError(message, param=param)


def _short(v: Any, n: int = 60) -> str:
    r = json.dumps(v)
    return r if len(r) <= n else r[: n - 3] + "..."


@dataclass(frozen=True)
class Tools:
    """The tools a request offers and how it may use them: ``functions`` [(name, description, parameters schema)],
    ``choice`` "auto" | "required" | a function's name; ``parallel``: more than one call per answer."""

    functions: tuple[tuple[str, str, str], ...]  # (name, description, parameters as JSON text)
    choice: str
    parallel: bool

    def offered(self) -> tuple[tuple[str, str, str], ...]:
        """The functions the answer may call (a named choice: that one)."""
        if self.choice in ("auto", "required"):
            return self.functions
        return tuple(f for f in self.functions if f[0] == self.choice)

    def constraint(self) -> Constraint:
        """The JSON schema every answer is held to. A parameters schema that refers into itself ($ref, as pydantic
        writes nested models) is moved to the root's $defs under the tool's name, its pointers rewritten, so they
        resolve as they did in the tool's own schema."""
        defs: dict[str, Any] = {}
        calls = []
        for name, _, params in self.offered():
            args = json.loads(params)
            if '"$ref"' in params:
                defs.update(_lifted(name, args))
                args = {"$ref": f"#/$defs/{name}__params"}
            calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": args},
                          "required": ["name", "arguments"], "additionalProperties": False})
        call_list: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                     "minItems": 1}
        if not self.parallel:
            call_list["maxItems"] = 1
        options: list[dict[str, Any]] = [{"type": "object", "properties": {"tool_calls": call_list},
                                          "required": ["tool_calls"], "additionalProperties": False}]
        if self.choice == "auto":
            options.append({"type": "object", "properties": {"response": {"type": "string"}},
                            "required": ["response"], "additionalProperties": False})
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return Constraint.json_schema({**schema, "$defs": defs} if defs else schema)

    def system_text(self) -> str:
        """What the system message tells the model about the tools and the answer's form."""
        listed = json.dumps([{"name": n, **({"description": d} if d else {}), "parameters": json.loads(p)}
                             for n, d, p in self.offered()], ensure_ascii=False)
        call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'
        if self.choice == "auto":
            how = (f"To call tools, answer with the JSON object {call}; to answer the user directly, answer with "
                   '{"response": "<your answer>"}.')
        elif self.choice == "required":
            how = f"Call one or more of them: answer with the JSON object {call}."
        else:
            how = f"Call the tool {self.choice}: answer with the JSON object {call}."
        return f"You can call these tools (arguments as JSON schemas):\n{listed}\n{how}"


def _lifted(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (a tool's parameters schema) as root ``$defs`` entries named ``<name>__...``: the schema itself
    as ``<name>__params``, each of its own $defs / definitions as ``<name>__<def>``, every local pointer rewritten
    to match ("#" -> the params entry, "#/$defs/X/..." -> "#/$defs/<name>__X/...", "#/a/b" -> inside the params)."""
    prefix = f"{name}__"

    def pointer(ref: str) -> str:
        if ref == "#":
            return f"#/$defs/{prefix}params"
        for head in ("#/$defs/", "#/definitions/"):
            if ref.startswith(head):
                return f"#/$defs/{prefix}{ref[len(head):]}"
        return f"#/$defs/{prefix}params/{ref[2:]}" if ref.startswith("#/") else ref  # another document: as is

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: pointer(x) if k == "$ref" and isinstance(x, str) else walk(x) for k, x in v.items()}
        return [walk(x) for x in v] if isinstance(v, list) else v

    own = {**params.get("definitions", {}), **params.get("$defs", {})}
    body = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    return {f"{prefix}params": walk(body), **{prefix + k: walk(v) for k, v in own.items()}}


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """The request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked (ApiError naming the field), or
    None where no tool may be called (no tools, or ``tool_choice: "none"``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _error(f"parallel_tool_calls must be true or false, got {_short(parallel)}", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _error(f"tool_choice={_short(choice)} needs tools: give the functions it may call", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _error(f"tools must be an array of {{type: function, function: {{name, description, parameters}}}}, "
                     f"got {_short(tools)}", "tools")
    functions = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _error(f"{where} must be {{\"type\": \"function\", \"function\": {{name, description, parameters}}}} "
                         f"(kvtrace serve calls functions only), got {_short(t)}", where)
        f = t["function"]
        name, desc, params = f.get("name"), f.get("description", ""), f.get("parameters")
        if params is None:  # left out (or null): a function of no declared arguments
            params = {"type": "object"}
        if not isinstance(name, str) or not NAME.match(name):
            raise _error(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {_short(name)}",
                         f"{where}.function.name")
        if any(name == g[0] for g in functions):
            raise _error(f"{where}.function.name {name!r} is given twice; tool names must differ", f"{where}.function.name")
        if desc is None:
            desc = ""
        if not isinstance(desc, str):
            raise _error(f"{where}.function.description must be a string, got {_short(desc)}",
                         f"{where}.function.description")
        if not isinstance(params, dict):
            raise _error(f"{where}.function.parameters must be a JSON schema object, got {_short(params)}",
                         f"{where}.function.parameters")
        if "properties" in params and "additionalProperties" not in params:
            # a function takes the arguments it declares: JSON schema would allow any others by default (and a
            # small model invents some, measured), which a call would then fail on
            params = {**params, "additionalProperties": False}
        functions.append((name, desc, json.dumps(params)))
    if choice is None or choice == "auto":
        pick = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        pick = "required"
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        pick = choice["function"]["name"]
        if pick not in [f[0] for f in functions]:
            raise _error(f"tool_choice names the function {pick!r}, which is not among tools "
                         f"{[f[0] for f in functions]}", "tool_choice")
    else:
        raise _error('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": '
                     f'...}}}}, got {_short(choice)}', "tool_choice")
    return Tools(tuple(functions), pick, parallel)


def assistant_calls(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as [{"name", "arguments"}] (arguments parsed from their JSON text)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise _error(f"{where}.tool_calls must be a non-empty array of tool calls, got {_short(calls)}",
                     f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise _error(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments (a JSON "
                         f"string)}}}}, got {_short(c)}", f"{where}.tool_calls")
        try:
            args = json.loads(f["arguments"])
        except (json.JSONDecodeError, RecursionError):
            raise _error(f"{where}.tool_calls[{j}].function.arguments is not JSON: {_short(f['arguments'])}",
                         f"{where}.tool_calls") from None
        out.append({"id": c.get("id", ""), "name": f["name"], "arguments": args})
    return out


def render_history(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict[str, str]]:
    """Messages (already checked, tool calls and results in their raw OpenAI shapes under "_calls" / "_call_id")
    -> {role, content} for the chat template: calls and results written as the JSON the model answers in, the
    tools' description added to the system message (or a system message first)."""
    out: list[dict[str, str]] = []
    results: list[dict[str, str]] = []

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": json.dumps({"tool_results": list(results)}, ensure_ascii=False)})
            results.clear()

    for m in messages:
        if m["role"] == "tool":
            results.append({"tool_call_id": m.get("_call_id", ""), "content": m["content"]})
            continue
        flush()
        if m.get("_calls"):  # the ids too: results name the call they answer
            calls = json.dumps({"tool_calls": m["_calls"]}, ensure_ascii=False)
            said = m["content"].strip()
            out.append({"role": "assistant", "content": f"{said}\n{calls}" if said else calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    flush()
    if tools is not None:
        text = tools.system_text()
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def read_answer(text: str) -> tuple[str | None, list[ToolCall]]:
    """A constrained answer -> (content, tool calls): {"response": s} -> (s, []); {"tool_calls": [...]} ->
    (None, calls); anything else (an answer cut short by max_tokens) -> (text as it is, [])."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text, []
    if isinstance(value, dict) and isinstance(value.get("response"), str):
        return value["response"], []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        calls = [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")
                 for c in value["tool_calls"] if isinstance(c, dict) and "name" in c and "arguments" in c]
        if calls:
            return None, calls
    return text, []
