"""Tools users run on their own models: ``verify`` (step-by-step logits and cache against eager),
``lint`` (what in a model's forward breaks capture), ``bench`` (prefill ms, decode tok/s, memory).

``verify`` compares the runners of ``runners`` (EagerRunner, JitRunner, SessionRunner, DecoderRunner, Unavailable,
Prompt); ``verify_kv`` picks each candidate's reference by its cache (an int8 KV cache: the same decoder run
eagerly with the same quantized cache, plus its error vs the unquantized cache, reported);
``lint`` is a package (scenario, guards, graph_diff, mutation, report; ``lint.jit_view`` is the one module
that reads ``kvtrace.runtime.jit`` internals); ``bench_render`` draws bench's tables and plot. Every
"equal to eager" check goes through ``kvtrace.spec.tolerances``.

May import: ``spec`` … ``artifact``. They return reports; they never print or exit.
"""
