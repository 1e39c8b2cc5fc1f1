"""kvtrace lint: will a model capture cleanly under ``kvtrace.jit``, for every length, without side effects?

``lint(model)`` drives ``kvtrace.jit(model, backend="eager")`` through a fixed scenario that changes
every length within the programs a correct model needs: one per cache kind (fresh or filled
DynamicCache) and size class of T and P (1, or >= 2: torch.export specialises size 1, see
``kvtrace.runtime.jit.CallKey.sizes``)::

    call 1  prefill 5 tokens on a fresh DynamicCache      -> captures the "dynamic-fresh" program (T>=2)
    call 2  decode 1 token at position 5                   -> captures the "dynamic" program (T=1)
    call 3  prefill 9 tokens on another fresh DynamicCache -> must reuse program 1
    call 4  extend by 3 tokens at position 9               -> captures the "dynamic" program (T>=2)
    call 5  prefill 1 token on a fresh DynamicCache        -> captures the "dynamic-fresh" program (T=1)
    call 6  decode 1 token at position 1                   -> captures the "dynamic" program (T=1, P=1)

and reports, as ``Finding(kind, message, where)``:

* ``recapture``      a call captured a program beyond those (EXPECTED_PROGRAMS), or jit had to pin a length;
* ``specialization`` a guard or a constant shape in a captured program refuses a sequence length or
                     position it must accept (any T and P of its size class; checked against
                     the program's placeholders, range constraints and runtime asserts, and the guards
                     torch.export logged, with the source line that added them), or the graph's
                     structure changes with the length;
* ``baked-constant`` a literal in the graph (or a lifted constant tensor) that changes when the same
                     program is captured with other example lengths: a length or position baked in;
* ``mutation``       the call left the caller's cache, inputs or model different from what eager leaves
                     (or, when it failed, different from before the call);
* ``mismatch``       the logits differ from eager's beyond the dtype's tolerance;
* ``error``          a call raised (e.g. a captured program refused a length it had guarded on).

``where`` is as precise as the engine allows: the source line that added a guard, the FX node name
and the innermost frame of its ``stack_trace``, or the call of the scenario.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import itertools
import json
import logging
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrace._errors import one_line
from kvtrace.spec.tolerances import tolerance_for

__all__ = ["KINDS", "Finding", "LintReport", "lint", "run_cli_lint"]

KINDS = ("recapture", "specialization", "baked-constant", "mutation", "mismatch", "error")
# (prompt length, then tokens added to the filled cache): every length and start position differs.
# (prompt tokens, then new tokens): a decode, an extend, and the shortest lengths (T = 1, P = 1).
SCENARIO = ((5, 1), (9, 3), (1, 1))
# One program per cache kind and size class of (T, P) (kvtrace.runtime.jit.CallKey.sizes: torch.export specialises
# sizes 0 and 1): the scenario's classes are fresh T >= 2, fresh T = 1, decode T = 1 at P >= 2 and at P = 1,
# extend T >= 2 at P >= 2.
EXPECTED_PROGRAMS = len({(p == 0, min(t, 2), min(p, 2)) for prompt, more in SCENARIO
                         for t, p in ((prompt, 0), (more, prompt))})
# Example sizes of the second capture of each program (the first one is jit's own, _T_EX/_P_EX).
_T_B, _P_B = 7, 11
# Lengths a program must accept: a prompt or decode of 1 token, a cache holding 1 token, and up.
_T_VALUES = (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 100, 257, 1000, 4096)
_P_VALUES = (1, 2, 3, 5, 8, 11, 31, 100, 300, 1000, 4000)
_SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"
_MAX_LITERAL_FINDINGS = 5  # per program; the rest are counted in the last message


@dataclass(frozen=True)
class Finding:
    kind: str  # one of KINDS
    message: str
    where: str = ""  # source line / FX node / scenario call it comes from

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}" + (f"\n    at {self.where}" if self.where else "")


@dataclass(frozen=True)
class LintReport:
    model: str
    calls: tuple[str, ...]  # the scenario, one description per call
    captures: int  # programs kvtrace.jit captured over the scenario
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.findings

    passed = ok

    def of_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def lines(self) -> list[str]:
        head = (f"kvtrace lint {self.model}: {len(self.calls)} calls, {self.captures} program(s) captured "
                f"(expected {EXPECTED_PROGRAMS}): ")
        if self.ok:
            return [head + "no findings"]
        return [head + f"{len(self.findings)} finding(s)", *(str(f) for f in self.findings)]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "ok": self.ok, "calls": list(self.calls), "captures": self.captures,
                           "findings": [dataclasses.asdict(f) for f in self.findings]}, indent=2)


# --- what torch.export logged while capturing --------------------------------------------------------
@dataclass(frozen=True)
class _Guard:
    expr: str  # sympy text, in the capture's symbols (s0, s1, ...)
    where: str  # the model's line that added it: "path:12 in forward: code"


@dataclass
class _Capture:
    """One torch.export run of jit's ``_export``: the program, the call it was for, what was logged."""

    call: Any  # kvtrace.runtime.jit._Call
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


