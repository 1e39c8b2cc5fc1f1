"""``kvtrace chat``: a multi-turn chat in the terminal (or JSON lines on stdin), keeping the cache across turns.

Each turn prefills only its new tokens (``runtime.chat.Conversation``). Commands: /reset, /undo (forget
the last turn), /save FILE, /load FILE, /stats, /help; Ctrl-C stops the answer being written (the
conversation keeps the text so far), Ctrl-D (or /quit) ends the chat.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtrace._errors import KvtraceError, UsageError
from kvtrace.cli.args import (
    POSITIVE,
    backend_arg,
    constraint_args,
    constraint_of,
    huge_pages_arg,
    quant_args,
    sampling_knobs,
    sampling_of,
    speculate_arg,
    tiered_arg,
)
from kvtrace.cli.ui import UI

HELP = ("/reset  start over    /undo  forget the last turn    /save FILE  /load FILE  the conversation and its "
        "cache\n/stats  the last turn's numbers    /quit or Ctrl-D  leave    Ctrl-C  stop the answer being written")


def _open(args: argparse.Namespace, ui: UI) -> tuple[Any, Any]:
    """(artifact, tier): a file written by ``kvtrace export``, or a model source as generate opens it (the
    cached artifact, else the eager programs while the compile runs in the background)."""
    from kvtrace.artifact.archive import load
    from kvtrace.cli.generate import open_model

    if args.model is not None and Path(args.model).is_file() and Path(args.model).suffix in (".kvt", ".pte"):
        with ui.step(f"loading {args.model}"):
            return load(args.model, huge_pages=args.huge_pages), None
    art, tier, _ = open_model(args, ui)
    return art, tier


def _conversation(art: Any, system: str | None) -> Any:
    return art.conversation(system)


def _command(conv: Any, line: str) -> tuple[bool, str]:
    """Run a /command; (quit?, what to tell the user)."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name in ("/quit", "/exit"):
        return True, ""
    if name == "/reset":
        conv.reset()
        return False, "conversation reset"
    if name == "/undo":
        conv.undo()
        return False, f"last turn forgotten ({conv.turns} left, cache at {conv.session.position} tokens)"
    if name in ("/save", "/load"):
        if not rest:
            raise UsageError(f"{name} needs a file name, e.g. {name} chat.safetensors")
        if name == "/save":
            return False, f"saved {conv.turns} turn(s), {len(conv.tokens)} cached tokens to {conv.save(rest)}"
        conv.load(rest)
        return False, f"loaded {conv.turns} turn(s), {len(conv.tokens)} cached tokens from {rest}"
    if name == "/stats":
        return False, conv.last.line() if conv.last else "no turn yet"
    if name == "/help":
        return False, HELP
    raise UsageError(f"unknown command {name!r}; the commands are /reset /undo /save /load /stats /help /quit")


def _answer(conv: Any, text: str, args: argparse.Namespace, write: Callable[[str], None],
            tier: Any = None) -> tuple[Any, Any]:
    """One turn, streamed through ``write``; Ctrl-C stops it and keeps what was written. With a ``tier``
    the session switches to the compiled programs between two tokens once they are built."""
    from kvtrace.cli.generate import Switch

    sampling = sampling_of(args)
    switch = Switch(conv.session.label)
    if tier is not None and tier.poll(conv.session, finish_loading=True):  # built while the user was typing
        switch.now(conv.session.label)
    with conv.ask(text, max_new_tokens=args.max_new_tokens, sampling=sampling,
                  speculate=getattr(args, "speculate", 0), grammar=getattr(args, "bound_grammar", None)) as turn:
        try:
            for chunk in turn:
                write(chunk.text)
                switch.token()
                if tier is not None and tier.poll(conv.session):
                    switch.now(conv.session.label)
        except KeyboardInterrupt:
            write(" [stopped]")
    return turn, switch


def _interactive(conv: Any, args: argparse.Namespace, ui: UI, tier: Any = None) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # not on every platform
        pass

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    ui.info(f"[dim]chatting with {conv.session.spec.max_seq_len}-token context; /help for commands[/dim]")
    while True:
        try:
            line = input("> ")
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, like a shell
            write("\n")
            continue
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                quit_, said = _command(conv, line)
                if quit_:
                    return 0
                write(said + "\n")
                continue
            turn, switch = _answer(conv, line, args, write, tier)
            write("\n")
            ui.info(f"[dim]{turn.stats.line()}[/dim]")
            if switch.line():
                ui.info(f"[dim]{switch.line()}[/dim]")
            if tier is not None and tier.error:
                ui.notice(f"{tier.error}; the chat goes on with the eager decoder")
                tier = None
        except KvtraceError as e:  # one bad turn or command never ends the chat
            write(f"error: {e}\n")


def _json_lines(conv: Any, args: argparse.Namespace, tier: Any = None) -> int:
    """--json: one JSON object per stdin line, {"content": "..."} (a user turn) or {"command": "/reset"};
    one JSON object per answer on stdout."""
    for n, raw in enumerate(sys.stdin, 1):
        if not raw.strip():
            continue
        try:
            msg = json.loads(raw)
            if not isinstance(msg, dict) or not (isinstance(msg.get("content"), str) or
                                                 isinstance(msg.get("command"), str)):
                raise UsageError('expected {"content": "text"} or {"command": "/reset"}')
            if msg.get("role", "user") != "user":
                raise UsageError(f"only user messages are read; got role {msg.get('role')!r}")
            if "command" in msg:
                _, said = _command(conv, msg["command"])
                out: dict[str, Any] = {"command": msg["command"], "result": said}
            else:
                turn, switch = _answer(conv, msg["content"], args, lambda s: None, tier)
                out = {"role": "assistant", "content": turn.text, "stats": {**turn.stats.to_dict(), **switch.to_dict()}}
        except json.JSONDecodeError as e:
            out = {"error": f"line {n} is not JSON ({e.msg}); expected one JSON object per line"}
        except KvtraceError as e:
            out = {"error": f"line {n}: {e}"}
        print(json.dumps(out), flush=True)
    return 0


def cmd_chat(args: argparse.Namespace, ui: UI) -> int:
    from kvtrace.cli.generate import bind_grammar, finish_build

    constraint = constraint_of(args)  # a bad schema or pattern: refused before anything loads
    art, tier = _open(args, ui)
    try:
        conv = _conversation(art, args.system)
        args.bound_grammar = bind_grammar(art, constraint)  # every answer under it
        if args.speculate:  # refused before the first message, not at each
            from kvtrace.runtime.speculate import check_session

            check_session(conv.session)
        code = _json_lines(conv, args, tier) if ui.json_mode else _interactive(conv, args, ui, tier)
        finish_build(ui, tier)
        return code
    finally:
        if tier is not None:
            tier.close()


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``kvtrace chat`` to the parser (``add(name, help)`` makes the subparser)."""

    p = add("chat", "Chat in the terminal over many turns, the cache kept across them (each turn prefills only "
                    "its own tokens).")
    p.add_argument("model", nargs="?", default=None,
                   help="an artifact (.kvt), or a model source: smollm2-135m-instruct (default), a HF dir, a GGUF")
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=512, help="per answer (default 512)")
    backend_arg(p)
    p.add_argument("--max-seq-len", type=POSITIVE, default=2048, help="the whole conversation's tokens (default 2048)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    quant_args(p, auto=True)
    tiered_arg(p)
    sampling_knobs(p)
    constraint_args(p)
    speculate_arg(p, builds=True)
    huge_pages_arg(p)
    p.set_defaults(func=cmd_chat)
