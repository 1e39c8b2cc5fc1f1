"""The backend registry: every backend by name. Export, loading, the artifact cache, the CLI, verify and
bench ask it instead of comparing names.

Adding a backend: one module defining a ``Backend`` (``base``), and one line in ``_BUILTIN`` below (or
``register(backend)`` at run time, e.g. from a plugin or a test).
"""

from __future__ import annotations

from kvtrace._errors import UsageError
from kvtrace.backends.aoti import AOTI
from kvtrace.backends.aoti_packed import AOTI_PACKED
from kvtrace.backends.base import Backend
from kvtrace.backends.executorch import EXECUTORCH
from kvtrace.backends.exported import EXPORTED

__all__ = ["Backend", "get", "names", "register", "unregister"]

_BUILTIN = (EXPORTED, AOTI, AOTI_PACKED, EXECUTORCH)  # in this order in help texts and error messages
_REGISTRY: dict[str, Backend] = {b.name: b for b in _BUILTIN}


def names() -> tuple[str, ...]:
    """Every registered backend's name, built-in ones first."""
    return tuple(_REGISTRY)


def get(name: str) -> Backend:
    """The backend called ``name``; UsageError listing the names for any other."""
    backend = _REGISTRY.get(name) if isinstance(name, str) else None
    if backend is None:
        raise UsageError(f"backend must be one of {names()}, got {name!r}")
    return backend


def register(backend: Backend) -> Backend:
    """Make ``backend`` available by its name (export, load, the CLI's choices); returns it."""
    if not isinstance(backend, Backend):
        raise UsageError(f"register takes a kvtrace.backends.base.Backend, got {type(backend).__name__}")
    if not backend.name or backend.name in _REGISTRY:
        raise UsageError(f"backend name {backend.name!r} is empty or taken (registered: {names()}); pick another")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Undo ``register``; built-in backends stay."""
    if name in {b.name for b in _BUILTIN}:
        raise UsageError(f"backend {name!r} is built in and cannot be unregistered")
    _REGISTRY.pop(name, None)
