"""Specs: the small frozen descriptions everything else derives from.

``cache`` (CacheSpec, LayerSpec, LayerKind: what a KV cache is, incl. the int8 option ``kv_dtype`` and
``layer_state``, a layer's tensors of the flat state), ``program`` (ProgramSpec, InputSpec:
what each captured program takes and returns), ``decoder`` (the Decoder protocol every model family
builds: ``cache_spec`` + ``forward(tokens, input_pos, *cache) -> logits``), ``config`` (reading HF
config objects: head_dim, KV heads, RoPE type, max positions, sliding window, layer types),
``quant`` (QuantSpec: a decoder's quantized weights, scheme and per-module format, recorded in the manifest),
``manifest`` (Manifest, ModelInfo: an artifact's versioned JSON root, its field checks, and the inputs
it says each program takes), ``device`` (cpu / cuda: naming a device, the one-line refusal of a GPU that is
not there), ``tolerances`` (per-dtype verify tolerances, and the int8 cache's one-step ``kv_tolerance``, in one place).

Layer 1 of the flow: imports nothing from kvtrace but ``kvtrace._errors``.
"""
