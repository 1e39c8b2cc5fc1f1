"""Guard analysis: what torch.export logged while capturing, and the lengths a captured program refuses.

``recording_jit`` wraps ``kvtrace.jit(model, backend="eager")`` so every capture is kept with the
symbols and guards torch's symbolic-shapes logger reported (``_Capture``); ``_check_guards`` checks a
capture's guards, constant shapes, range constraints and runtime asserts against every (T, P) of its
size class (and, with sliding-window layers, of its regime: ``CallKey.regime``).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace.tools.lint import jit_view
from kvtrace.tools.lint.report import Finding

# Lengths a program must accept: a prompt or decode of 1 token, a cache holding 1 token, and up.
_T_VALUES = (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 100, 257, 1000, 4096)
_P_VALUES = (1, 2, 3, 5, 8, 11, 31, 100, 300, 1000, 4000)
_SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"


# --- what torch.export logged while capturing --------------------------------------------------------
@dataclass(frozen=True)
class _Guard:
    expr: str  # sympy text, in the capture's symbols (s0, s1, ...)
    where: str  # the model's line that added it: "path:12 in forward: code"


@dataclass
class _Capture:
    """One torch.export run of jit's ``_export``: the program, the call it was for, what was logged."""

    call: Any  # jit's reading of the call (see jit_view)
    exact: bool
    ep: torch.export.ExportedProgram | None = None
    baked: list[tuple[int, int]] = field(default_factory=list)
    symbols: dict[str, tuple[int, int]] = field(default_factory=dict)  # "s3" -> (arg, dim)
    guards: list[_Guard] = field(default_factory=list)


class _Recorder(logging.Handler):
    _SOURCE = re.compile(r"\[(\d+)\]\.size\(\)\[(\d+)\]$")

    def __init__(self, cap: _Capture):
        super().__init__(logging.INFO)
        self.cap = cap

    def emit(self, record: logging.LogRecord) -> None:
        msg, args = str(record.msg), record.args
        if not isinstance(args, tuple):
            return
        if msg.startswith("create_symbol %s = %s for %s") and len(args) >= 3:
            m = self._SOURCE.search(str(args[2]))  # L['flat'][3].size()[2]
            if m:
                self.cap.symbols[str(args[0])] = (int(m.group(1)), int(m.group(2)))
        elif "[guard added]" in msg and len(args) >= 3 and "suppressed" not in str(args[0]):
            self.cap.guards.append(_Guard(str(args[1]), _user_frame() or str(args[2]).strip("() ")))


# kvtrace: the whole package (the frames of jit, capture and lint themselves), not only this folder
_KVTRACE = sys.modules[__name__.split(".")[0]]
_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, logging, _KVTRACE))
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _user_frame() -> str:
    """The innermost frame on the current stack outside torch, sympy, kvtrace and the standard library
    (the model's own code, or transformers'): 'file:line in fn: code'."""
    for fr in reversed(traceback.extract_stack()):
        f = fr.filename
        if (f.startswith(_SKIP_DIRS) or f"{os.sep}sympy{os.sep}" in f or f.startswith("<")
                or (f.startswith(_STDLIB) and "-packages" not in f)):
            continue
        return f"{f.split('site-packages/')[-1]}:{fr.lineno} in {fr.name}" + (f": {fr.line.strip()}" if fr.line else "")
    return ""



def recording_jit(model: torch.nn.Module) -> tuple[Any, list[_Capture]]:
    """kvtrace.jit(model, backend="eager") that keeps every ExportedProgram it captures and its guards."""
    captures: list[_Capture] = []

    def record(call: Any, exact: bool, export: Any) -> Any:
        cap = _Capture(call, exact)
        captures.append(cap)
        with _shape_log(cap):
            cap.ep, cap.baked = export()
        return cap.ep, cap.baked

    return jit_view.recording_jit(model, record), captures


class _shape_log:
    """Collect what torch's symbolic-shapes logger says (INFO) without printing it.

    When INFO is off (the default), the logger's own handlers are set aside for the capture so raising
    the level prints nothing; when the user asked for these logs (TORCH_LOGS=dynamic) they still get them.
    """

    def __init__(self, cap: _Capture):
        self.handler = _Recorder(cap)
        self.logger = logging.getLogger(_SHAPES_LOG)

    def __enter__(self) -> None:
        lg = self.logger
        self.saved = (lg.level, lg.propagate, list(lg.handlers))
        if lg.isEnabledFor(logging.INFO):
            lg.addHandler(self.handler)
        else:
            lg.handlers = [self.handler]
            lg.propagate = False
            lg.setLevel(logging.INFO)

    def __exit__(self, *exc: Any) -> None:
        lg = self.logger
        lg.removeHandler(self.handler)
        lg.setLevel(self.saved[0])
        lg.propagate = self.saved[1]
        lg.handlers = self.saved[2]


