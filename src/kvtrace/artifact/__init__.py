"""Artifacts: one file holding programs, weights once, a checked manifest and the tokenizer.

``archive`` (the file format: manifest, member hashes, bounded reads, ``load``), ``export``
(``kvtrace.export``: source → decoder → captured programs → backend files → artifact), ``store``
(the per-user artifact cache: build once, heal corrupt entries).

May import: ``spec`` … ``runtime``.
"""
