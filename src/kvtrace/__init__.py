"""kvtrace: compile and export transformer decoders together with their KV cache.

Public API: exactly ``kvtrace.__all__`` (the subpackages are kvtrace's own layout and may change;
the plug-in points are ``kvtrace.backends``, ``kvtrace.cache.kinds`` and ``kvtrace.models.registry``)::

    jm = kvtrace.jit(model)                       # drop-in for HF-style calls with a DynamicCache/StaticCache
    kvtrace.export("smollm2-135m-instruct", "m.kvt", max_seq_len=512)
    art = kvtrace.load("m.kvt"); s = art.session(); s.prefill(tokens); s.decode(tok)
    s.prefill(tokens, cross_attention_states=x)   # vision decoders: named prefill inputs
    chat = art.conversation(); turn = chat.ask("Hi"); [c.text for c in turn]   # multi-turn, cache kept
    kvtrace.export(src, "s.kvt", slots=8); eng = kvtrace.load("s.kvt").slot_engine()   # 8 conversations, batched
    slot, first = eng.admit(kvtrace.SlotRequest(ids, max_tokens=64)); events = eng.step()
    kvtrace.verify(reference, candidates, [tokens, kvtrace.Prompt(tokens, {"cross_attention_states": x})])
    kvtrace.perplexity([reference, *candidates], chunks)   # chunks [N, ctx]: llama.cpp's ppl, KL from the first
    g = art.grammar(kvtrace.Constraint.json_schema(schema)); kvtrace.generate(s, ids, grammar=g)  # structured output
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

__version__ = "0.4.9"

# name -> the module that defines it. Heavy modules (torch, transformers) are imported lazily, on first
# use of a name: `import kvtrace` has no side effects and loading an artifact never pulls in transformers.
_LAZY = {
    # declared state and programs
    "CacheSpec": "kvtrace.spec.cache",
    "BufferSpec": "kvtrace.spec.cache",
    "LayerKind": "kvtrace.spec.cache",
    "LayerSpec": "kvtrace.spec.cache",
    "LayerState": "kvtrace.spec.cache",
    "ProgramSpec": "kvtrace.spec.program",
    "InputSpec": "kvtrace.spec.program",
    "Decoder": "kvtrace.spec.decoder",
    # jit: HF-style calls
    "jit": "kvtrace.runtime.jit",
    "JittedModel": "kvtrace.runtime.jit",
    "JitStats": "kvtrace.runtime.jit",
    # export and artifacts
    "export": "kvtrace.artifact.export",
    "load": "kvtrace.artifact.archive",
    "Artifact": "kvtrace.artifact.archive",
    "Manifest": "kvtrace.spec.manifest",
    "QuantSpec": "kvtrace.spec.quant",
    # running: sessions and generation
    "Session": "kvtrace.runtime.session",
    "ProgramSet": "kvtrace.runtime.session",
    "Snapshot": "kvtrace.runtime.session",
    "Sampling": "kvtrace.runtime.generate",
    "generate": "kvtrace.runtime.generate",
    "stream": "kvtrace.runtime.generate",
    "Generation": "kvtrace.runtime.generate",
    "GenerationResult": "kvtrace.runtime.generate",
    "GenerationStats": "kvtrace.runtime.generate",
    "Chunk": "kvtrace.runtime.generate",
    "Constraint": "kvtrace.runtime.grammar",
    "ConstraintKind": "kvtrace.runtime.grammar",
    "Grammar": "kvtrace.runtime.grammar",
    "GrammarState": "kvtrace.runtime.grammar",
    "Conversation": "kvtrace.runtime.chat",
    "Capturer": "kvtrace.runtime.graphs",
    "EagerCapturer": "kvtrace.runtime.graphs",
    "GraphStats": "kvtrace.runtime.graphs",
    "Turn": "kvtrace.runtime.chat",
    "TurnStats": "kvtrace.runtime.chat",
    "SlotEngine": "kvtrace.runtime.slots",
    "SlotRequest": "kvtrace.runtime.slots",
    "SlotEvent": "kvtrace.runtime.slots",
    "FinishReason": "kvtrace.runtime.slots",
    "SlotSession": "kvtrace.runtime.slots",
    "TokenLogprobs": "kvtrace.runtime.slots",
    # tools
    "verify": "kvtrace.tools.verify",
    "VerifyReport": "kvtrace.tools.verify",
    "StepRow": "kvtrace.tools.verify",
    "NoiseFloor": "kvtrace.tools.verify",
    "Prompt": "kvtrace.tools.runners",
    "Runner": "kvtrace.tools.runners",
    "EagerRunner": "kvtrace.tools.runners",
    "JitRunner": "kvtrace.tools.runners",
    "SessionRunner": "kvtrace.tools.runners",
    "DecoderRunner": "kvtrace.tools.runners",
    "perplexity": "kvtrace.tools.perplexity",
    "PerplexityReport": "kvtrace.tools.perplexity",
    "PerplexityRow": "kvtrace.tools.perplexity",
    "lint": "kvtrace.tools.lint",
    "LintReport": "kvtrace.tools.lint",
    "Finding": "kvtrace.tools.lint",
}

__all__ = [
    "Artifact",
    "ArtifactError",
    "BufferSpec",
    "CacheOverflowError",
    "CacheSpec",
    "CaptureError",
    "Capturer",
    "Chunk",
    "Constraint",
    "ConstraintKind",
    "Conversation",
    "Decoder",
    "DecoderRunner",
    "EagerCapturer",
    "EagerRunner",
    "Finding",
    "FinishReason",
    "Generation",
    "GenerationResult",
    "GenerationStats",
    "Grammar",
    "GrammarState",
    "GraphStats",
    "InputSpec",
    "JitRunner",
    "JitStats",
    "JittedModel",
    "KvtraceError",
    "LayerKind",
    "LayerSpec",
    "LayerState",
    "LintReport",
    "Manifest",
    "NoiseFloor",
    "PerplexityReport",
    "PerplexityRow",
    "ProgramSet",
    "ProgramSpec",
    "Prompt",
    "QuantSpec",
    "Runner",
    "Sampling",
    "Session",
    "SessionRunner",
    "SlotEngine",
    "SlotEvent",
    "SlotRequest",
    "SlotSession",
    "Snapshot",
    "SourceError",
    "StepRow",
    "TokenLogprobs",
    "Turn",
    "TurnStats",
    "UnsupportedError",
    "UsageError",
    "VerifyReport",
    "__version__",
    "export",
    "generate",
    "jit",
    "lint",
    "load",
    "perplexity",
    "stream",
    "verify",
]

if TYPE_CHECKING:  # pragma: no cover
    from kvtrace.artifact.archive import Artifact, load
    from kvtrace.artifact.export import export
    from kvtrace.runtime.generate import (
        Chunk,
        Generation,
        GenerationResult,
        GenerationStats,
        Sampling,
        generate,
        stream,
    )
    from kvtrace.runtime.graphs import Capturer, EagerCapturer, GraphStats
    from kvtrace.runtime.jit import JitStats, JittedModel, jit
    from kvtrace.runtime.session import ProgramSet, Session, Snapshot
    from kvtrace.runtime.slots import (
        FinishReason,
        SlotEngine,
        SlotEvent,
        SlotRequest,
        SlotSession,
        TokenLogprobs,
    )
    from kvtrace.spec.cache import BufferSpec, CacheSpec, LayerKind, LayerSpec, LayerState
    from kvtrace.spec.decoder import Decoder
    from kvtrace.spec.manifest import Manifest
    from kvtrace.spec.program import InputSpec, ProgramSpec
    from kvtrace.spec.quant import QuantSpec
    from kvtrace.tools.lint import Finding, LintReport, lint
    from kvtrace.tools.perplexity import PerplexityReport, PerplexityRow, perplexity
    from kvtrace.tools.runners import DecoderRunner, EagerRunner, JitRunner, Prompt, Runner, SessionRunner
    from kvtrace.tools.verify import NoiseFloor, StepRow, VerifyReport, verify


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtrace' has no attribute {name!r}")