# --- symbols -> roles (T, P, P+T) and the lengths a program must accept --------------------------------
def _seq_dims(call: Any, n_layers: int) -> list[tuple[str, int, str]]:
    """(arg description, sequence dim, role) for every program argument, in program order.

    Roles: ``T``, ``P``, ``P+T``, and for a sliding layer of window W its stored tail ``S<W>`` = min(P, W - 1).
    """

    out = []
    for name, t in zip(call.key.inputs, call.tensors, strict=True):
        role = "P+T" if name == "attention_mask" else "T"
        out.append((f"{name}", jit_view.seq_dim(name) % t.dim(), role))
    if call.key.cache.filled:
        windows = call.key.windows or (0,) * n_layers
        for i in jit_view.held_layers(call.key):
            role = f"S{windows[i]}" if windows[i] else "P"
            out += [(f"cache layer {i} {kv}", 2, role) for kv in ("keys", "values")]
        if jit_view.carries_past(call.key):
            out.append(("past length (cumulative_length of the sliding-window layers)", 1, "P"))
    return out


_ROLE_TEXT = {"T": "new-token count T", "P": "past length P", "P+T": "total length P+T"}


def _role_text(role: str) -> str:
    return _ROLE_TEXT.get(role) or f"stored tail min(P, {int(role[1:]) - 1}) of a window of {role[1:]}"


def _in_class(values: tuple[int, ...], size_class: int) -> tuple[int, ...]:
    """The values of one size class (CallKey.sizes): exactly 0 or 1, or every value >= 2."""
    return (size_class,) if size_class < 2 else tuple(v for v in values if v >= 2)


def _assignments(key: Any, max_len: int | None) -> list[dict[str, int]]:
    """Every (T, P) a program of ``key`` must accept: the lengths of its size classes, and with sliding
    layers of its regime (``CallKey.regime``; the lengths around each window added), with each window's
    stored tail ``S<W>`` = min(P, W - 1)."""

    wins = sorted({w for w in key.windows if w})
    # around each window's edges (P = W, P + T = W - 1) and past it: a handful of values per window
    near = tuple(sorted({v for w in wins for v in (*range(w - 4, w + 5), *(w - 1 - d for d in range(9)),
                                                   2 * w - 1, 2 * w, 2 * w + 1) if v >= 0}))
    t_values = tuple(sorted({*_T_VALUES, *near})) if wins else _T_VALUES
    p_values = tuple(sorted({*_P_VALUES, *near})) if wins else _P_VALUES
    ps = (0,) if key.cache.fresh else _in_class(p_values, key.sizes[1])
    out = []
    for t, p in itertools.product(_in_class(t_values, key.sizes[0]), ps):
        if max_len is not None and t + p > max_len:
            continue
        if wins and jit_view.regime(t, p, key.windows, key.cache.static) != key.regime:
            continue
        out.append({"T": t, "P": p, "P+T": p + t, **{f"S{w}": min(p, w - 1) for w in wins}})
    return out


def _sympy_locals(names: set[str]) -> dict[str, Any]:
    import sympy
    import torch.utils._sympy.functions as fns

    loc: dict[str, Any] = {n: getattr(fns, n) for n in dir(fns) if isinstance(getattr(fns, n), type)}
    loc.update({n: sympy.Symbol(n, integer=True) for n in names})
    return loc


def _violation(expr: Any, roles: dict[Any, str], assignments: list[dict[str, int]]) -> dict[str, int] | None:
    """The first valid (T, P) for which the boolean sympy ``expr`` is false; None if it always holds
    or cannot be decided (a symbol without a role, an expression that does not evaluate)."""
    import sympy

    free = getattr(expr, "free_symbols", set())
    if not free or any(s not in roles for s in free):
        return None
    for a in assignments:
        try:
            v = expr.xreplace({s: sympy.Integer(a[roles[s]]) for s in free})
        except Exception:
            return None
        if v is sympy.false or v is False:
            return a
        if v is not sympy.true and v is not True:
            return None
    return None


def _readable(expr: Any, names: dict[Any, str]) -> str:
    import sympy

    try:
        return str(expr.xreplace({s: sympy.Symbol(names[s]) for s in expr.free_symbols if s in names}))
    except Exception:
        return str(expr)


def _frame(node: torch.fx.Node | None) -> str:
    """The innermost frame of an FX node's stack trace: 'path:line in fn: code'."""
    if node is None:
        return ""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r'\s*File "(.+)", line (\d+), in (\S+)', lines[i])
        if m:
            path = m.group(1).split("site-packages/")[-1]
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{path}:{m.group(2)} in {m.group(3)}" + (f": {code}" if code else "")
    return ""


def _node_where(node: torch.fx.Node) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    frame = _frame(node)
    return f"node {node.name} ({target})" + (f" from {frame}" if frame else "")


def _program_name(call: Any) -> str:
    t_class, p_class = call.key.sizes
    fresh = call.key.cache.value == "dynamic-fresh"
    classes = ("T=1" if t_class == 1 else "T>=2") + ("" if fresh or p_class == 2 else f", P={p_class}")
    regime = f", {call.key.regime} the window" if call.key.regime else ""
    return f"{call.key.cache.value} program ({classes}{regime})"


