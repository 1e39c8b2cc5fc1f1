import os
import re
import sys
import warnings

from kvtrace.sources.quiet import NATIVE_QUIET_ENV, native_lines_dropped, quiet_libraries

PROBE = re.compile(r"\[probe\.cpp:\d+\] ")


def _library_writes() -> None:
    # as ExecuTorch's pybindings forward C++'s std::cerr: to whatever sys.stderr is, in pieces
    sys.stderr.write("[probe.cpp:71] Reading file /sys/devices/soc0/image_version\n[probe.cpp:87] Failed")
    sys.stderr.write(" to open midr file\n")
    sys.stderr.write("E real error: kernel not found\n")
    sys.stderr.write("\r\x1b[2K[probe.cpp:125] CPU info and manual query on # of cpus dont match.\n")  # via rich


def test_matching_lines_are_dropped_the_rest_passed_on_at_once_in_order(capsys, monkeypatch):
    monkeypatch.setenv(NATIVE_QUIET_ENV, "1")
    with native_lines_dropped(PROBE):
        _library_writes()
        assert capsys.readouterr().err == "E real error: kernel not found\n"  # not held until the end
        sys.stderr.write("a last line without its newline")
    assert capsys.readouterr().err == "a last line without its newline"


def test_without_quiet_nothing_is_dropped_and_stderr_comes_back_after_an_error(capsys, monkeypatch):
    monkeypatch.delenv(NATIVE_QUIET_ENV, raising=False)
    with native_lines_dropped(PROBE):
        _library_writes()
    assert capsys.readouterr().err.count("[probe.cpp:") == 3
    monkeypatch.setenv(NATIVE_QUIET_ENV, "1")
    before = sys.stderr
    try:
        with native_lines_dropped(PROBE):
            assert sys.stderr is not before and sys.stderr.encoding == before.encoding  # the rest: stderr's own
            sys.stderr.write("before the error\n")
            raise KeyError("inside")
    except KeyError:
        pass
    assert sys.stderr is before
    sys.stderr.write("after\n")
    assert capsys.readouterr().err == "before the error\nafter\n"


def test_no_stderr_at_all_is_left_alone(monkeypatch):
    monkeypatch.setenv(NATIVE_QUIET_ENV, "1")
    monkeypatch.setattr(sys, "stderr", None)  # pythonw, or a closed stream
    with native_lines_dropped(PROBE):
        assert sys.stderr is None


def test_quiet_libraries_turns_it_on_unless_the_user_set_it(monkeypatch):
    for name in (NATIVE_QUIET_ENV, "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    quiet_libraries()
    assert os.environ[NATIVE_QUIET_ENV] == "1"
    monkeypatch.setenv(NATIVE_QUIET_ENV, "0")
    quiet_libraries()
    assert os.environ[NATIVE_QUIET_ENV] == "0"


def test_quiet_libraries_drops_torchs_typed_storage_deprecation_and_nothing_else_of_its_kind(monkeypatch):
    for name in (NATIVE_QUIET_ENV, "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings(record=True) as seen:  # the filters quiet_libraries adds go with the block
        warnings.simplefilter("always")
        quiet_libraries()
        # as Inductor's GEMM template selection raises it during an aoti-packed build
        warnings.warn("TypedStorage is deprecated. It will be removed in the future and UntypedStorage will be "
                      "the only storage class.", UserWarning, stacklevel=1)
        warnings.warn("a UserWarning a user should read", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a UserWarning a user should read"]
