"""Keeping the libraries that load models quiet in a terminal: what they print is addressed to library
authors, not to someone waiting for an answer. Used by the CLI (unless ``--debug``) and by the tiered start's
background build; importing this module imports nothing heavy."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["NATIVE_QUIET_ENV", "QUIET_LOGGERS", "native_lines_dropped", "quiet_libraries"]

# torchao (pulled in by transformers when installed, e.g. with the executorch extra) logs each CUDA-only
# kernel library it cannot load on a CPU machine, and torch's pytree a deprecation of how torchao registers
# its enums: four lines on every command that loads a model.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")

# Set by ``quiet_libraries``: native libraries' own log lines (C++ streams a binding sends to Python's stderr, past
# Python's logging) are dropped where a caller names them (``native_lines_dropped``). In the environment, so that the processes
# kvtrace starts (the tiered start's build, bench's rows) are as quiet as the command that started them.
NATIVE_QUIET_ENV = "KVTRACE_QUIET_NATIVE_LOGS"


def quiet_libraries() -> None:
    """transformers' and huggingface_hub's progress bars off (kvtrace shows its own progress), deprecation
    warnings ignored (torch's TypedStorage one too, a UserWarning), ``QUIET_LOGGERS`` below ERROR,
    ``native_lines_dropped`` on. An environment variable the user set wins."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    # torch's own deprecation, raised inside Inductor's GEMM template selection (an aoti-packed build) as a
    # UserWarning: nothing a kvtrace user wrote or can change
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault(NATIVE_QUIET_ENV, "1")


# what a terminal library (rich) may put before a line it writes: a carriage return, erase-line and colour codes
_CONTROL = re.compile(r"\r|\x1b\[[0-9;?]*[A-Za-z]")


class _LineFilter:
    """``sys.stderr`` inside ``native_lines_dropped``: each complete line written is passed on to ``target`` at once
    unless it matches ``pattern`` (after terminal control codes are removed); everything else (``flush``,
    ``fileno``, ``isatty``, ``encoding``) is the target's."""

    def __init__(self, target: TextIO, pattern: re.Pattern[str]):
        self._target, self._pattern, self._partial = target, pattern, ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if not self._pattern.match(_CONTROL.sub("", line)):
                self._target.write(line + "\n")
        return len(text)

    def end(self) -> None:
        """The last line, if it never got its newline."""
        if self._partial and not self._pattern.match(_CONTROL.sub("", self._partial)):
            self._target.write(self._partial)
        self._partial = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


@contextmanager
def native_lines_dropped(pattern: re.Pattern[str]) -> Iterator[None]:
    """While inside, lines written to ``sys.stderr`` that match ``pattern`` are dropped; every other line goes on
    at once, in order. For short calls into a native library that logs at an informational level it cannot be
    told to drop, through Python's stderr: ExecuTorch's pybindings send C++'s ``std::cerr`` there while a method
    loads (its CPU probe: five lines a process). Does nothing unless ``quiet_libraries`` ran (``NATIVE_QUIET_ENV``
    is "1") or where there is no stderr. Whatever stderr is inside is restored on leaving, exception or not."""
    target = sys.stderr
    if os.environ.get(NATIVE_QUIET_ENV) != "1" or target is None:
        yield
        return
    line_filter = _LineFilter(target, pattern)
    sys.stderr = line_filter  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.stderr is line_filter:
            sys.stderr = target
        line_filter.end()
