"""Model families: adapters from a transformers model to a Decoder (``spec.decoder``) + CacheSpec.

``registry`` (``Family``: a predicate on the HF config + a builder + a priority + the quantized caches it
offers, ``kv_dtypes``; ``make_decoder`` asks the families in order), ``llama`` (Llama-architecture decoders
written out directly, sliding-window layers as rings, int8 KV caches: Llama, Qwen2, Mistral, Qwen3, SmolLM3, Granite, OLMo2, Phi-3), ``llama_args``
(``LlamaArgs``: each of those families' quirks read once from its HF config, and ``supports``, which
refuses what ``llama`` does not reproduce), ``gemma`` (Gemma, Gemma 2 and Gemma 3 text written out:
scaled embeddings, (1 + w) norms, soft-capping, q/k norms, per-layer-type RoPE, hybrid local/global
layers as rings; asked with ``llama``), ``mllama`` (Llama 3.2 Vision's text decoder with its
cross-attention cache), ``hf_generic`` (any HF decoder-only causal LM whose layers are full or sliding
attention, run by HF's own modules behind the uniform step; asked last; refused only for a cache kind
or feature it cannot express, named), ``hf_attention`` (what hf_generic swaps into HF's modules: the
per-call cache object over the state buffers and the attention function registered with transformers'
``AttentionInterface``), ``quant`` (quantized weights: ``quantize_decoder`` swaps a decoder's linear layers and embedding for int8 /
int4 / 8da4w modules over torch's CPU kernels or a GGUF's own blocks, and builds verify's dequantized reference),
``step`` (what those decoders share at their edge: ``forward`` / ``forward_live``
over their ``_run``, and which programs to export). Each family module defines its ``FAMILY``; adding a family is one module plus
its name in ``registry.BUILTIN`` (or a ``registry.register`` call).

May import: ``spec``, ``cache``.
"""
