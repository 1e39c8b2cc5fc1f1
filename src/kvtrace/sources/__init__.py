"""Model sources: names, HF directories and GGUF files resolved, checked, converted and loaded.

May import: ``spec``, ``cache``, ``models``.
"""
