"""kvtrace: compile and export transformer decoders together with their KV cache.

Public API (everything else lives in private modules and may change)::

    jm = kvtrace.jit(model)                       # drop-in for HF-style calls with a DynamicCache/StaticCache
    kvtrace.export("smollm2-135m-instruct", "m.kvt", max_seq_len=512)
    art = kvtrace.load("m.kvt"); s = art.session(); s.prefill(tokens); s.decode(tok)
    s.prefill(tokens, cross_attention_states=x)   # vision decoders: named prefill inputs
    kvtrace.verify(reference, candidates, [tokens, kvtrace.Prompt(tokens, {"cross_attention_states": x})])
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from kvtrace._errors import (
    ArtifactError,
    CacheOverflowError,
    CaptureError,
    KvtraceError,
    SourceError,
    UnsupportedError,
    UsageError,
)

__version__ = "0.4.0"

__all__ = [
    "ArtifactError",
    "CacheOverflowError",
    "CacheSpec",
    "CaptureError",
    "KvtraceError",
    "LayerKind",
    "LayerSpec",
    "Prompt",
    "SourceError",
    "UnsupportedError",
    "UsageError",
    "__version__",
    "export",
    "jit",
    "load",
    "verify",
]

# Heavy modules (torch, transformers) are imported lazily: `import kvtrace` has no side effects
# and loading an artifact never pulls in transformers.
_LAZY = {
    "CacheSpec": "kvtrace.spec.cache",
    "LayerKind": "kvtrace.spec.cache",
    "LayerSpec": "kvtrace.spec.cache",
    "jit": "kvtrace.runtime.jit",
    "export": "kvtrace.artifact.export",
    "load": "kvtrace.artifact.archive",
    "verify": "kvtrace.tools.verify",
    "Prompt": "kvtrace.tools.verify",
}

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.artifact.archive import load
    from kvtrace.artifact.export import export
    from kvtrace.runtime.jit import jit
    from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec
    from kvtrace.tools.verify import Prompt, verify


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtrace' has no attribute {name!r}")
