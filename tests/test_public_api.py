"""The public surface is exactly __all__; importing kvtrace has no side effects and imports no transformers."""

from __future__ import annotations

import subprocess
import sys

import kvtrace

ERRORS = {"ArtifactError", "CacheOverflowError", "CaptureError", "KvtraceError", "SourceError", "UnsupportedError",
          "UsageError"}
EXPECTED = ERRORS | {
    "__version__",
    "CacheSpec", "LayerKind", "LayerSpec", "LayerState", "BufferSpec", "ProgramSpec", "InputSpec", "Decoder",  # declared state and programs
    "jit", "JittedModel", "JitStats",  # HF-style calls
    "export", "load", "Artifact", "Manifest", "QuantSpec",  # artifacts
    "Session", "ProgramSet", "Snapshot", "Sampling", "generate", "stream", "Generation", "GenerationResult",
    "GenerationStats", "Chunk", "Conversation", "Turn", "TurnStats", "Capturer", "EagerCapturer", "GraphStats",  # running
    "Constraint", "ConstraintKind", "Grammar", "GrammarState",  # structured output
    "SlotEngine", "SlotRequest", "SlotEvent", "FinishReason", "SlotSession", "TokenLogprobs",  # many conversations, one cache
    "verify", "VerifyReport", "StepRow", "NoiseFloor", "Prompt", "Runner", "EagerRunner", "JitRunner", "SessionRunner",
    "DecoderRunner", "perplexity", "PerplexityReport", "PerplexityRow",
    "lint", "LintReport", "Finding",  # tools
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


def _kvtrace_types(hint: object) -> set[type]:
    """The kvtrace classes inside a type hint (unions, generics, tuples, callables walked)."""
    import typing

    out: set[type] = set()
    if isinstance(hint, type) and hint.__module__.startswith("kvtrace."):
        out.add(hint)
    for arg in typing.get_args(hint):
        out |= _kvtrace_types(arg)
    return out


def test_every_type_a_public_function_takes_or_returns_is_exported():
    import inspect
    import typing

    public = {getattr(kvtrace, n) for n in kvtrace.__all__ if n != "__version__"}
    seen: set[type] = set()
    for obj in public:
        fns = [obj] if inspect.isfunction(obj) else [
            f for name, f in inspect.getmembers(obj, inspect.isfunction) if not name.startswith("_") or name == "__init__"
        ] if inspect.isclass(obj) else []
        for fn in fns:
            try:
                hints = typing.get_type_hints(fn)
            except NameError:  # a hint naming a type only imported under TYPE_CHECKING: checked by its own module
                continue
            for hint in hints.values():
                seen |= _kvtrace_types(hint)
    missing = sorted(f"{t.__module__}.{t.__qualname__}" for t in seen if t not in public)
    assert missing == [], f"public functions take or return these, which kvtrace does not export: {missing}"
    assert {kvtrace.Session, kvtrace.Artifact, kvtrace.GenerationResult} <= seen  # the walk sees real signatures
