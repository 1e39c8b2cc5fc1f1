"""Devices: which device programs are compiled for and run on, named once and checked before any work.

An artifact's manifest records the device *type* its programs were compiled for (``"cpu"`` or
``"cuda"``; ``Manifest.device``): AOTInductor compiles native code for one device type, and an exported
graph records the device of every tensor it creates. Loading resolves that type to a device of this
machine (``"cuda"`` -> the current CUDA device, or an explicit ``"cuda:1"``) and refuses, in one line,
a device this machine does not have — before any library is opened.

``meta`` is accepted where no program runs (a Session over fake programs in tests): it allocates state
without memory.
"""

from __future__ import annotations

import torch

from kvtrace._errors import UsageError

__all__ = ["DEVICE_TYPES", "check_available", "concrete", "device_type", "resolve"]

DEVICE_TYPES = ("cpu", "cuda")  # what programs can be compiled for (Manifest.device)


def resolve(device: str | torch.device | None, default: str = "cpu", what: str = "device") -> torch.device:
    """``device`` as a torch.device (None: ``default``); UsageError naming the choices for anything else."""
    if device is None:
        device = default
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(f"{what} must be one of {list(DEVICE_TYPES)} (or 'cuda:N'), got {device!r}") from None
    if d.type not in (*DEVICE_TYPES, "meta"):
        raise UsageError(f"{what} must be one of {list(DEVICE_TYPES)} (or 'cuda:N'), got {device!r}")
    return d


def device_type(device: str | torch.device) -> str:
    """``"cuda"`` for ``"cuda:1"``; what a manifest records."""
    return torch.device(device).type


def check_available(device: torch.device, what: str) -> None:
    """UsageError, one line, when ``device`` is a CUDA device this machine does not have. ``what``
    says what needed it (``"export --device cuda"``, ``"artifact m.kvt (compiled for cuda)"``)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise UsageError(f"{what} needs a CUDA GPU, but this machine has none that torch can use ({build}); "
                         "run it on a machine with a GPU, or use device cpu (re-export for cpu)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise UsageError(f"{what} asks for {device}, but this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s) (cuda:0 .. cuda:{torch.cuda.device_count() - 1})")


def concrete(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current>`` (what tensors report), so devices compare equal; others unchanged."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
