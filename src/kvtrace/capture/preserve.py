"""Tracing never mutates the caller: record a module tree's state, trace, put every reference back.

torch.export (non-strict) runs the model's Python on the caller's own module objects. It swaps
parameters and buffers for fakes while it traces and keeps their mutations in the graph, but
everything else the forward does to ``self`` is real:

* an attribute assigned during the trace stays — HF longrope's ``rotary_emb.long_inv_freq =
  <FakeTensor>``; torch's own ``_detect_attribute_assignment`` puts back attributes that existed
  before but keeps new ones, so the FakeTensor of a dead fake mode breaks the next capture;
* cached Python values (dynamic RoPE's ``max_seq_len_cached``, ``attention_scaling``) and
  ``register_buffer`` calls (which replace ``_buffers`` entries) happen on the real module;
* a plain tensor attribute (not a parameter or buffer) is lifted as a constant, and an in-place
  op on it writes the real tensor's data.

``preserved(*roots)`` records, for every module in the roots' trees:

* ``module.__dict__``: every entry by identity, so changed ones are put back and added ones deleted;
* the contents of each dict, list and set in it (``_parameters``, ``_buffers``, ``_modules``, hooks,
  ``_non_persistent_buffers_set``, plain list/dict attributes), restored into the same container
  objects (one level: a container nested in one is restored by identity, not by contents);
* ``_version`` of every parameter, buffer and plain tensor attribute, and a copy of each plain tensor
  attribute's data (these are small: RoPE tables), written back if the trace changed it in place.

On exit, whether the trace succeeded or raised, it restores all of that, then refuses with a
``CaptureError`` if a traced value (FakeTensor, functional tensor, SymInt/SymFloat/SymBool) is still
reachable from the tree or a parameter or buffer was written in place (their data is not copied:
that would double the model's memory, and torch.export never writes them).

Why restore instead of tracing a shallow copy of the module tree (new module objects sharing the
parameter tensors)? A copy does not stop in-place writes to the tensors it shares (the plain
attribute case above), so it needs the same versions and copies; HF modules reach each other
outside ``_modules`` (bound methods patched onto ``forward``, hooks, closures, modules stored as
plain attributes), which a copy does not retarget, so a trace through them would still mutate the
originals, silently; and a copy must itself preserve aliasing (tied weights, shared submodules).
Restoring keeps the caller's module identities — what torch.export names state by and what
``kvtrace.jit``'s weights token reads — and completes torch.export's own snapshot/restore.
Cost: a walk over the modules and a shallow copy of each ``__dict__`` and its containers, about
0.1 ms per module (~45 ms for a 30-layer Phi-3's 367 modules, next to seconds of tracing); nothing
proportional to the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvtrace._errors import CaptureError

__all__ = ["ModelSnapshot", "preserved", "traced_leftovers"]

# How deep traced_leftovers looks into containers held by a module (restore goes one level deep).
_LOOK_DEPTH = 3


@dataclass(frozen=True)
class _ModuleState:
    """One module as it was: its ``__dict__`` entries, its containers' contents, its tensors' versions."""

    module: torch.nn.Module
    path: str
    attrs: dict[str, Any]  # __dict__ entries, by identity
    contents: dict[str, Any]  # name -> a shallow copy of the dict/list/set's contents
    versions: tuple[tuple[str, torch.Tensor, int | None], ...]  # parameters and buffers: (name, tensor, _version)
    copies: dict[str, tuple[torch.Tensor, int | None]]  # plain tensor attribute -> (a copy of its data, _version)


class ModelSnapshot:
    """The state of every module reachable from ``roots`` (see the module docstring for what is kept)."""

    def __init__(self, *roots: torch.nn.Module):
        self._states = [_record(mod, path) for path, mod in _tree(roots)]

    def restore(self) -> list[str]:
        """Put every module back as recorded; return what could not be restored (empty when all was)."""
        for s in self._states:
            _put_back(s)
        problems = []
        for s in self._states:
            for name, t, version in s.versions:
                if version is not None and _version(t) != version:
                    problems.append(f"{_where(s.path, name)} was written in place")
        return problems + _leftovers([(s.path, s.module) for s in self._states])


@contextlib.contextmanager
def preserved(*roots: torch.nn.Module, what: str = "the model") -> Iterator[None]:
    """Run the body (a capture) and leave ``roots`` exactly as they were, whether it succeeds or raises.

    Raises CaptureError before the body if a root already holds a traced value (an earlier capture's
    leftover would make this one fail obscurely), and after it if something could not be restored.
    """
    before = traced_leftovers(*roots)
    if before:
        raise CaptureError(
            f"{what} holds values left by an earlier trace ({_listed(before)}); expected real tensors. "
            "Reload the model (or delete those attributes) and capture again"
        )
    snapshot = ModelSnapshot(*roots)
    try:
        yield
    finally:
        problems = snapshot.restore()
        if problems:  # raised from finally: the capture's own exception, if any, is its __context__
            raise CaptureError(
                f"capture changed {what} in a way kvtrace cannot undo ({_listed(problems)}); expected it "
                "unchanged. Reload the model before using it again, and report this model class to kvtrace"
            )


def traced_leftovers(*roots: torch.nn.Module) -> list[str]:
    """Where a FakeTensor, functional tensor or symbolic number is reachable from the roots' modules."""
    return _leftovers(_tree(roots))


