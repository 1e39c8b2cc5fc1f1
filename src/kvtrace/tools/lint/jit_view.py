"""Everything lint reads of ``kvtrace.runtime.jit`` beyond its public API, in one place.

Lint drives ``kvtrace.jit(model, backend="eager")`` through its scenario and inspects what it captured,
which needs a few of jit's internals. Nothing else in ``kvtrace.tools.lint`` imports
``kvtrace.runtime.jit`` or touches a private attribute of a ``JittedModel``. What it reads:

* ``JittedModel._export(call, exact) -> (ExportedProgram, baked)``: overridden (``recording_jit``) to record
  every capture, and called again (``export_again``) to capture a program with other example lengths;
* ``JittedModel._programs``: the ``CallKey`` of every program captured so far (``program_keys``);
* ``_Call``, jit's reading of one call: its fields ``key`` (a ``CallKey``: ``cache``, ``inputs``, ``sizes``),
  ``tensors`` (the input tensors, in ``key.inputs`` order) and ``past_len`` (``with_lengths``);
* ``_SEQ_DIM``: the sequence dim of each named input (``seq_dim``);
* ``_T_EX``, ``_P_EX``: the example lengths jit captures a T >= 2 / P >= 2 program with (``example_lengths``);
  for a key with sliding layers ``jit_examples.sliding_lengths`` (``sliding_example_lengths``);
* ``jit_call``: ``sliding_regime`` (``regime``: which regime a (T, P) is in), ``_held`` and ``_carries_past``
  (``held_layers``, ``carries_past``: the program's cache arguments).

Public and read directly elsewhere: ``JittedModel.stats`` (``captures``, ``specializations``) and the
``CallKey`` fields.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

# record(call, exact, export) -> what export() returns; export() runs jit's own _export for that call
Recorder = Callable[[Any, bool, Callable[[], Any]], Any]


def recording_jit(model: torch.nn.Module, record: Recorder) -> Any:
    """``kvtrace.jit(model, backend="eager")`` whose every torch.export capture goes through ``record``."""
    from kvtrace.runtime.jit import JittedModel

    class _LintJit(JittedModel):
        def _export(self, call: Any, exact: bool) -> Any:
            return record(call, exact, functools.partial(super()._export, call, exact))

    return _LintJit(model, backend="eager")


def export_again(jm: Any, call: Any) -> Any:
    """jit's own capture of ``call`` at exactly its sizes, neither recorded nor stored: (program, baked)."""
    from kvtrace.runtime.jit import JittedModel

    return JittedModel._export(jm, call, exact=True)


def program_keys(jm: Any) -> list[Any]:
    """The ``CallKey`` of every program ``jm`` holds, in capture order."""
    return list(jm._programs)


def with_lengths(call: Any, tensors: list[torch.Tensor], past: int) -> Any:
    """The same call (same key) with other input tensors and past length."""
    return dataclasses.replace(call, tensors=tensors, past_len=past)


def seq_dim(name: str) -> int:
    """The sequence dim of the input ``name`` (may be negative)."""
    from kvtrace.runtime.jit import _SEQ_DIM

    return _SEQ_DIM[name]


def example_lengths() -> tuple[int, int]:
    """(T, P) jit captures a T >= 2 / P >= 2 program with."""
    from kvtrace.runtime.jit import _P_EX, _T_EX

    return _T_EX, _P_EX


def sliding_example_lengths(key: Any, target: tuple[int, int] | None = None,
                            avoid: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """(T, P) jit captures a program of ``key`` (a key with sliding layers) with, or with ``target`` /
    ``avoid`` another pair of its regime and size classes (None: there is no other)."""
    from kvtrace.runtime.jit_examples import sliding_lengths

    kw = {} if target is None else {"target": (target[1], target[0])}
    found = sliding_lengths(key, **kw, avoid=None if avoid is None else (avoid[1], avoid[0]))
    return None if found is None else (found[1], found[0])


def regime(t_len: int, past: int, windows: tuple[int, ...], static: bool = False) -> str:
    """The sliding regime a call of ``t_len`` tokens at past length ``past`` is in (``CallKey.regime``);
    ``static``: the windows are a StaticCache's."""
    from kvtrace.runtime.jit_call import sliding_regime

    return sliding_regime(t_len, past, windows, static)


def held_layers(key: Any) -> tuple[int, ...]:
    """The cache layers whose keys and values a program of ``key`` takes, in argument order."""
    from kvtrace.runtime.jit_call import _held

    return _held(key)


def carries_past(key: Any) -> bool:
    """The program of ``key`` takes P as the size of a ``[0, P]`` tensor after the held layers."""
    from kvtrace.runtime.jit_call import _carries_past

    return _carries_past(key)
