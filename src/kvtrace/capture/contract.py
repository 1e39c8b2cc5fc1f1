"""What a captured program assumes about its arguments' shapes, checked on the host before every run.

torch.export traces with example sizes and records every assumption the trace made about them in the
program's ShapeEnv: the *guards* (``s0 <= 6`` from ``if past > 6:``, ``Eq(s0, 5)`` from ``int(past)``,
``Eq(s1, s0 + s2)`` from a mask of length P + T), the *shape of each placeholder* (a symbol, a derived
expression such as ``s0 + s2``, or a constant: a size the trace baked in) and the symbols' *ranges*.
``ep.module()`` checks part of that; an AOTInductor program checks none of it. A ``Contract`` holds all of it
as one compiled predicate over the argument shapes (a few integer comparisons), so a program is never run on
a call it was not traced for: kvtrace.jit checks it in the prologue and captures another program instead.

Left out on purpose: torch.export reasons as if every dynamic size were >= 2 (it specialises 0 and 1, so the
examples are >= 2) without recording a guard for it, so a branch on a length being 0 or 1 leaves no trace
in any contract. kvtrace.jit therefore keys programs on the size class of T and P (``CallKey.sizes``: 0, 1
or >= 2) and traces a T = 1 or P = 1 program at exactly that size: a program traced at >= 2 never runs a
size-1 call. The lower bounds of the ranges (``[2, oo]`` for a size, ``[4, oo]`` for a sum of two) are then
implied by the key, not checked here.
"""

from __future__ import annotations

import math
import os
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Condition", "Contract", "frame_text", "model_line"]

# A symbol's source, as torch.export names the size of a positional argument: L['flat'][3].size()[2].
_SOURCE = re.compile(r"^L\['\w+'\]\[(\d+)\]\.size\(\)\[(\d+)\]$")
_GLOBALS = {"math": math}  # what PythonPrinter's output may call besides builtins (min, max, abs, ...)


@dataclass(frozen=True)
class Condition:
    """One assumption: Python over the bound size symbols, its readable form, the line that made it."""

    code: str  # e.g. "s13 <= 6"
    text: str  # e.g. "cache layer 1 keys.shape[2] <= 6"
    where: str = ""  # "model.py:12 in forward: if past > 6:" ("" for a placeholder's shape)
    symbols: tuple[str, ...] = ()
    args: tuple[int, ...] = ()  # the arguments whose sizes it reads


def frame_text(frame: traceback.FrameSummary | str | None) -> str:
    """'path:line in fn: code' (path from site-packages on) for a frame; '' for none."""
    if frame is None or isinstance(frame, str):
        return frame or ""
    path = frame.filename.split("site-packages/")[-1]
    return f"{path}:{frame.lineno} in {frame.name}" + (f": {frame.line.strip()}" if frame.line else "")


