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


def test_the_error_tree_in_the_docstring_is_the_real_one():
    import kvtrace._errors as errors

    drawn = {}
    for line in errors.__doc__.splitlines():
        stripped = line.lstrip(" │├└─")
        if stripped[:1].isupper() and "Error" in stripped.split()[0]:
            name = stripped.split()[0].split("(")[0]
            drawn[name] = len(line) - len(stripped)
    base = min(drawn.values())
    drawn = {name: (indent - base) // 4 for name, indent in drawn.items()}  # depth in the tree
    assert drawn["KvtraceError"] == 0 and len(set(drawn.values())) == 3
    parents = {}
    for name in errors.__all__:
        if name.endswith("Error"):
            assert name in drawn, f"{name} is missing from the error tree in kvtrace._errors' docstring"
    for name, depth in drawn.items():
        cls = getattr(errors, name)
        parents[depth + 1] = cls
        if depth:
            assert parents[depth] in cls.__bases__, f"{name} drawn under {parents[depth].__name__}"
