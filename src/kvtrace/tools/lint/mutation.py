"""Mutation: the caller's cache, inputs and model, snapshot and compared with what eager leaves.

``_state`` flattens a cache or a dict of inputs to path -> tensor copy / plain value; ``_differences``
compares two such snapshots (exactly, or within the dtype's tolerance of ``kvtrace.spec.tolerances``);
``_model_state`` / ``_same_model`` fingerprint the model (parameter identity and version, config, mode).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import torch

from kvtrace.spec.tolerances import close, tolerance_for


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
                ok, diff, lim = close(a, b, tolerance_for(b.dtype))
                if not ok:
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


def _out_cache(out: Any) -> Any:
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else getattr(out, "cache", None)

