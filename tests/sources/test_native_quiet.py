import os
import re

from kvtrace.sources.quiet import NATIVE_QUIET_ENV, native_lines_dropped, quiet_libraries

PROBE = re.compile(r"\[probe\.cpp:\d+\] ")


def _native_writes() -> None:
    # written to the file descriptor, as a C++ library writes, past sys.stderr
    os.write(2, b"[probe.cpp:71] Reading file /sys/devices/soc0/image_version\n")
    os.write(2, b"E real error: kernel not found\n")
    os.write(2, b"[probe.cpp:125] CPU info and manual query on # of cpus dont match.\n")


def test_native_lines_matching_are_dropped_the_rest_kept_in_order(capfd, monkeypatch):
    monkeypatch.setenv(NATIVE_QUIET_ENV, "1")
    with native_lines_dropped(PROBE):
        _native_writes()
        os.write(2, b"a last line without its newline")
    assert capfd.readouterr().err == "E real error: kernel not found\na last line without its newline"


def test_without_quiet_nothing_is_dropped_and_an_error_inside_still_restores_stderr(capfd, monkeypatch):
    monkeypatch.delenv(NATIVE_QUIET_ENV, raising=False)
    with native_lines_dropped(PROBE):
        _native_writes()
    assert capfd.readouterr().err.count("[probe.cpp:") == 2
    monkeypatch.setenv(NATIVE_QUIET_ENV, "1")
    try:
        with native_lines_dropped(PROBE):
            os.write(2, b"before the error\n")
            raise KeyError("inside")
    except KeyError:
        pass
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "before the error\nafter\n"


def test_quiet_libraries_turns_it_on_unless_the_user_set_it(monkeypatch):
    for name in (NATIVE_QUIET_ENV, "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    quiet_libraries()
    assert os.environ[NATIVE_QUIET_ENV] == "1"
    monkeypatch.setenv(NATIVE_QUIET_ENV, "0")
    quiet_libraries()
    assert os.environ[NATIVE_QUIET_ENV] == "0"
