"""CLI fuzz: random argument lists for every subcommand exit 0, 1 or 2 — never a traceback, never a
signal; an exit 2 is one error line.

In-process (``kvtrace.cli.main.main(argv)``) on a tiny HF dir and a tiny artifact, plus a handful of
subprocesses. Values mix valid ones with junk (NaN, negatives, huge numbers, odd strings, unwritable
paths); the expensive paths (AOTInductor, a real export) are kept out of the valid values so the
whole file stays around a minute.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_hf_dir
from kvtrace.cli.main import main

FUZZ = settings(deadline=None, derandomize=True, database=None, max_examples=30,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

JUNK = ["", " ", "-", "nan", "inf", "-inf", "-1", "0", "1e309", "1e-400", "9" * 30, "x", "0x10", "１",
        "\x00", "--", "-q", "é", "a b", "1,2", ",", "/nonexistent", "/proc/kvt/x"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(tiny HF dir, its artifact in the generate cache, scratch folder); KVTRACE_CACHE set for the module."""
    root = tmp_path_factory.mktemp("fuzz")
    hf = root / "hf"
    hf.mkdir()
    make_tiny_hf_dir(hf)
    mp = pytest.MonkeyPatch()
    mp.setenv("KVTRACE_CACHE", str(root / "cache"))
    from kvtrace.artifact.store import cached_artifact

    art = cached_artifact(str(hf), backend="exported", max_seq_len=32).path  # what generate --max-seq-len 32 uses
    (root / "file.txt").write_text("not a model")
    yield hf, art, root
    mp.undo()


def _value(*valid: str) -> st.SearchStrategy[str]:
    """A valid value three times in five (so whole argument lists often get past parsing), else junk."""
    ok = st.sampled_from(valid)
    return st.one_of(ok, ok, ok, st.sampled_from(JUNK), st.text(max_size=6))


def _flags(draw: st.DrawFn, options: dict[str, st.SearchStrategy[str] | None]) -> list[str]:
    """A random subset (up to 4) of ``options`` in random order (None: a switch without a value), sometimes with
    an unknown flag or a stray positional."""
    names = draw(st.lists(st.sampled_from(sorted(options)), max_size=min(4, len(options)), unique=True))
    argv: list[str] = []
    for n in names:
        argv.append(n)
        if options[n] is not None:
            argv.append(draw(options[n]))
    if draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--bogus", "extra", "-z", "--json=1"])))
    return argv


SAMPLING = {"--temperature": _value("0", "0.7", "2"), "--top-k": _value("1", "5"), "--top-p": _value("0.9", "1"),
            "--seed": _value("0", "3"), "--raw": None, "--chat": None}
COMMON = {"--quiet": None, "--debug": None}


def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: --help, --version, bad flags
            code = e.code if isinstance(e.code, int) else 2
    return code, err.getvalue()


def _check(argv: list[str]) -> None:
    try:
        code, err = _run(argv)
    except Exception as e:
        if "--debug" in argv and getattr(type(e), "__module__", "").startswith("kvtrace"):
            return  # --debug re-raises kvtrace's own errors on purpose
        raise
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        errors = [ln for ln in err.splitlines() if ": error: " in ln]
        assert len(errors) == 1, (argv, err)


@FUZZ
@given(data=st.data())
def test_fuzz_run(world, data):
    hf, art, root = world
    target = data.draw(st.sampled_from([str(art)] * 4 + [str(hf), str(root / "file.txt"), "/nonexistent.kvt"]))
    opts = {**SAMPLING, **COMMON, "--max-len": _value("8", "40"), "--image-features": _value(str(root / "file.txt")),
            "--json": None}
    argv = ["run", target, "--prompt", data.draw(_value("hello world", "the cat", "-")), *_flags(data.draw, opts)]
    with contextlib.redirect_stdout(io.StringIO()):
        sys_stdin, sys.stdin = sys.stdin, io.StringIO(data.draw(st.sampled_from(["", "hello", "\n"])))
        try:
            _check(argv)
        finally:
            sys.stdin = sys_stdin


NUMBERS = ["nan", "inf", "-inf", "-0.0", "0", "-1", "1e-30", "1e30", "0.5", "1", "3", str(2**63), str(2**64)]


@settings(FUZZ, max_examples=50)
@given(flags=st.lists(st.tuples(st.sampled_from(["--temperature", "--top-k", "--top-p", "--seed"]),
                                st.one_of(st.sampled_from(NUMBERS), st.sampled_from(JUNK),
                                          st.floats(allow_nan=True, allow_infinity=True).map(repr))),
                      min_size=1, max_size=3))
def test_fuzz_sampling_flags(world, flags):
    """Sampling values reach a real generation: NaN, inf, negatives, tiny and huge numbers."""
    _, art, _ = world
    _check(["run", str(art), "--prompt", "hello world", "--raw", "--max-len", "6", "--json",
            *[x for pair in flags for x in pair]])


@FUZZ
@given(data=st.data())
def test_fuzz_generate(world, data):
    hf, _, root = world
    prompt = data.draw(_value("hello world", "the cat sat"))
    opts = {**SAMPLING, **COMMON, "--max-new-tokens": _value("3", "8"), "--json": None,
            # valid only where the build is cached (exported, 32): no compile inside the fuzz
            "--backend": st.sampled_from(["exported", "exported", "aot", ""]),
            "--max-seq-len": _value("32", "32", "65", "100000"), "--dtype": st.sampled_from(["float32", "float64"])}
    model = data.draw(st.sampled_from([str(hf)] * 4 + [str(root / "file.txt"), "/nonexistent", ""]))
    flags = _flags(data.draw, opts)
    if "--max-seq-len" not in flags:
        flags += ["--max-seq-len", "32"]  # the default 1024 exceeds the tiny model's 64 positions anyway
    if "--backend" not in flags:
        flags += ["--backend", "exported"]  # never the default aoti: minutes of compile
    sys_stdin, sys.stdin = sys.stdin, io.StringIO("hello")
    try:
        _check(["generate", prompt, "--model", model, *flags])
    finally:
        sys.stdin = sys_stdin


