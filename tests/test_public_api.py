"""The public surface is exactly __all__; importing kvtrace has no side effects and imports no transformers."""

from __future__ import annotations

import subprocess
import sys

import kvtrace

EXPECTED = {
    "ArtifactError", "CacheOverflowError", "CacheSpec", "CaptureError", "KvtraceError", "LayerKind", "LayerSpec",
    "Prompt", "SourceError", "UnsupportedError", "UsageError", "__version__", "export", "jit", "load", "verify",
}


def test_all_is_exact_and_resolves():
    assert set(kvtrace.__all__) == EXPECTED
    for name in kvtrace.__all__:
        assert getattr(kvtrace, name) is not None


def test_one_error_hierarchy():
    for name in ("ArtifactError", "CacheOverflowError", "CaptureError", "SourceError", "UnsupportedError", "UsageError"):
        assert issubclass(getattr(kvtrace, name), kvtrace.KvtraceError)
    assert issubclass(kvtrace.CacheOverflowError, kvtrace.UsageError)


def test_import_is_light():
    code = "import sys, kvtrace; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
