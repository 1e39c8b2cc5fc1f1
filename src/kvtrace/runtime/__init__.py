"""Runtime: running programs over a declared cache.

``session`` (one cache per conversation: prefill, decode, reset, rewind, snapshot), ``generate``
(sampling, stop ids, streaming, stats), ``jit`` (``kvtrace.jit``: HF-style calls → prologue checks →
captured program → epilogue write-back into the caller's cache object).

May import: ``spec`` … ``backends``.
"""
