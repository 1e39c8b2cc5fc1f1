"""Artifacts: one file holding programs, weights once, a checked manifest and the tokenizer.

``archive`` (the file format and what loading checks; ``Artifact`` and ``load``), ``write`` (program
signatures, weights stored once, the atomic write), ``reader`` (the file's hash, bounded zip reads, member
hashes, the weight table, recorded signatures), ``export`` (``kvtrace.export``: source → decoder →
captured programs → backend files → artifact), ``store`` (the per-user artifact cache: build once, heal
corrupt entries), ``tiered`` (answer on the eager programs while the artifact builds in a background
process, then swap the compiled programs into the sessions). Every backend-specific step is the backend's own (``kvtrace.backends.registry``).

May import: ``spec`` … ``runtime``.
"""