def _tree(roots: tuple[torch.nn.Module, ...]) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every module under the roots, each once (``named_modules`` without its
    nested generators, which cost O(modules x depth))."""
    out: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    stack = [("", r) for r in reversed(roots)]
    while stack:
        path, mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out.append((path, mod))
        stack += [(_where(path, n), c) for n, c in reversed(mod._modules.items()) if c is not None]
    return out


def _leftovers(modules: list[tuple[str, torch.nn.Module]]) -> list[str]:
    found: list[str] = []
    for path, mod in modules:
        for name, value in vars(mod).items():
            if name in ("_parameters", "_buffers"):
                found += [f"{_where(path, key)}{hit}" for key, t in value.items() for hit in _traced_in(t)]
            elif name != "_modules" and type(value) not in _PLAIN:  # submodules are walked themselves
                found += [f"{_where(path, name)}{hit}" for hit in _traced_in(value)]
    return found


def _record(mod: torch.nn.Module, path: str) -> _ModuleState:
    attrs = dict(vars(mod))
    contents: dict[str, Any] = {}
    for name, value in attrs.items():
        if isinstance(value, dict):
            contents[name] = dict(value)
        elif isinstance(value, list):
            contents[name] = list(value)
        elif isinstance(value, set):
            contents[name] = set(value)
    own = [*mod._parameters.items(), *mod._buffers.items()]
    versions = tuple((n, t, _version(t)) for n, t in own if t is not None)
    copies = {n: (t.detach().clone(), _version(t)) for n, t in attrs.items() if isinstance(t, torch.Tensor)}
    return _ModuleState(mod, path, attrs, contents, versions, copies)


def _put_back(s: _ModuleState) -> None:
    d = vars(s.module)
    for name in [n for n in d if n not in s.attrs]:  # added during the trace
        del d[name]
    d.update(s.attrs)  # the recorded objects, bypassing nn.Module.__setattr__ (no re-registration)
    for name, items in s.contents.items():
        container = s.attrs[name]
        if isinstance(container, list):
            container[:] = items
        else:
            container.clear()
            container.update(items)
    for name, (saved, version) in s.copies.items():
        t = s.attrs[name]
        if version is None or _version(t) != version:  # inference tensors have no version: always write
            with torch.inference_mode(t.is_inference()), torch.no_grad():
                t.copy_(saved)


_PLAIN = frozenset({int, float, str, bool, type(None)})


def _traced_in(value: Any, depth: int = 0) -> list[str]:
    """' is a FakeTensor' (and the like) for ``value`` itself, '[key] is a ...' for what it holds."""
    kind = type(value)
    if kind in _PLAIN:
        return []
    if isinstance(value, torch.Tensor):
        return [f" is a {kind.__name__}"] if _is_traced(value) else []
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return [f" is a {kind.__name__}"]
    if depth >= _LOOK_DEPTH or not isinstance(value, (dict, list, tuple, set)):
        return []  # (an object's own truth value or length is never asked: it may raise)
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [f"[{k!r}]{hit}" for k, v in list(items) for hit in _traced_in(v, depth + 1)]


def _is_traced(t: torch.Tensor) -> bool:
    if type(t) in (torch.Tensor, torch.nn.Parameter) and not torch._is_functional_tensor(t):
        return False  # the common case, without is_fake's subclass unwrapping
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor

    return is_fake(t) or isinstance(t, FunctionalTensor) or torch._is_functional_tensor(t)


def _version(t: torch.Tensor) -> int | None:
    """The in-place modification counter (None for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _where(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _listed(items: list[str], limit: int = 4) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more
