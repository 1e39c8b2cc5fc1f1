"""kvtrace.jit's checks of the model around a capture: Python state a forward keeps, and weight identity.

``_forward_keeps_no_state`` refuses a capture whose trace set attributes on the model (and puts them back);
``_weights_token`` says which tensors the model computes with, read on every call (see
``JittedModel._weights``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvtrace._errors import CaptureError

_MODULE_INTERNALS = ("_modules", "_parameters", "_buffers")  # see _python_state


def _python_state(model: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """(module path, attribute) -> value for the plain attributes of the model's modules and of its config:
    what a forward could leave behind for the next call. Not parameters and buffers: torch.export swaps them
    for traced tensors while it runs, and replacing one is seen by ``_weights_token`` on the next call."""
    state: dict[tuple[str, str], Any] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        where = path or type(model).__name__
        for k, v in vars(mod).items():
            if k not in _MODULE_INTERNALS:
                state[(where, k)] = v
    cfg = getattr(model, "config", None)
    for k, v in (vars(cfg).items() if cfg is not None else ()):
        state[("config", k)] = v
    return state


def _plain(x: Any, depth: int = 0) -> bool:
    """Python data compared by value (no tensors, no traced sizes): scalars, strings and containers of them."""
    if x is None or type(x) in (int, float, str, bool):
        return True
    if depth < 3 and type(x) in (tuple, list, set, frozenset):
        return all(_plain(y, depth + 1) for y in x)
    if depth < 3 and type(x) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in x.items())
    return False


def _same(a: Any, b: Any) -> bool:
    """The trace left the value as it was (the same object, or equal plain data: HF re-creates some dicts)."""
    return a is b or (type(a) is type(b) and _plain(a) and _plain(b) and a == b)


@contextlib.contextmanager
def _forward_keeps_no_state(model: torch.nn.Module) -> Any:
    """Refuse a capture whose trace set Python attributes on the model (e.g. ``self.seen = T``).

    A captured program cannot carry Python state from one call to the next: eager updates the attribute on
    every call, the program keeps what the trace saw. The state is read by a forward hook, as the model's
    forward leaves it (torch.export puts back attributes that existed, but not before the trace read them,
    and it leaves new ones holding traced sizes). Whatever still differs afterwards is put back as the caller
    had it, then ``CaptureError`` names what the forward set.
    """
    before = _python_state(model)
    left: list[dict[tuple[str, str], Any]] = []
    handle = model.register_forward_hook(lambda mod, args, out: left.append(_python_state(model)))
    try:
        yield
    finally:
        handle.remove()
        _put_back(model, before)
    # A tensor attribute the forward *adds* is a memo it recomputes from the config on every trace (HF longrope's
    # rotary_emb.long_inv_freq): each program holds its own copy, and the caller's model gets none (deleted
    # again). Anything else the forward sets, replaces or deletes is state carried from one call to the next.
    changed = [k for k in {**before, **left[0]} if k not in left[0]
               or (k not in before and not isinstance(left[0][k], torch.Tensor))
               or (k in before and not _same(before[k], left[0][k]))] if left else []
    if not changed:
        return
    path, attr = changed[0]
    value = left[0].get((path, attr))
    what = ("a traced size" if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))
            else "a traced tensor" if isinstance(value, torch.Tensor) else "deleted" if (path, attr) not in left[0]
            else repr(value)[:40])
    raise CaptureError(
        f"kvtrace.jit cannot capture {type(model).__name__}: its forward sets {len(changed)} attribute(s) of the "
        f"model (first: {path}.{attr} = {what}), Python state a captured program cannot carry from one call to "
        "the next; keep per-call values local (or in the cache), or run the model without kvtrace.jit "
        "(the attributes were restored)"
    )


def _put_back(model: torch.nn.Module, before: dict[tuple[str, str], Any]) -> None:
    """Undo what a trace left set, replaced or deleted among ``_python_state``'s attributes."""
    now = _python_state(model)
    modules = dict(model.named_modules(remove_duplicate=False))
    for path, attr in (k for k in {**before, **now} if k not in before or k not in now or not _same(before[k], now[k])):
        obj = model.config if path == "config" else modules.get("" if path == type(model).__name__ else path)
        if obj is None:
            continue
        if (path, attr) in before:
            setattr(obj, attr, before[(path, attr)])  # Module.__setattr__ puts parameters and buffers back too
        else:
            delattr(obj, attr)


def _weights_token(modules: list[torch.nn.Module]) -> tuple[str, tuple[int, ...]]:
    """Sorted parameter dtypes, and the children's ids and every parameter's and buffer's storage address.

    A flat walk over an already-listed module tree (~0.1 ms for 16 decoder layers, a third of
    ``model.parameters()``): it runs on every call.
    """
    token: list[int] = []
    dtypes: set[torch.dtype] = set()
    for mod in modules:
        token += map(id, mod._modules.values())
        for p in mod._parameters.values():
            if p is not None:
                dtypes.add(p.dtype)
                token.append(p.data_ptr())
        token += [b.data_ptr() for b in mod._buffers.values() if b is not None]
    return ",".join(sorted(map(str, dtypes))), tuple(token)
