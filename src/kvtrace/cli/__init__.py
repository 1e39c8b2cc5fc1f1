"""The ``kvtrace`` command: the only code that prints or exits.

May import anything.
"""
