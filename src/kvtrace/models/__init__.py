"""Model families: adapters from a transformers model to a Decoder (``spec.decoder``) + CacheSpec.

``registry`` (``Family``: a predicate on the HF config + a builder + a priority + the quantized caches it
offers, ``kv_dtypes``; ``make_decoder`` asks the families in order), ``llama`` (Llama-architecture decoders
written out directly, sliding-window layers as rings, int8 KV caches), ``mllama`` (Llama 3.2 Vision's
text decoder with its cross-attention cache), ``hf_generic`` (any supported HF causal LM behind the uniform
step; asked last). Each family module defines its ``FAMILY``; adding a
family is one module plus its name in ``registry.BUILTIN`` (or a ``registry.register`` call).

May import: ``spec``, ``cache``.
"""
