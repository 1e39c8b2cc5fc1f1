"""Keeping the libraries that load models quiet in a terminal: what they print is addressed to library
authors, not to someone waiting for an answer. Used by the CLI (unless ``--debug``) and by the tiered start's
background build; importing this module imports nothing heavy."""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["NATIVE_QUIET_ENV", "QUIET_LOGGERS", "native_lines_dropped", "quiet_libraries"]

# torchao (pulled in by transformers when installed, e.g. with the executorch extra) logs each CUDA-only
# kernel library it cannot load on a CPU machine, and torch's pytree a deprecation of how torchao registers
# its enums: four lines on every command that loads a model.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")

# Set by ``quiet_libraries``: native libraries' own log lines (written to fd 2 by C++, past Python's logging)
# are dropped where a caller names them (``native_lines_dropped``). In the environment, so that the processes
# kvtrace starts (the tiered start's build, bench's rows) are as quiet as the command that started them.
NATIVE_QUIET_ENV = "KVTRACE_QUIET_NATIVE_LOGS"


def quiet_libraries() -> None:
    """transformers' and huggingface_hub's progress bars off (kvtrace shows its own progress), deprecation
    warnings ignored, ``QUIET_LOGGERS`` below ERROR, ``native_lines_dropped`` on. An environment variable
    the user set wins."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault(NATIVE_QUIET_ENV, "1")


@contextmanager
def native_lines_dropped(pattern: re.Pattern[str]) -> Iterator[None]:
    """While inside, what is written to file descriptor 2 (by native code or Python) is held in a temp file;
    on leaving, its lines that do not match ``pattern`` are written to stderr, in order. Does nothing unless
    ``quiet_libraries`` ran (``NATIVE_QUIET_ENV`` is "1"). Meant for short calls into a native library that
    logs at an informational level it cannot be told to drop (ExecuTorch's CPU probe, five lines a process)."""
    if os.environ.get(NATIVE_QUIET_ENV) != "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode(errors="replace")
            kept = "".join(line for line in text.splitlines(keepends=True) if not pattern.match(line))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
