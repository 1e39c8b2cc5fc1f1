"""Backends: how captured programs become files in an artifact and callables again.

``aoti`` (AOTInductor: compile options, the compiled library loader and its constants table).

May import: ``spec`` … ``capture``.
"""