_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, logging, sys.modules[__package__]))
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


def _recording_jit(model: torch.nn.Module) -> Any:
    """kvtrace.jit(model, backend="eager") that keeps every ExportedProgram it captures and its guards."""
    from kvtrace.runtime.jit import JittedModel

    class _LintJit(JittedModel):
        def __init__(self, *a: Any, **k: Any):
            super().__init__(*a, **k)
            self.lint_captures: list[_Capture] = []

        def _export(self, call: Any, exact: bool) -> Any:
            cap = _Capture(call, exact)
            self.lint_captures.append(cap)
            with _shape_log(cap):
                cap.ep, cap.baked = super()._export(call, exact)
            return cap.ep, cap.baked

    return _LintJit(model, backend="eager")


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
    """(arg description, sequence dim, role) for every program argument, in program order."""
    from kvtrace.cache.hf import CacheKind
    from kvtrace.runtime.jit import _SEQ_DIM

    out = []
    for name, t in zip(call.key.inputs, call.tensors, strict=True):
        role = "P+T" if name == "attention_mask" else "T"
        out.append((f"{name}", _SEQ_DIM[name] % t.dim(), role))
    if call.key.cache is CacheKind.DYNAMIC:
        for i in range(2 * n_layers):
            out.append((f"cache layer {i // 2} {'keys' if i % 2 == 0 else 'values'}", 2, "P"))
    return out


_ROLE_TEXT = {"T": "new-token count T", "P": "past length P", "P+T": "total length P+T"}


def _in_class(values: tuple[int, ...], size_class: int) -> tuple[int, ...]:
    """The values of one size class (CallKey.sizes): exactly 0 or 1, or every value >= 2."""
    return (size_class,) if size_class < 2 else tuple(v for v in values if v >= 2)


def _assignments(key: Any, max_len: int | None) -> list[dict[str, int]]:
    """Every (T, P) a program of ``key`` must accept: the lengths of its size classes."""
    from kvtrace.cache.hf import CacheKind

    ps = (0,) if key.cache is CacheKind.DYNAMIC_FRESH else _in_class(_P_VALUES, key.sizes[1])
    out = []
    for t, p in itertools.product(_in_class(_T_VALUES, key.sizes[0]), ps):
        if max_len is None or t + p <= max_len:
            out.append({"T": t, "P": p, "P+T": p + t})
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
    return f"{call.key.cache.value} program ({classes})"