# --- checks on one captured program --------------------------------------------------------------------
def _check_guards(cap: _Capture, n_layers: int, max_len: int | None) -> Iterator[Finding]:
    """Guards, constant shapes, range constraints and runtime asserts that refuse a valid length."""
    import sympy


    ep = cap.ep
    assert ep is not None
    prog = _program_name(cap.call)
    dims = _seq_dims(cap.call, n_layers)
    fresh = cap.call.key.cache.fresh
    assignments = _assignments(cap.call.key, max_len)
    # roles a size class holds at one value (T = 1, P = 1), or a sliding regime does (the tail W - 1 once
    # P >= W; P = W - 2 for a decode reaching the window): static on purpose, not a specialization
    fixed = {r for r, c in (("T", cap.call.key.sizes[0]), ("P", cap.call.key.sizes[1])) if c < 2}
    if {"T", "P"} <= fixed or (fresh and "T" in fixed):
        fixed.add("P+T")
    fixed |= {r for r in (assignments[0] if assignments else {}) if len({a[r] for a in assignments}) == 1}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]

    # symbol -> role: from the symbols export created for each argument, then from the placeholders.
    roles: dict[Any, str] = {}
    names: dict[Any, str] = {}
    for sym, (a, d) in cap.symbols.items():
        if a < len(dims) and d == dims[a][1]:
            s = sympy.Symbol(sym, integer=True)
            roles[s], names[s] = dims[a][2], f"{dims[a][0]}.shape[{d}]"
    for node, (desc, d, role) in zip(placeholders, dims, strict=False):
        size = node.meta["val"].shape[d]
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        if isinstance(expr, sympy.Symbol):
            s = sympy.Symbol(expr.name, integer=True)
            roles.setdefault(s, role)
            names.setdefault(s, f"{desc}.shape[{d}]")

    explained: set[str] = set()  # symbols a reported guard already accounts for
    loc = _sympy_locals({s.name for s in roles})
    seen: set[tuple[str, str]] = set()
    for g in cap.guards:
        try:
            expr = sympy.sympify(g.expr, locals=loc)
        except Exception:
            continue
        bad = _violation(expr, roles, assignments)
        if bad is None or (g.expr, g.where) in seen:
            continue
        seen.add((g.expr, g.where))
        explained |= {s.name for s in expr.free_symbols}
        which = sorted({roles[s] for s in expr.free_symbols})
        yield Finding(
            "specialization",
            f"{prog}: guard `{_readable(expr, names)}` ({g.expr}) does not hold for "
            + ", ".join(f"{r}={bad[r]}" for r in which)
            + f" ({', '.join(_role_text(r) for r in which)}): the program depends on a length",
            g.where,
        )

    # A dim meant to be symbolic that the program holds as a constant.
    for a, (node, (desc, d, role)) in enumerate(zip(placeholders, dims, strict=False)):
        size = node.meta["val"].shape[d]
        expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
        if not expr.is_number or role in fixed:
            continue
        if any(sa == (a, d) and sym in explained for sym, sa in cap.symbols.items()):
            continue
        yield Finding(
            "specialization",
            f"{prog}: {desc} dim {d} (the {_role_text(role)}) was captured as the constant {int(expr)}; "
            "the program only runs for that length",
            f"placeholder {node.name}",
        )
    # Range constraints narrower than the lengths a program must accept. Only upper bounds count: lower
    # bounds come from the capture's example sizes (>= 2, so a derived mask length P + T reads >= 4), and
    # kvtrace.jit runs programs without those example-derived range hooks; the short-length calls of the
    # scenario check the shortest lengths against eager instead.
    for expr, vr in ep.range_constraints.items():
        s = sympy.Symbol(str(expr), integer=True)
        if s not in roles or s.name in explained:
            continue
        bad = next((a for a in assignments if a[roles[s]] > vr.upper), None)
        if bad is not None:
            related = list(dict.fromkeys(f"`{g.expr}` at {g.where}" for g in cap.guards
                                         if re.search(rf"\b{s.name}\b", g.expr)))
            yield Finding(
                "specialization",
                f"{prog}: {names.get(s, s.name)} is constrained to [{vr.lower}, {vr.upper}]; a {_role_text(roles[s])} "
                f"of {bad[roles[s]]} (T={bad['T']}, P={bad['P']}) would be refused",
                f"range constraint of {s.name}" + (f", derived from guard {related[0]}" if related else ""),
            )
    # Runtime asserts inside the graph.
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default:
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        expr = getattr(getattr(val, "node", None), "expr", None)
        if expr is None:
            continue
        expr = expr.xreplace({s: sympy.Symbol(s.name, integer=True) for s in expr.free_symbols})
        if {s.name for s in expr.free_symbols} <= explained:
            continue
        bad = _violation(expr, roles, assignments)
        if bad is not None:
            yield Finding("specialization",
                          f"{prog}: runtime assert `{_readable(expr, names)}` fails for "
                          f"T={bad['T']}, P={bad['P']}", _node_where(node))
