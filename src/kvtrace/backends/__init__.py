"""Backends: how captured programs become files in an artifact and callables again.

``base`` (the ``Backend`` protocol: name, capabilities, ``compile`` and ``load`` with its checks),
``registry`` (``get``/``names``/``register``: every consumer asks it, none compares names),
``exported`` (torch.export programs as JSON), ``aoti`` (AOTInductor: one library per program; also the
compile options, the compiled library loader and its constants table that kvtrace.jit uses),
``aoti_packed`` (one AOTInductor program with frozen, prepacked weights), ``pt2`` (what of a .pt2
package is read), ``tempcopy`` (the private temp copies a load maps), ``executorch`` (an ExecuTorch ``.pte`` of its own format holding the cache as initialized
mutable buffers; needs the ``executorch`` extra, imported on use). Modules here import torch inside functions only.

May import: ``spec`` … ``capture``.
"""