# --- checks on one captured program --------------------------------------------------------------------
def _check_guards(cap: _Capture, n_layers: int, max_len: int | None) -> Iterator[Finding]:
    """Guards, constant shapes, range constraints and runtime asserts that refuse a valid length."""
    import sympy

    from kvtrace.cache.hf import CacheKind

    ep = cap.ep
    assert ep is not None
    prog = _program_name(cap.call)
    dims = _seq_dims(cap.call, n_layers)
    fresh = cap.call.key.cache is CacheKind.DYNAMIC_FRESH
    assignments = _assignments(cap.call.key, max_len)
    # roles a size class holds at one value (T = 1, P = 1): static on purpose, not a specialization
    fixed = {r for r, c in (("T", cap.call.key.sizes[0]), ("P", cap.call.key.sizes[1])) if c < 2}
    if {"T", "P"} <= fixed or (fresh and "T" in fixed):
        fixed.add("P+T")
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
            + f" ({', '.join(_ROLE_TEXT[r] for r in which)}): the program depends on a length",
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
            f"{prog}: {desc} dim {d} (the {_ROLE_TEXT[role]}) was captured as the constant {int(expr)}; "
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
                f"{prog}: {names.get(s, s.name)} is constrained to [{vr.lower}, {vr.upper}]; a {_ROLE_TEXT[roles[s]]} "
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


