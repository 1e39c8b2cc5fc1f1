"""Model sources: names, HF directories and GGUF files resolved, checked, converted and loaded.

``resolve`` (a name / path -> ``ModelSource`` with its content digest; never imports transformers),
``gguf`` (the GGUF header and tensor table walked and checked against ``general.architecture``),
``gguf_convert`` (a checked GGUF -> config, fp32 state dict and tokenizer, as transformers converts it, fast),
``load`` (``load_model``: an HF causal LM + fast tokenizer, GGUFs dequantized once into the weights
cache), ``gguf_blocks`` (``GGUFBlocks``: a GGUF's Q4_0/Q4_1/Q8_0 blocks found again, row by row, for the weights of
a decoder built from its dequantized model: ``--quant gguf``), ``store`` (the weights cache folder: ``cache_dir``, ``list_cache``, ``clear_cache``), ``chat``
(HF-style chat templates rendered without transformers; ``encode_prompt`` for one user prompt).

May import: ``spec``, ``cache``, ``models``.
"""
