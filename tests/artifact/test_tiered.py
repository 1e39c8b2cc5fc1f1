"""Tiered start (kvtrace.artifact.tiered): answer on the eager programs, swap to the compiled ones mid-answer
(the cache kept), the background build process: its artifact, a build killed mid-way, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kvtrace
from conftest import make_tiny_hf_dir, terminal_signals
from helpers import write_gguf
from kvtrace._errors import UsageError
from kvtrace.artifact import tiered
from kvtrace.artifact.store import cached_artifact, clear_artifacts, entry_path
from kvtrace.runtime.generate import stream
from kvtrace.sources.resolve import resolve_source

OPTS = dict(backend="exported", max_seq_len=32)
PROMPT = [1, 3, 4, 5, 6]  # <s> hello world the cat


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf")
    make_tiny_hf_dir(d, words_only=True)  # greedy answers run to max_new_tokens
    return d


@pytest.fixture(scope="module")
def compiled(hf_dir, tmp_path_factory):
    """The exported artifact a non-tiered run uses (the reference), built in its own cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTRACE_CACHE", str(tmp_path_factory.mktemp("ref_cache")))
        return cached_artifact(str(hf_dir), **OPTS, load=True).artifact


def _greedy(session, n, swap_at=None, swap=None):
    """n greedy tokens; ``swap()`` called between token swap_at-1 and swap_at (the first token is prefill's)."""
    out = []
    for i, chunk in enumerate(stream(session, PROMPT, max_new_tokens=n), 1):
        out.append(chunk.token)
        if swap_at is not None and i == swap_at - 1:
            swap()
    return out


@pytest.mark.parametrize("swap_at", [2, 7])
def test_a_swap_mid_answer_keeps_the_cache_and_the_greedy_tokens(hf_dir, compiled, swap_at):
    reference = _greedy(compiled.session(), 12)
    eager = tiered.eager_artifact(resolve_source(str(hf_dir)), max_seq_len=32)
    assert eager.manifest.cache_spec == compiled.cache_spec
    s = eager.session()
    assert s.label == "eager"
    got = _greedy(s, 12, swap_at, lambda: s.swap(compiled.program_set()))
    assert s.label == "exported" and s.identity == compiled.identity
    assert got == reference
    ref = compiled.session()
    _greedy(ref, 12)
    for mine, theirs in zip(s.state, ref.state, strict=True):  # the cache the eager programs wrote, kept
        torch.testing.assert_close(mine[:, :, : s.position], theirs[:, :, : ref.position], atol=1e-5, rtol=1e-5)


def test_swap_refuses_programs_of_another_cache_and_leaves_the_session_as_it_was(hf_dir, compiled):
    other = tiered.eager_artifact(resolve_source(str(hf_dir)), max_seq_len=24)  # another CacheSpec
    s = compiled.session()
    s.prefill(PROMPT)
    before = [t.clone() for t in s.state]
    with pytest.raises(UsageError, match=r"swap to eager refused: they declare the cache .* this session holds"):
        s.swap(other.program_set())
    all_logits = tiered.eager_artifact(resolve_source(str(hf_dir)), max_seq_len=32, prefill_logits="all")
    with pytest.raises(UsageError, match="prefill returns 'all' logits"):
        s.swap(all_logits.program_set())
    with pytest.raises(UsageError, match="swap takes a ProgramSet"):
        s.swap(compiled)
    assert s.label == "exported" and s.position == len(PROMPT) and s.identity == compiled.identity
    assert all(torch.equal(a, b) for a, b in zip(before, s.state, strict=True))


