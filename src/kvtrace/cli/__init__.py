"""The ``kvtrace`` command: the only code that prints or exits.

``main`` (parser assembly, exit codes, one-line errors), ``ui`` (stderr progress, stdout results,
output paths probed first), ``args`` (checked argparse types), and one module per command:
``generate``, ``chat``, ``run``, ``export``, ``verify``, ``lint``, ``cache``, ``bench``, each with its
``cmd_<name>(args, ui)`` and a ``register(add)`` that declares its flags.

May import anything.
"""
