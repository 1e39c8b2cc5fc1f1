"""Runtime: running programs over a declared cache.

``session`` (one cache per conversation: prefill, decode, reset, rewind, snapshot, swap to other
programs of the same CacheSpec; ``eager_programs`` of a Decoder), ``graphs`` (decode replayed from CUDA graphs over
static buffers and the session's own state; ``EagerCapturer`` without a GPU), ``generate``
(sampling, stop ids, streaming, stats), ``grammar`` (structured output: a ``Constraint`` — JSON schema, regex,
Lark grammar — compiled for a tokenizer, masking what it does not allow next; on llguidance), ``speculate``
(prompt-lookup drafts and when they pay), ``slots`` (``SlotEngine``: many conversations over one batched cache),
``prefix`` (the prompt prefix a cache already holds), ``chat`` (``Conversation``: many turns on one session, each
prefilling only its new tokens; undo, save/load), ``jit`` (``kvtrace.jit``: HF-style calls → prologue checks →
captured program → epilogue write-back into the caller's cache object), with its parts ``jit_call`` (the
prologue: CallKey, size classes, sliding-window regimes, argument layout), ``jit_examples`` (capture
examples, per sliding regime inside it), ``jit_cross``
(cross-attention input checks) and ``jit_state`` (Python state a forward keeps, weight identity).

May import: ``spec`` … ``backends``.
"""