def test_tiered_start_answers_eagerly_then_switches_and_caches_the_artifact(hf_dir, compiled):
    tier = tiered.start(str(hf_dir), **OPTS, huge_pages=True)
    with tier:
        assert tier.build is not None and tier.artifact.manifest.backend == "eager" and not tier.compiled
        s = tier.artifact.session()
        swapped = []

        def swap():  # force the switch here: wait for the background build, then swap between two tokens
            swapped.append(tier.poll(s, wait=True))

        got = _greedy(s, 12, 5, swap)
        assert swapped == [True] and tier.compiled and s.label == "exported"
        assert tier.artifact.huge_pages  # the built artifact loaded as asked (weights in huge pages)
        assert tier.error is None and tier.build.seconds > 0
        assert got == _greedy(compiled.session(), 12)
        assert tier.build.path == entry_path(resolve_source(str(hf_dir)), **OPTS)
        # polled between every later token too: a switched session builds no program set again (it cost 3.5 ms a
        # token on SmolLM2, 15 % of the compiled decode)
        built = []
        real = tier.artifact.program_set
        tier.artifact.program_set = lambda: built.append(1) or real()
        assert [tier.poll(s) for _ in range(3)] == [False] * 3 and built == []
    again = tiered.start(str(hf_dir), **OPTS)  # the next run: a cache hit, nothing built
    assert again.build is None and again.compiled and again.artifact.path == tier.build.path
    assert not again.artifact.huge_pages and tiered.start(str(hf_dir), **OPTS, huge_pages=True).artifact.huge_pages


def test_a_failed_background_build_leaves_the_session_on_the_eager_programs(hf_dir):
    eager = tiered.eager_artifact(resolve_source(str(hf_dir)), max_seq_len=32)
    build = tiered.BackgroundBuild(tiered.BuildRequest(str(hf_dir), "exported", 32, batch_size=0))  # refused
    with tiered.Tiered(eager, build, "exported") as tier:
        s = tier.artifact.session()
        assert tier.poll(s, wait=True) is False
        assert "batch_size must be >= 1" in tier.error and s.label == "eager"
        assert _greedy(s, 3)  # still answering


def _wait_for_phase(build, text, timeout=600):
    t0 = time.monotonic()
    while text not in build.phase:
        build.poll()
        assert build.running, (build.phase, build.error)
        assert time.monotonic() - t0 < timeout
        time.sleep(0.05)


def _kill_group(build):
    os.killpg(build.pid, signal.SIGKILL)
    build.wait()


def _assert_nothing_loadable(hf_dir, backend):
    src = resolve_source(str(hf_dir))
    path = entry_path(src, backend=backend, max_seq_len=32)
    assert not path.exists()
    assert cached_artifact(str(hf_dir), backend=backend, max_seq_len=32, load=True, build=False) is None
    clear_artifacts()  # removes the killed build's lock (and temp file, if it had one)
    assert list(path.parent.iterdir()) == []


def test_a_build_killed_mid_way_leaves_no_artifact_a_later_run_would_load(hf_dir):
    build = tiered.BackgroundBuild(tiered.BuildRequest(str(hf_dir), "exported", 32))
    _wait_for_phase(build, "capturing")
    _kill_group(build)
    _assert_nothing_loadable(hf_dir, "exported")
    assert tiered.start(str(hf_dir), **OPTS).build is not None  # a miss: built again, not loaded half-written


@pytest.mark.compile
def test_an_aoti_build_killed_mid_compile_leaves_no_artifact(hf_dir):
    build = tiered.BackgroundBuild(tiered.BuildRequest(str(hf_dir), "aoti", 32))
    _wait_for_phase(build, "AOTInductor")
    time.sleep(3)  # inside Inductor's codegen / the C++ compiler
    _kill_group(build)
    _assert_nothing_loadable(hf_dir, "aoti")


