"""The compiled-artifact cache (kvtrace.artifact.store): keys, healing, the per-entry build lock, clearing."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import make_tiny_hf_dir
from kvtrace._errors import ArtifactError
from kvtrace.artifact.store import cached_artifact, clear_artifacts, list_artifacts

OPTS = dict(backend="exported", max_seq_len=16)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "tiny_hf"
    d.mkdir()
    make_tiny_hf_dir(d)
    return d


def test_an_edited_chat_template_is_not_served_from_the_cache(hf_dir):
    import kvtrace

    first = cached_artifact(str(hf_dir), **OPTS)
    assert cached_artifact(str(hf_dir), **OPTS).cache_hit
    cfg = hf_dir / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("assistant", "helper"))
    second = cached_artifact(str(hf_dir), **OPTS)
    assert not second.cache_hit and second.path != first.path
    assert "helper" in kvtrace.load(second.path).manifest.chat_template
    assert "helper" not in kvtrace.load(first.path).manifest.chat_template


def test_a_corrupt_cached_artifact_is_rebuilt_with_one_notice(hf_dir):
    built = cached_artifact(str(hf_dir), **OPTS)
    data = built.path.read_bytes()
    built.path.write_bytes(data[: len(data) // 2])  # a truncated entry (disk full, killed copy)
    notices: list[str] = []
    healed = cached_artifact(str(hf_dir), **OPTS, load=True, notice=notices.append)
    assert healed.rebuilt and not healed.cache_hit and healed.path == built.path
    assert healed.artifact is not None and healed.artifact.session() is not None
    assert len(notices) == 1 and "\n" not in notices[0]
    assert built.path.name in notices[0] and "rebuilding" in notices[0]
    again = cached_artifact(str(hf_dir), **OPTS, load=True, notice=notices.append)
    assert again.cache_hit and not again.rebuilt and len(notices) == 1  # healed for good


def test_a_fresh_build_that_does_not_load_is_not_kept(hf_dir, monkeypatch):
    import kvtrace.artifact.archive

    def refuse(path, **kwargs):
        raise ArtifactError(f"{path} is corrupt (simulated)")

    monkeypatch.setattr(kvtrace.artifact.archive, "load", refuse)
    with pytest.raises(ArtifactError, match="simulated"):
        cached_artifact(str(hf_dir), **OPTS, load=True)
    assert list_artifacts() == []


_BUILDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import kvtrace.artifact.export
    from kvtrace.artifact.store import cached_artifact

    hf_dir, counter, ready, me = sys.argv[1:]
    real = kvtrace.artifact.export.export

    def counting_export(*args, **kwargs):
        with open(counter, "a") as f:
            f.write(me + "\\n")
        time.sleep(1.0)  # widen the window in which the other process looks for the entry
        return real(*args, **kwargs)

    kvtrace.artifact.export.export = counting_export
    Path(ready, me).touch()
    deadline = time.time() + 120
    while len(os.listdir(ready)) < 2 and time.time() < deadline:  # start both builds together
        time.sleep(0.01)
    r = cached_artifact(hf_dir, backend="exported", max_seq_len=16)
    print(r.cache_hit, r.path, os.stat(r.path).st_ino)
""")


def test_concurrent_builds_of_one_artifact_compile_once(hf_dir, tmp_path):
    counter, ready = tmp_path / "exports.txt", tmp_path / "ready"
    ready.mkdir()
    script = tmp_path / "builder.py"
    script.write_text(_BUILDER)
    import kvtrace

    env = {**os.environ, "PYTHONPATH": str(Path(kvtrace.__file__).parents[1])}  # the kvtrace under test
    procs = [subprocess.Popen([sys.executable, str(script), str(hf_dir), str(counter), str(ready), name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name in ("a", "b")]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert counter.read_text().split() in (["a"], ["b"])  # exported once, by one of them
    results = sorted(out.split() for out, _ in outs)
    assert [r[0] for r in results] == ["False", "True"]  # one built it, the other waited and hit the cache
    assert results[0][1:] == results[1][1:]  # the same file (same inode): not replaced by a second build
    assert [p.name for p in Path(results[0][1]).parent.iterdir()] == [Path(results[0][1]).name]  # no lock left


def test_cache_clear_removes_leftovers_but_not_a_running_build(hf_dir):
    built = cached_artifact(str(hf_dir), **OPTS)
    d, size = built.path.parent, built.path.stat().st_size
    (d / f".{built.path.name}.k3j9x.tmp").write_bytes(b"x" * 100)  # write_artifact's temp, process killed
    (d / "dead-exported-0123.kvt.lock").write_bytes(b"")  # a lock file whose builder was killed
    running = d / "busy-exported-4567.kvt"
    (d / f".{running.name}.a1b2.tmp").write_bytes(b"y" * 10)
    fd = os.open(d / f"{running.name}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a build in progress holds its lock
        assert clear_artifacts() == size + 100
        left = sorted(p.name for p in d.iterdir())
        assert left == [f".{running.name}.a1b2.tmp", f"{running.name}.lock"]
    finally:
        os.close(fd)
    clear_artifacts()
    assert list(d.iterdir()) == []


def test_cache_list_counts_artifacts_only(hf_dir):
    built = cached_artifact(str(hf_dir), **OPTS)
    (built.path.parent / f".{built.path.name}.zz.tmp").write_bytes(b"x")
    assert list_artifacts() == [(built.path, built.path.stat().st_size)]


def test_key_changes_with_the_artifact_format(monkeypatch):
    """A new artifact format (kvtrace.artifact.archive.VERSION) never serves a cached entry of the old one, even when
    kvtrace's own version string did not change."""
    import kvtrace.artifact.archive as artifact
    from kvtrace.artifact.store import artifact_key

    opts = dict(backend="aoti", max_seq_len=64, dtype="float32", batch_size=1)
    before = artifact_key("abc", **opts)
    monkeypatch.setattr(artifact, "VERSION", artifact.VERSION + 1)
    assert artifact_key("abc", **opts) != before