class Contract:
    """Everything ``ep`` assumes about the shapes of its user inputs, as a cheap host-side check.

    ``names``: one description per user input, in program order (for messages only). ``waive``: conditions
    the caller knows the program does not need (kept in ``waived``, not checked).
    Invariant: ``admits(shapes)`` is False for any argument shapes some recorded guard, placeholder shape or
    range upper bound of ``ep`` rejects; it costs one Python call and a comparison per condition.
    """

    def __init__(self, ep: torch.export.ExportedProgram, names: Sequence[str],
                 waive: Callable[[Condition], bool] | None = None):
        import sympy
        from torch.export.exported_program import _get_shape_env
        from torch.utils._sympy.numbers import int_oo
        from torch.utils._sympy.printers import PythonPrinter

        inputs = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
        vals = [n.meta["val"] for n in inputs]
        self.ranks = tuple(len(v.shape) if isinstance(v, torch.Tensor) else -1 for v in vals)
        shape_env = _get_shape_env(ep.graph_module)
        self.bound: dict[str, tuple[int, int]] = {}  # symbol name -> (arg, dim) it is read from
        for sym, sources in (shape_env.var_to_sources.items() if shape_env is not None else ()):
            for src in sources:
                m = _SOURCE.match(src.name)
                if m and int(m.group(1)) < len(vals):
                    self.bound.setdefault(str(sym), (int(m.group(1)), int(m.group(2))))
                    break
        self.names = list(names)
        printer = PythonPrinter()

        def readable(expr: Any) -> str:
            subs = {s: sympy.Symbol(self._dim_name(*self.bound[s.name])) for s in expr.free_symbols
                    if s.name in self.bound}
            return str(expr.xreplace(subs))

        def checkable(expr: Any) -> bool:
            return all(s.name in self.bound for s in expr.free_symbols)

        guards: list[Condition] = []
        self.skipped = 0  # assumptions over symbols no argument size gives (kept in the graph as asserts)
        for g in (shape_env.guards if shape_env is not None else ()):
            if not checkable(g.expr):
                self.skipped += 1
                continue
            syms = tuple(sorted(s.name for s in g.expr.free_symbols))
            guards.append(Condition(printer.doprint(g.expr), readable(g.expr),
                                    g.sloc.maybe_user_loc or frame_text(g.sloc.framework_loc), syms,
                                    tuple(sorted({self.bound[s][0] for s in syms}))))
        self.waived = tuple(g for g in guards if waive is not None and waive(g))
        guards = [g for g in guards if g not in self.waived]
        self.guards = tuple(guards)
        conds: list[Condition] = []
        for a, v in enumerate(vals):  # placeholder shapes: constants, and sizes equal to other sizes
            if not isinstance(v, torch.Tensor):
                continue
            for d, size in enumerate(v.shape):
                expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
                if isinstance(expr, sympy.Symbol) and self.bound.get(expr.name) == (a, d):
                    continue
                if not checkable(expr):
                    self.skipped += 1
                    continue
                conds.append(Condition(f"S[{a}][{d}] == ({printer.doprint(expr)})",
                                       f"{self._dim_name(a, d)} == {readable(expr)}", self.origin(a, d),
                                       tuple(sorted(s.name for s in expr.free_symbols))))
        conds += guards
        for sym, vr in ep.range_constraints.items():  # upper bounds only (see the module docstring)
            if str(sym) in self.bound and vr.upper != int_oo and vr.upper.is_number:
                conds.append(Condition(f"{sym} <= {int(vr.upper)}", f"{readable(sym)} <= {int(vr.upper)}",
                                       "range constraint", (str(sym),)))
        self.conditions = tuple(conds)
        binds = "".join(f"    {s} = S[{a}][{d}]\n" for s, (a, d) in self.bound.items())
        body = " and ".join(f"({c.code})" for c in conds) or "True"
        scope: dict[str, Any] = {}
        exec(compile(f"def admits(S):\n{binds}    return bool({body})\n", "<kvtrace contract>", "exec"),
             dict(_GLOBALS), scope)
        self._admits = scope["admits"]

    def _dim_name(self, a: int, d: int) -> str:
        return f"{self.names[a] if a < len(self.names) else f'arg {a}'}.shape[{d}]"

    def admits(self, shapes: Sequence[Sequence[int]]) -> bool:
        """Whether the program was traced for arguments of these shapes (one shape per user input)."""
        return tuple(map(len, shapes)) == self.ranks and self._admits(shapes)

    def violation(self, shapes: Sequence[Sequence[int]]) -> str | None:
        """One line: the first assumption these shapes break and the sizes involved; None if admitted."""
        if tuple(map(len, shapes)) != self.ranks:
            return f"the program takes {len(self.ranks)} arguments of ranks {list(self.ranks)}, got " \
                   f"{[len(s) for s in shapes]}"
        env = {s: shapes[a][d] for s, (a, d) in self.bound.items()}
        for c in self.conditions:
            if not eval(c.code, dict(_GLOBALS), {**env, "S": shapes}):  # code printed from sympy: integer arithmetic
                sizes = ", ".join(f"{self._dim_name(*self.bound[s])} = {env[s]}" for s in c.symbols)
                head = c.text if not c.code.startswith("S[") else f"{c.text} (found {self._found(c, shapes)})"
                return f"`{head}`" + (f" (from {c.where})" if c.where else "") + (f" fails for {sizes}" if sizes else "")
        return None

    def _found(self, c: Condition, shapes: Sequence[Sequence[int]]) -> int:
        a, d = (int(x) for x in re.findall(r"\d+", c.code)[:2])
        return int(shapes[a][d])

    def origin(self, a: int, d: int) -> str:
        """The source line of the guard that fixed the size at (arg ``a``, dim ``d``); '' if none.

        Most specific first: an equality of that size alone (``Eq(s0, 5)``: it was specialised), then any guard
        on it alone, then any guard it takes part in.
        """
        syms = {s for s, ad in self.bound.items() if ad == (a, d)}
        about = [g for g in self.guards if g.where and syms & set(g.symbols)]
        about.sort(key=lambda g: (len(g.symbols) > 1, "==" not in g.code))
        return about[0].where if about else ""


_TORCH = os.path.dirname(torch.__file__) + os.sep
_KVTRACE = os.path.dirname(__file__) + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep


def model_line(exc: BaseException) -> str:
    """The innermost frame of ``exc`` (or of what caused it) in the model's code: outside torch, sympy,
    kvtrace and the standard library ('path:line in fn: code'; transformers' own lines count)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for fr in reversed(traceback.extract_tb(e.__traceback__)):
            f = fr.filename
            if (f.startswith((_TORCH, _KVTRACE)) or f"{os.sep}sympy{os.sep}" in f or f.startswith("<")
                    or (f.startswith(_STDLIB) and "-packages" not in f)):
                continue
            return frame_text(fr)
        e = e.__cause__ or e.__context__
    return ""