def _leaves(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from _leaves(x[k])
    else:
        yield x


def _literal(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _diff_programs(prog: str, a: _Capture, b: _Capture, sizes_a: str, sizes_b: str) -> Iterator[Finding]:
    """The same program captured with other example lengths must be the same graph, literal for literal."""
    assert a.ep is not None and b.ep is not None
    na, nb = list(a.ep.graph.nodes), list(b.ep.graph.nodes)
    sig = lambda n: (n.op, str(n.target), len(n.args))  # noqa: E731
    sm = difflib.SequenceMatcher(a=[sig(n) for n in na], b=[sig(n) for n in nb], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        extra = nb[j1:j2] or na[i1:i2]  # what one capture has and the other lacks (or replaces)
        first = next((n for n in extra if n.op not in ("placeholder", "output")), extra[0])
        side = sizes_b if nb[j1:j2] else sizes_a
        yield Finding(
            "specialization",
            f"{prog}: the graphs captured with {sizes_a} and with {sizes_b} differ ({len(na)} vs {len(nb)} nodes); "
            f"node {first.name} is only in the one with {side}: the model branches on a length",
            _node_where(first),
        )
        return
    found = 0
    for x, y in zip(na, nb, strict=True):
        lx = [v for v in _leaves((x.args, x.kwargs)) if _literal(v)]
        ly = [v for v in _leaves((y.args, y.kwargs)) if _literal(v)]
        if lx == ly:
            continue
        found += 1
        if found <= _MAX_LITERAL_FINDINGS:
            pairs = [(u, v) for u, v in itertools.zip_longest(lx, ly) if u != v]
            u, v = pairs[0] if pairs else (lx, ly)
            yield Finding(
                "baked-constant",
                f"{prog}: node {x.name} holds the literal {u} when captured with {sizes_a} and {v} with {sizes_b}: "
                "a length or position was baked into the graph",
                _node_where(x),
            )
    if found > _MAX_LITERAL_FINDINGS:
        yield Finding("baked-constant", f"{prog}: {found - _MAX_LITERAL_FINDINGS} more nodes hold literals that "
                      f"change with the example lengths", "")
    for name, t in a.ep.constants.items():
        u = b.ep.constants.get(name)
        if isinstance(t, torch.Tensor) and isinstance(u, torch.Tensor) and (
                t.shape != u.shape or not torch.equal(t, u)):
            yield Finding("baked-constant",
                          f"{prog}: the lifted constant {name} changes with the example lengths "
                          f"({list(t.shape)} with {sizes_a}, {list(u.shape)} with {sizes_b})",
                          f"constant {name}")


def _recapture_with(jm: Any, cap: _Capture, t_len: int, past: int) -> _Capture:
    """Capture the same program (same key) again with example lengths T=t_len, P=past."""
    from kvtrace.cache.hf import CacheKind
    from kvtrace.runtime.jit import _SEQ_DIM, JittedModel

    call = cap.call
    if call.key.cache is CacheKind.DYNAMIC_FRESH:
        past = 0
    tensors = []
    for name, t in zip(call.key.inputs, call.tensors, strict=True):
        size = list(t.shape)
        size[_SEQ_DIM[name] % t.dim()] = past + t_len if name == "attention_mask" else t_len
        tensors.append(torch.zeros(size, dtype=t.dtype, device=t.device))
    other = _Capture(dataclasses.replace(call, tensors=tensors, past_len=past), exact=True)
    with _shape_log(other), torch.no_grad():
        other.ep, other.baked = JittedModel._export(jm, other.call, exact=True)
    return other


# --- the caller's objects: snapshot and compare -----------------------------------------------------
def _state(obj: Any, path: str, out: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    """Flatten an object (a cache, a dict of inputs) to path -> tensor copy / plain value."""
    if isinstance(obj, torch.Tensor):
        out[path] = obj.detach().clone()
    elif isinstance(obj, (list, tuple)):
        out[path + ".__len__"] = len(obj)
        for i, x in enumerate(obj):
            _state(x, f"{path}[{i}]", out, depth + 1)
    elif isinstance(obj, dict):
        out[path + ".__keys__"] = sorted(map(str, obj))
        for k, x in obj.items():
            _state(x, f"{path}[{k!r}]", out, depth + 1)
    elif obj is None or isinstance(obj, (bool, int, float, str, torch.dtype, torch.device)):
        out[path] = obj
    elif isinstance(obj, type):
        out[path] = obj.__qualname__
    elif hasattr(obj, "__dict__") and depth < 4 and not isinstance(obj, torch.nn.Module):
        out[path + ".__class__"] = type(obj).__qualname__
        for k, x in vars(obj).items():
            if not callable(x) or isinstance(x, torch.Tensor):
                _state(x, f"{path}.{k}", out, depth + 1)
    else:
        out[path] = f"<{type(obj).__name__} at {id(obj):#x}>"
    return out


def _differences(got: dict[str, Any], want: dict[str, Any], exact: bool) -> list[str]:
    out = []
    for k in sorted(set(got) | set(want)):
        if k not in want:
            out.append(f"{k} is set (eager has no such field)" if not exact else f"{k} appeared")
            continue
        if k not in got:
            out.append(f"{k} is missing" if not exact else f"{k} disappeared")
            continue
        a, b = got[k], want[k]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                out.append(f"{k}: {a.dtype} {list(a.shape)} on {a.device}, expected {b.dtype} {list(b.shape)} "
                           f"on {b.device}")
            elif exact and not torch.equal(a, b):
                out.append(f"{k}: values changed")
            elif not exact and a.numel():
                tol = tolerance_for(b.dtype)
                diff = (a.float() - b.float()).abs().max().item()
                lim = tol.limit(b.float().abs().max().item())
                if not diff <= lim:
                    out.append(f"{k}: max abs diff {diff:.3g} > {lim:.3g} from eager")
        elif type(a) is not type(b) or (a != b and not (isinstance(a, str) and a.startswith("<"))):
            out.append(f"{k}: {a!r}, expected {b!r}")
    return out


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """Cheap fingerprint of the model: every parameter/buffer's identity and version, config, mode."""
    out: dict[str, Any] = {}
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        out[name] = (t.data_ptr(), tuple(t.shape), str(t.dtype), _version(t), t.requires_grad)
    out["<training modules>"] = sorted(n for n, m in model.named_modules() if m.training)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        out["<config>"] = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return out


def _version(t: torch.Tensor) -> int | None:
    """The in-place modification counter (None for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _same_model(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for k in sorted(set(before) | set(after)):
        if before.get(k) != after.get(k):
            out.append("config changed" if k == "<config>" else
                       "train/eval mode changed" if k == "<training modules>" else
                       f"{k} was replaced or modified in place" if k in before and k in after else
                       f"{k} {'appeared' if k in after else 'disappeared'}")
    return out


def _default_inputs(model: torch.nn.Module) -> Callable[[int], dict[str, torch.Tensor]]:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device

    def make(n: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(device)}

    return make


def lint(model: torch.nn.Module, *, make_inputs: Callable[[int], Any] | None = None) -> LintReport:
    """Capture ``model`` with ``kvtrace.jit`` over prompts of different lengths and report what is wrong.

    Args:
        model: an HF causal LM (eval mode), as for ``kvtrace.jit``.
        make_inputs: ``make_inputs(n)`` -> the new-token inputs of one call with ``n`` tokens, a dict such as
            ``{"input_ids": LongTensor[B, n]}`` or ``{"inputs_embeds": ...}`` (or the ``input_ids`` tensor).
            Default: random token ids, batch 1. ``attention_mask`` and the cache are added by lint.

    Returns:
        a ``LintReport``; ``report.ok`` when there are no findings.
    """
    from transformers import DynamicCache

    from kvtrace.cache.hf import cache_kwarg_name, kv_geometry
    from kvtrace.runtime.jit import _P_EX, _T_EX

    make = make_inputs or _default_inputs(model)
    jm = _recording_jit(model)
    cache_kw = cache_kwarg_name(model)
    n_layers = kv_geometry(model.config)[0]
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    max_len = getattr(cfg, "max_position_embeddings", None)
    findings: list[Finding] = []
    calls: list[str] = []
    programs_by_kind: dict[Any, Any] = {}  # (cache kind, size classes) -> key of the first program captured for it

    steps = []
    for prompt, more in SCENARIO:
        steps.append((prompt, 0, f"prefill {prompt} tokens on a fresh DynamicCache"))
        steps.append((more, prompt, f"{'decode 1 token' if more == 1 else f'extend by {more} tokens'} at position {prompt}"))
    cache: Any = None
    for i, (n, past, desc) in enumerate(steps):
        where = f"call {i + 1} of the lint scenario ({desc})"
        calls.append(desc)
        if past == 0:
            cache = DynamicCache()
        new = make(n)
        new = {"input_ids": new} if isinstance(new, torch.Tensor) else dict(new)
        main = next(iter(new.values()))
        mask = torch.ones(main.shape[0], past + n, dtype=torch.int64, device=main.device)
        kwargs = {**new, "attention_mask": mask, cache_kw: cache, "use_cache": True}
        eager_cache = copy.deepcopy(cache)
        eager_inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items() if k != cache_kw}
        before_eager = _model_state(model)
        with torch.no_grad():
            eager = model(**eager_inputs, **{cache_kw: eager_cache})
        for d in _same_model(before_eager, _model_state(model)):
            findings.append(Finding("mutation", f"the model's own eager forward: {d} (kvtrace.jit recaptures "
                                    "whenever weights are replaced)", where))
        before_cache = _state(cache, "cache", {})
        before_inputs = _state({k: v for k, v in kwargs.items() if k != cache_kw}, "inputs", {})
        before_model = _model_state(model)
        captures = jm.stats.captures
        keys_before = list(jm._programs)
        try:
            with torch.no_grad():
                out = jm(**kwargs)
        except Exception as e:
            out = None
            findings.append(Finding("error", one_line(e), where))
        after_inputs = _state({k: v for k, v in kwargs.items() if k != cache_kw}, "inputs", {})
        want_inputs = _state(eager_inputs, "inputs", {}) if out is not None else before_inputs
        for d in _differences(after_inputs, want_inputs, exact=out is None):
            findings.append(Finding("mutation", f"the caller's {d}", where))
        for d in _same_model(before_model, _model_state(model)):
            findings.append(Finding("mutation", f"the model: {d}", where))
        if out is None:  # a failed call must leave the caller's cache as it was
            for d in _differences(_state(cache, "cache", {}), before_cache, exact=True):
                findings.append(Finding("mutation", f"after the failed call the caller's {d}", where))
            cache = eager_cache  # continue the scenario from eager's state
        else:
            if _out_cache(out) is not cache and _out_cache(eager) is eager_cache:
                findings.append(Finding("mutation", "the output's past_key_values is not the caller's cache object "
                                        "(eager returns the same object)", where))
            for d in _differences(_state(cache, "cache", {}), _state(eager_cache, "cache", {}), exact=False):
                findings.append(Finding("mutation", f"the caller's {d}", where))
            ok, diff, lim = _close(out.logits, eager.logits)
            if not ok:
                findings.append(Finding("mismatch", f"logits differ from eager by {diff:.3g} > {lim:.3g}", where))
        if jm.stats.captures > captures:
            for key in (k for k in jm._programs if k not in keys_before):
                first = programs_by_kind.setdefault((key.cache.value, key.sizes), key)
                if first is not key:
                    changed = {f.name: getattr(key, f.name) for f in dataclasses.fields(key)
                               if getattr(key, f.name) != getattr(first, f.name)}
                    why = (f"whose key differs from the first one's in {changed}" if changed else
                           "with the same key: kvtrace.jit dropped its programs because the model's parameters or "
                           "buffers were replaced since the first capture")
                    findings.append(Finding("recapture", f"a second {key.cache.value} program was captured {why}",
                                            where))
    if jm.stats.captures > EXPECTED_PROGRAMS:
        findings.append(Finding("recapture", f"{jm.stats.captures} programs captured over {len(steps)} calls; "
                                f"expected {EXPECTED_PROGRAMS} (one per cache kind and size class of T and P, "
                                "whatever the lengths)",
                                "kvtrace.jit stats"))
    for s in jm.stats.specializations:
        findings.append(Finding("specialization", f"kvtrace.jit pinned a length: {s}", "kvtrace.jit capture"))

    first_caps: dict[Any, _Capture] = {}  # per program key, jit's first (non-exact) capture
    for c in jm.lint_captures:
        if not c.exact and c.ep is not None:
            first_caps.setdefault(c.call.key, c)
    for cap in first_caps.values():
        findings.extend(_check_guards(cap, n_layers, max_len))
        prog = _program_name(cap.call)
        fresh = cap.call.key.cache.value == "dynamic-fresh"
        t_class, p_class = cap.call.key.sizes
        if t_class < 2 and (fresh or p_class < 2):
            continue  # every length of this program is fixed by its size class: nothing to vary
        t_a, t_b = (_T_EX, _T_B) if t_class == 2 else (t_class, t_class)
        p_a, p_b = (0, 0) if fresh else (_P_EX, _P_B) if p_class == 2 else (p_class, p_class)
        sizes_a = f"T={t_a}" + ("" if fresh else f", P={p_a}")
        sizes_b = f"T={t_b}" + ("" if fresh else f", P={p_b}")
        try:
            other = _recapture_with(jm, cap, t_b, p_b)
        except Exception as e:
            findings.append(Finding("specialization", f"{prog}: capturing it again with {sizes_b} failed "
                                    f"({one_line(e)})", "torch.export"))
            continue
        findings.extend(_diff_programs(prog, cap, other, sizes_a, sizes_b))
    return LintReport(model=type(model).__name__, calls=tuple(calls), captures=jm.stats.captures,
                      findings=tuple(_dedupe(findings)))


def _out_cache(out: Any) -> Any:
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else getattr(out, "cache", None)


def _close(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float, float]:
    if a.shape != b.shape:
        return False, math.inf, 0.0
    tol = tolerance_for(b.dtype)
    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    lim = tol.limit(b.float().abs().max().item() if b.numel() else 0.0)
    return diff <= lim, diff, lim


def _dedupe(findings: list[Finding]) -> list[Finding]:
    return list(dict.fromkeys(findings))


def run_cli_lint(args: Any, step: Any) -> LintReport:
    """What ``kvtrace lint SOURCE [--dtype D]`` runs: load the model, lint it (the CLI prints and exits 0/1)."""
    from kvtrace.artifact.export import DTYPES
    from kvtrace.sources.load import load_model

    with step(f"loading {args.source}"):
        lm = load_model(args.source, dtype=DTYPES[args.dtype])
    with step(f"capturing {len(SCENARIO) * 2} calls of different lengths with kvtrace.jit"):
        return lint(lm.model)
