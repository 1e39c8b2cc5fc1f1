"""Capture: Decoder programs traced with torch.export, with nothing of the caller changed.

``export`` (one torch.export program per ProgramSpec, dynamic T), ``preserve`` (snapshot/restore of a
model around a trace), ``contract`` (a captured program's shape contract, read from its ShapeEnv).

May import: ``spec``, ``cache``, ``models``, ``sources``.
"""
