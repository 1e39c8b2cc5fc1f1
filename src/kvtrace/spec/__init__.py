"""Specs: the small frozen descriptions everything else derives from.

``cache`` (CacheSpec, LayerSpec, LayerKind: what a KV cache is), ``program`` (ProgramSpec, InputSpec:
what each captured program takes and returns), ``tolerances`` (per-dtype verify tolerances, in one place).

Layer 1 of the flow: imports nothing from kvtrace but ``kvtrace._errors``.
"""
