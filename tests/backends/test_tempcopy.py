"""The private temp copies a load maps: kernel copies of a byte range, private dirs, dead processes' dirs removed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from kvtrace.backends import tempcopy

DATA = bytes(range(256)) * 4096  # 1 MiB


def _src(tmp_path):
    p = tmp_path / "src.bin"
    p.write_bytes(DATA)
    return p


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "user space"])
def test_copy_range_copies_exactly_the_range(tmp_path, monkeypatch, kernel):
    if not kernel:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    with _src(tmp_path).open("rb") as f:
        assert tempcopy.copy_range(f, 1000, 300_000, tmp_path / "out") == 300_000
    assert (tmp_path / "out").read_bytes() == DATA[1000:301_000]


def test_a_filesystem_refusing_the_kernel_copy_falls_back_once(tmp_path, monkeypatch):
    calls = []

    def refuse(*args):
        calls.append(args)
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    with _src(tmp_path).open("rb") as f:
        assert tempcopy.copy_range(f, 0, len(DATA), tmp_path / "out", sync=False) == len(DATA)
    assert (tmp_path / "out").read_bytes() == DATA and len(calls) == 1


def test_a_source_ending_early_reports_what_it_copied_and_an_existing_file_is_refused(tmp_path):
    with _src(tmp_path).open("rb") as f:
        assert tempcopy.copy_range(f, len(DATA) - 10, 100, tmp_path / "short") == 10
        with pytest.raises(FileExistsError):
            tempcopy.copy_range(f, 0, 10, tmp_path / "short")
    assert (tmp_path / "short").read_bytes() == DATA[-10:]  # the existing file untouched


def test_private_dirs_and_only_dead_processes_dirs_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tempcopy.new_dir("kvtrace-x-")
    assert mine.name.startswith(f"kvtrace-x-{os.getpid()}-") and (mine.stat().st_mode & 0o777) == 0o700
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"kvtrace-x-{int(dead.stdout)}-killed"
    live = tmp_path / f"kvtrace-x-{os.getppid()}-busy"  # another process's load in progress
    other = tmp_path / f"kvtrace-y-{int(dead.stdout)}-killed"  # another prefix: not this caller's
    odd = tmp_path / "kvtrace-x-notapid-x"
    for d in (stale, live, other, odd):
        d.mkdir()
        (d / "f").write_bytes(b"x")
    tempcopy.remove_stale_dirs("kvtrace-x-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (mine, live, other, odd))
