"""Tools users run on their own models: ``verify`` (step-by-step logits and cache against eager),
``lint`` (what in a model's forward breaks capture), ``bench`` (prefill ms, decode tok/s, memory).

May import: ``spec`` … ``artifact``. They return reports; they never print or exit.
"""
