"""``kvtrace chat`` used as a person uses it: typed into a pseudo-terminal, two turns, commands, Ctrl-C and
Ctrl-D; and ``--json`` lines on stdin for scripts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pexpect
import pytest

import kvtrace
from conftest import make_tiny_hf_dir, terminal_signals
from kvtrace.runtime.chat import Conversation

ANSWER = 5  # --max-new-tokens


@pytest.fixture(scope="module")
def art_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_chat_cli")
    make_tiny_hf_dir(d, max_position_embeddings=128, words_only=True)
    path = d / "chat.kvt"
    kvtrace.export(str(d), path, max_seq_len=96, backend="exported")
    return path


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200", "KVTRACE_CACHE": str(tmp_path / "c")}


def _in_process(path, turns: list[str]) -> list[tuple[str, dict]]:
    """The same turns through the library: (answer text, turn stats) each."""
    art = kvtrace.load(path)
    m = art.manifest
    conv = Conversation(art.session(), art.tokenizer(), template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids)
    out = []
    for text in turns:
        with conv.ask(text, max_new_tokens=ANSWER) as turn:
            for _ in turn:
                pass
        out.append((turn.text, turn.stats.to_dict()))
    return out


def _spawn(path, tmp_path) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, ["-m", "kvtrace.cli", "chat", str(path), "--max-new-tokens", str(ANSWER)],
                          env=_env(tmp_path), encoding="utf-8", timeout=300, dimensions=(40, 200),
                          preexec_fn=terminal_signals)
    child.expect_exact("> ")
    return child


TURN = re.compile(r"turn: prefilled (\d+) new tokens \((\d+) reused from the cache, (\d+) rewound\)")


def _turn(child: pexpect.spawn, text: str) -> tuple[str, int, int]:
    """Type one message; (the answer as printed, prefilled, reused)."""
    child.sendline(text)
    child.expect(TURN)
    answer = child.before.replace("\r", "").split("\n")
    prefilled, reused = int(child.match.group(1)), int(child.match.group(2))
    child.expect_exact("> ")
    # the line typed is echoed first; the answer is the line after it
    return answer[1].strip() if len(answer) > 1 else "", prefilled, reused


def test_two_turns_typed_in_a_terminal_answer_as_the_library_does(art_path, tmp_path):
    want = _in_process(art_path, ["hello world", "the cat sat"])
    child = _spawn(art_path, tmp_path)
    a1, p1, r1 = _turn(child, "hello world")
    a2, p2, r2 = _turn(child, "the cat sat")
    assert (a1, a2) == (want[0][0].strip(), want[1][0].strip()) and a1 and a2  # words (conftest words_only)
    assert (p1, r1) == (want[0][1]["prefilled"], 0)
    # the second turn prefilled only what the cache did not hold: the new turn (and whatever of the
    # answer re-encodes differently), not the whole conversation
    assert (p2, r2) == (want[1][1]["prefilled"], want[1][1]["reused"]) and r2 >= p1
    assert p2 + r2 == want[1][1]["conversation_tokens"]
    child.sendline("/stats")
    child.expect(TURN)
    child.expect_exact("> ")
    child.sendline("/undo")
    child.expect(r"last turn forgotten \(1 left, cache at (\d+) tokens\)")
    child.expect_exact("> ")
    a2_again, _, _ = _turn(child, "the cat sat")
    assert a2_again == a2  # undo, then the same message: the same answer
    child.sendline("/frobnicate")
    child.expect(r"error: unknown command '/frobnicate'")  # a bad command never ends the chat
    child.expect_exact("> ")
    child.sendintr()  # Ctrl-C at the prompt: a fresh prompt, the chat goes on
    child.expect_exact("> ")
    child.sendline("/reset")
    child.expect_exact("conversation reset")
    child.expect_exact("> ")
    a1_again, p, r = _turn(child, "hello world")
    assert (a1_again, p, r) == (a1, p1, 0)
    child.sendeof()  # Ctrl-D quits
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_save_and_load_in_the_terminal(art_path, tmp_path):
    child = _spawn(art_path, tmp_path)
    _turn(child, "hello world")
    saved = tmp_path / "talk.safetensors"
    child.sendline(f"/save {saved}")
    child.expect(r"saved 1 turn\(s\), \d+ cached tokens to ")
    child.expect_exact("> ")
    a2, _, _ = _turn(child, "the cat sat")
    child.sendline("/reset")
    child.expect_exact("> ")
    child.sendline(f"/load {saved}")
    child.expect(r"loaded 1 turn\(s\)")
    child.expect_exact("> ")
    again, _, reused = _turn(child, "the cat sat")
    assert again == a2 and reused > 0  # the loaded cache was used
    child.sendline("/load")
    child.expect_exact("error: /load needs a file name")
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_json_lines_on_stdin(art_path, tmp_path):
    lines = [json.dumps({"content": "hello world"}), json.dumps({"content": "the cat sat"}), "not json",
             json.dumps({"command": "/undo"}), json.dumps({"role": "assistant", "content": "x"}),
             json.dumps({"content": "the cat sat"})]
    proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "chat", str(art_path), "--json", "--max-new-tokens",
                           str(ANSWER)], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          env=_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(x) for x in proc.stdout.splitlines()]
    assert len(out) == len(lines)
    want = _in_process(art_path, ["hello world", "the cat sat"])
    assert [out[0]["content"], out[1]["content"]] == [want[0][0], want[1][0]]
    assert out[1]["stats"]["reused"] == want[1][1]["reused"] > 0
    assert out[2]["error"].startswith("line 3 is not JSON")
    assert out[3] == {"command": "/undo", "result": out[3]["result"]} and "forgotten" in out[3]["result"]
    assert "only user messages" in out[4]["error"]
    assert out[5]["content"] == want[1][0]  # after undo, the same second turn again


def test_chat_on_a_model_source_starts_eager_and_switches_to_the_compiled_programs(art_path, tmp_path):
    """Tiered start in a chat: the first turn answers while the artifact builds in the background; the next
    turn, once the build is in the cache, runs the compiled programs on the same cache (nothing re-prefilled
    but the new turn), and both answers are the library's over the compiled artifact."""
    import time

    want = _in_process(art_path, ["hello world", "the cat sat"])
    env = _env(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "chat", str(art_path.parent), "--json",
                             "--backend", "exported", "--max-seq-len", "96", "--max-new-tokens", str(ANSWER)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        proc.stdin.write(json.dumps({"content": "hello world"}) + "\n")
        proc.stdin.flush()
        first = json.loads(proc.stdout.readline())
        artifacts = tmp_path / "c" / "artifacts"
        t0 = time.monotonic()
        while not list(artifacts.glob("*.kvt")) or list(artifacts.glob("*.lock")):  # the build lands in the cache
            assert time.monotonic() - t0 < 600 and proc.poll() is None
            time.sleep(0.2)
        time.sleep(3)  # and its process reports it
        proc.stdin.write(json.dumps({"content": "the cat sat"}) + "\n")
        proc.stdin.close()
        second = json.loads(proc.stdout.readline())
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (first["content"], second["content"]) == (want[0][0], want[1][0])
    assert second["stats"]["programs"] == "exported" and second["stats"]["switched_at"] == 1
    assert second["stats"]["prefilled"] == want[1][1]["prefilled"]  # the cache carried over the switch
