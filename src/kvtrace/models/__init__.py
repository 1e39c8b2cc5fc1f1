"""Model families: adapters from a transformers model to a Decoder (``spec.decoder``) + CacheSpec.

``registry`` (``Family``: a predicate on the HF config + a builder + a priority; ``make_decoder`` asks
the families in order), ``llama`` (Llama-architecture decoders written out directly, sliding-window
layers as rings: Llama, Qwen2, Mistral, Qwen3, SmolLM3, Granite, OLMo2, Phi-3), ``llama_args``
(``LlamaArgs``: each of those families' quirks read once from its HF config, and ``supports``, which
refuses what ``llama`` does not reproduce), ``mllama`` (Llama 3.2 Vision's text decoder with its cross-attention cache), ``hf_generic`` (any supported HF
causal LM behind the uniform step; asked last). Each family module defines its ``FAMILY``; adding a
family is one module plus its name in ``registry.BUILTIN`` (or a ``registry.register`` call).

May import: ``spec``, ``cache``.
"""
