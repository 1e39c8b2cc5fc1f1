"""--json-schema / --json-object / --regex / --grammar on kvtrace run and chat: answers that match, and bad
constraints refused in one line before anything loads."""

from __future__ import annotations

import io
import json
import re

import pytest
from tests.conftest import make_byte_hf_dir
from tests.runtime.test_grammar import PERSON, _check_person

from kvtrace.cli.main import main


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_grammar")
    make_byte_hf_dir(d)
    path = d / "m.kvt"
    assert main(["export", str(d), "-o", str(path), "--max-seq-len", "192", "--backend", "exported", "--quiet"]) == 0
    return path


def _run(art, capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["run", str(art), "--prompt", "the cat", "--max-len", "150", "--json", "--quiet", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_run_answers_under_each_kind_of_constraint(art, capsys, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    out = _run(art, capsys, "--json-schema", str(schema))
    _check_person(json.loads(out["text"]))
    assert out["stop_reason"] in ("grammar", "eos")
    inline = _run(art, capsys, "--json-schema", json.dumps(PERSON))  # the schema itself, not a file
    assert inline["tokens"] == out["tokens"]
    out = _run(art, capsys, "--regex", "[0-9]{3}-[a-z]{2,4}", "--temperature", "1", "--seed", "3")
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", out["text"]) and out["stop_reason"] in ("grammar", "eos")
    lark = tmp_path / "list.lark"
    lark.write_text('start: "[" WORD ("," WORD)* "]"\nWORD: /cat|sat|mat/\n')
    out = _run(art, capsys, "--grammar", str(lark))
    assert re.fullmatch(r"\[(cat|sat|mat)(,(cat|sat|mat))*\]?,?", out["text"])  # cut short by --max-len at worst
    gbnf = tmp_path / "list.gbnf"
    gbnf.write_text('root ::= "[" word ("," word)* "]"\nword ::= "cat" | "sat" | "mat"\n')
    out = _run(art, capsys, "--grammar", str(gbnf))
    assert re.fullmatch(r"\[(cat|sat|mat)(,(cat|sat|mat))*\]?,?", out["text"])
    out = _run(art, capsys, "--choice", "yes", "--choice", "no", "--choice", "maybe so")
    assert out["text"] in ("yes", "no", "maybe so") and out["stop_reason"] in ("grammar", "eos")
    plain = _run(art, capsys)
    with pytest.raises(ValueError):
        json.loads(plain["text"])  # unconstrained, this random model writes no JSON


@pytest.mark.parametrize(("args", "words"), [
    (["--regex", "[a-"], "invalid regex: "),
    (["--json-schema", '{"type": "nonsense"}'], "invalid json schema: Invalid type: nonsense"),
    (["--json-schema", "nothing.json"], "no such file"),
    (["--json-schema", '{"type": '], "not valid JSON"),
    (["--grammar", "nothing.lark"], "no such file"),
    (["--regex", "a", "--json-object"], "not allowed with argument"),
    (["--choice", ""], "non-empty string"),
])
def test_bad_constraints_are_one_line_errors_before_anything_loads(args, words, capsys):
    capsys.readouterr()
    # the artifact does not exist: the constraint is refused first
    try:
        code = main(["run", "missing.kvt", "--prompt", "hi", *args])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and words in err[0], err


def test_chat_answers_every_turn_under_the_schema(art, capsys, monkeypatch):
    turns = [{"content": "the cat"}, {"content": "and the mat"}]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(t) + "\n" for t in turns)))
    capsys.readouterr()
    assert main(["chat", str(art), "--json", "--quiet", "--json-schema", json.dumps(PERSON),
                 "--max-new-tokens", "80"]) == 0
    answers = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert len(answers) == 2
    for a in answers:
        assert a["stats"]["stop_reason"] in ("grammar", "eos"), a
        _check_person(json.loads(a["content"]))