def _gone(pid, timeout=20.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited; its new parent has not reaped it yet
            return True
        time.sleep(0.1)
    return False


FOREGROUND = textwrap.dedent("""
    import sys, time
    from kvtrace.artifact import tiered
    tier = tiered.start(sys.argv[1], backend="exported", max_seq_len=32)
    print(tier.build.pid, flush=True)
    sys.stdin.readline()  # the test has seen the build running
    if sys.argv[2] == "exit":
        sys.exit(0)      # atexit stops the build
    time.sleep(600)      # killed or interrupted by the test
""")


@pytest.mark.parametrize("how", ["exit", "interrupt", "kill"])
def test_the_build_process_never_outlives_the_foreground(hf_dir, tmp_path, how):
    env = {**os.environ, "KVTRACE_CACHE": str(tmp_path / "fg")}
    fg = subprocess.Popen([sys.executable, "-c", FOREGROUND, str(hf_dir), how], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env, preexec_fn=terminal_signals)
    child = int(fg.stdout.readline())
    assert not _gone(child, timeout=0.5)  # the build runs
    fg.stdin.write("go\n")
    fg.stdin.flush()
    time.sleep(0.5)
    if how == "interrupt":
        fg.send_signal(signal.SIGINT)  # Ctrl-C: KeyboardInterrupt, then atexit
    elif how == "kill":
        fg.kill()  # no cleanup code runs in the foreground: the kernel tells the child (PR_SET_PDEATHSIG)
    fg.wait(300)  # a hang guard, not a speed check: generous for loaded CI machines
    assert _gone(child), f"build process {child} still running after the foreground's {how}"


def test_eager_artifact_runs_what_the_export_would(hf_dir, compiled):
    eager = tiered.eager_artifact(resolve_source(str(hf_dir)), max_seq_len=32)
    assert eager.manifest.programs == compiled.manifest.programs
    assert eager.manifest.vocab_size == compiled.manifest.vocab_size
    assert eager.tokenizer().to_str() == compiled.tokenizer().to_str()
    a, b = eager.session(), compiled.session()
    torch.testing.assert_close(a.prefill(PROMPT), b.prefill(PROMPT), atol=1e-5, rtol=1e-5)
    assert isinstance(eager, kvtrace.Artifact)


@pytest.mark.compile
@pytest.mark.parametrize("quant", [None, "8da4w"])
def test_tiered_start_swaps_into_an_executorch_program_and_caches_it(hf_dir, quant):
    """An ExecuTorch program holds its cache: the swap copies the eager session's cache into its buffers. With
    8da4w the eager programs compute the weights as the .pte's XNNPACK kernels do (int8-asym activations)."""
    opts = dict(backend="executorch", max_seq_len=32, quant=quant)
    tier = tiered.start(str(hf_dir), **opts)
    with tier:
        assert tier.build is not None and tier.artifact.manifest.backend == "eager"
        if quant:
            assert tier.artifact.manifest.quant.key == "8da4w-g32-int8-asym"
        s = tier.artifact.session()
        swapped = []
        got = _greedy(s, 12, 5, lambda: swapped.append(tier.poll(s, wait=True)))
        assert swapped == [True] and tier.error is None and s.label == "executorch"
        assert tier.build.path.is_file()
    again = tiered.start(str(hf_dir), **opts)  # a cache hit: the .pte's own session
    assert again.build is None and again.compiled
    assert got == _greedy(again.artifact.session(), 12)


def test_tiered_start_on_gguf_blocks_answers_on_the_plain_decoder_then_switches_to_the_blocks(tmp_path):
    """GGUF blocks compute with the dequantized weights the plain decoder holds: the eager answer runs on it
    (GGUFLinear run eagerly took 9 s for SmolLM2's prefill), then swaps into the programs over the blocks, the cache
    kept, and the greedy tokens are those of the blocks' own programs."""
    path = write_gguf(tmp_path / "q41.gguf", qtype="Q4_1", embd_qtype="Q8_0")
    opts = dict(backend="exported", max_seq_len=32, quant="gguf")
    tier = tiered.start(str(path), **opts)
    with tier:
        assert tier.build is not None and tier.artifact.manifest.backend == "eager"
        assert tier.artifact.manifest.quant is None  # the plain decoder's programs, not GGUFLinear's
        s = tier.artifact.session()
        swapped = []
        got = _greedy(s, 12, 5, lambda: swapped.append(tier.poll(s, wait=True)))
        assert swapped == [True] and tier.error is None and s.label == "exported"
    again = tiered.start(str(path), **opts)  # a cache hit: the programs over the blocks
    assert again.build is None and again.artifact.manifest.quant.scheme == "gguf"
    assert got == _greedy(again.artifact.session(), 12)


def test_tiered_start_refuses_a_scheme_the_backend_does_not_offer_before_any_build(hf_dir):
    with pytest.raises(kvtrace.UnsupportedError, match="backend 'executorch' does not offer quant='int4'"):
        tiered.start(str(hf_dir), backend="executorch", max_seq_len=32, quant="int4")
