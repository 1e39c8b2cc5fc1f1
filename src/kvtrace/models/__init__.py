"""Model families: adapters from a transformers model to a Decoder + CacheSpec.

``llama`` (Llama-architecture decoders written out directly), ``mllama`` (Llama 3.2 Vision's text
decoder with its cross-attention cache), ``hf_generic`` (any supported HF causal LM behind the uniform
step, and ``make_decoder``, which picks the family).

May import: ``spec``, ``cache``.
"""