@FUZZ
@given(data=st.data())
def test_fuzz_export(world, data):
    hf, art, root = world
    # a valid source with valid flags would export for seconds: the valid source comes with a bad size
    source = data.draw(st.sampled_from([str(root / "file.txt"), "/nonexistent", "", str(art), str(root)]))
    opts = {**COMMON, "--max-seq-len": _value("16"), "--backend": st.sampled_from(["exported", "onnx"]),
            "--dtype": st.sampled_from(["float32", "int8"]), "--image-tokens": _value("6"),
            "--prefill-logits": st.sampled_from(["last", "all", "none"]), "--json": None}
    out = data.draw(st.sampled_from([str(root / "out.kvt"), str(root / "file.txt" / "x.kvt"), str(root),
                                     "/proc/kvt/x.kvt", ""]))
    argv = ["export", source, "-o", out, *_flags(data.draw, opts)]
    if data.draw(st.booleans()):
        argv = ["export", str(hf), "-o", out, "--max-seq-len", data.draw(st.sampled_from(["0", "65", "-3", "nan"]))]
    _check(argv)
    assert not (root / "out.kvt").exists()


@FUZZ
@given(data=st.data())
def test_fuzz_verify_lint_cache_bench(world, data):
    hf, art, root = world
    command = data.draw(st.sampled_from(["verify", "lint", "cache", "bench"]))
    if command == "verify":
        opts = {**COMMON, "--against": st.sampled_from(["jit-eager", "", ",", "jit-eager,nope", "exported,jit-eager"]),
                "--steps": _value("0", "1"), "--prompt": _value("hello"), "--max-seq-len": _value("16", "99999"),
                "--artifact": st.sampled_from([str(art), str(root / "file.txt"), "/nonexistent.kvt"]),
                "--json": st.sampled_from([str(root / "r.json"), str(root / "file.txt" / "r.json")]),
                "--no-fp32-reference": None, "--no-noise-floor": None, "--raw": None, "--dtype": st.sampled_from(["float32", "half"])}
        flags = _flags(data.draw, opts)
        if "exported" in " ".join(flags):  # export only in combination with a refused size: no real export
            flags += ["--max-seq-len", "99999"]
        if "--against" not in flags:
            flags += ["--against", "jit-eager"]
        source = data.draw(st.sampled_from([str(hf), str(hf), str(hf), "/nonexistent", str(root / "file.txt")]))
        argv = ["verify", source, *flags, "--steps", data.draw(st.sampled_from(["1", "1", "-1", "x"]))]
    elif command == "lint":
        argv = ["lint", data.draw(st.sampled_from(["/nonexistent", str(root / "file.txt"), str(root)])),
                *_flags(data.draw, {**COMMON, "--dtype": _value("float32"), "--json": _value(str(root / "l.json"))})]
    elif command == "cache":
        argv = ["cache", data.draw(st.sampled_from(["list", "purge", ""])),
                *_flags(data.draw, {**COMMON, "--json": None})]
    else:  # bench with a model that does not load: the arguments are checked, nothing is measured
        argv = ["bench", "--model", data.draw(st.sampled_from(["/nonexistent", str(root / "file.txt")])),
                *_flags(data.draw, {**COMMON, "--backends": _value("hf-eager", "nope"), "--prompt-len": _value("4"),
                                    "--new-tokens": _value("4"), "--runs": _value("1"), "--threads": _value("1"),
                                    "--dtype": _value("float32"), "--max-seq-len": _value("64"),
                                    "--json": _value(str(root / "b.json")), "--plot": _value(str(root / "b.png"))})]
    _check(argv)


@FUZZ
@given(argv=st.lists(st.one_of(st.sampled_from(["generate", "run", "export", "verify", "lint", "cache", "bench",
                                                  "--help", "--version", "-h"]),
                               st.sampled_from(JUNK), st.text(max_size=8)), max_size=5))
def test_fuzz_any_argv(world, argv):
    if argv and argv[0] in ("generate", "bench") and "--model" not in argv:
        argv = [*argv, "--model", "/nonexistent"]  # never the default model
    if argv and argv[0] in ("generate",):
        argv = [*argv, "--backend", "exported", "--max-seq-len", "32"]
    _check(argv)


def test_subprocesses_exit_cleanly(world, tmp_path):
    """A handful as a user runs them: exit status 0/1/2 (not a signal), no traceback, one error line."""
    hf, art, root = world
    cases = [
        (["run", str(art), "--prompt", "hello", "--temperature", "nan"], 2),
        (["export", str(hf), "-o", str(root / "file.txt" / "x.kvt")], 2),
        (["generate", "hello", "--model", str(hf), "--backend", "exported", "--max-seq-len", "32",
          "--max-new-tokens", "2", "--raw", "--top-p", "1"], 0),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__import__("kvtrace").__file__).parents[1])}
    procs = [subprocess.Popen([sys.executable, "-m", "kvtrace.cli", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
             for argv, _ in cases]
    for (argv, expected), p in zip(cases, procs, strict=True):
        _, err = p.communicate(timeout=300)
        assert p.returncode == expected, (argv, p.returncode, err)
        assert "Traceback" not in err
        if expected == 2:
            assert len([ln for ln in err.splitlines() if ": error: " in ln]) == 1, err
