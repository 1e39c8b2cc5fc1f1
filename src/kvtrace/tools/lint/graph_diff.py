"""Program diff: the same program captured again with other example lengths must be the same graph.

``_recapture_with`` captures a program a second time (T=7, P=11 where jit used its own example lengths);
``_diff_programs`` compares the two graphs node for node and literal for literal, and their lifted
constants: a node only one of them has is a ``specialization`` (the model branches on a length), a literal
or constant that changes is a ``baked-constant``.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from kvtrace.tools.lint import jit_view
from kvtrace.tools.lint.guards import _Capture, _node_where, _shape_log
from kvtrace.tools.lint.report import Finding

_MAX_LITERAL_FINDINGS = 5  # per program; the rest are counted in the last message


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

    call = cap.call
    if call.key.cache.fresh:
        past = 0
    tensors = []
    for name, t in zip(call.key.inputs, call.tensors, strict=True):
        size = list(t.shape)
        size[jit_view.seq_dim(name) % t.dim()] = past + t_len if name == "attention_mask" else t_len
        tensors.append(torch.zeros(size, dtype=t.dtype, device=t.device))
    other = _Capture(jit_view.with_lengths(call, tensors, past), exact=True)
    with _shape_log(other), torch.no_grad():
        other.ep, other.baked = jit_view.export_again(jm, other.call)
    return other

