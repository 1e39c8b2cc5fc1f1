"""One error hierarchy. Library code raises these; only the CLI prints and exits.

::

    KvtraceError                  every error kvtrace raises on purpose (catch this one)
    ├── UsageError(ValueError)    bad input from the caller: argument, shape, prompt, flag
    │   ├── SourceError           a model source cannot be resolved or read
    │   └── CacheOverflowError    a prompt or step would go past the cache's max_seq_len
    ├── UnsupportedError          a model or cache kind kvtrace does not support (yet)
    ├── CaptureError              tracing / exporting / compiling failed; the caller's objects untouched
    └── ArtifactError             an artifact is corrupt, truncated, tampered with or of another version

Every message is one line: what was expected, what was found, what to do. A foreign exception that
caused one stays on ``__cause__``; ``one_line`` is how a message quotes it.
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "CacheOverflowError",
    "CaptureError",
    "KvtraceError",
    "SourceError",
    "UnsupportedError",
    "UsageError",
    "one_line",
]


class KvtraceError(Exception):
    """Base class of every error kvtrace raises on purpose.

    Messages say what was expected, what was found, and what to do.
    """


class UsageError(KvtraceError, ValueError):
    """Bad input from the caller: wrong argument, wrong shape, empty prompt."""


class SourceError(UsageError):
    """A model source could not be resolved or read (missing path, not a model, wrong architecture)."""


class UnsupportedError(KvtraceError):
    """The model or cache is of a kind kvtrace does not support (yet)."""


class CaptureError(KvtraceError):
    """Capturing (tracing/exporting/compiling) a program failed. The caller's objects are untouched."""


class CacheOverflowError(UsageError):
    """A prompt or a decode step would go past the cache's declared max sequence length."""


class ArtifactError(KvtraceError):
    """An artifact file is corrupt, truncated, or of an unknown manifest version."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` of a foreign exception, for a kvtrace message (torch's often
    carry stack traces of their own; the full text stays on the chained ``__cause__``)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:limit]}" if lines else type(e).__name__
