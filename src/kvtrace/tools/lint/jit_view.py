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
* ``_T_EX``, ``_P_EX``: the example lengths jit captures a T >= 2 / P >= 2 program with (``example_lengths``).

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
