"""The noise floor of a lossy-quantized reference: how far the reference is from *itself* when its float
arithmetic is changed at the ulp level, in ways that compute exactly the same formula.

An int8 KV cache and 8da4w activations round every value to a step (``round(x / scale)``); a compiled program
whose matmuls sum in another order feeds those roundings inputs a few ulps off, and where one lands near a tie
it flips, moving the value by a whole step; over a deep model the flips compound (``spec/tolerances.py``). The
reference has the same sensitivity, and verify measures it in the same run: the reference re-run under each of
``PERTURBATIONS``, teacher-forced with the same tokens, gives per compared tensor the difference that exact-
equivalent arithmetic alone produces. The perturbations act on every ``F.linear`` the reference calls (the
decoders' projections, MLPs and head, and the quantized references' ``DequantLinear``):

    float64-linear  x @ W.T (+ b) summed in float64, rounded once to the input's dtype (the correctly rounded
                    product: no less exact than the reference's own float32 sum)
    split-k-linear  the same product as two float32 parts of the reduction added, a third and the rest
                    (another summation order)

Only arithmetic order changes: weights, activations' own roundings (bf16, int8), cache writes and everything
else run as in the reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kvtrace.tools.runners import LayerKV, Runner

__all__ = ["PERTURBATIONS", "Float64Linear", "PerturbedRunner", "SplitKLinear"]


class _LinearMode(TorchFunctionMode):
    """Every ``F.linear`` computed by ``linear(x, w, b)`` instead; everything else as it comes."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        return self.linear(x, w, args[2] if len(args) > 2 else kwargs.get("bias"))

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class Float64Linear(_LinearMode):
    """Every ``F.linear`` summed in float64 and rounded once to its input's dtype."""

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)


class SplitKLinear(_LinearMode):
    """Every ``F.linear`` as the sum of two parts of its reduction, its first third and the rest (in the input's
    dtype). Not halves: MKL on an Intel machine blocks K = 576 in two halves itself, so halves added gave its
    product bit for bit and measured nothing (stop 33)."""

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        h = w.shape[1] // 3
        if h == 0:
            return F.linear(x, w, b)
        y = F.linear(x[..., :h], w[:, :h]) + F.linear(x[..., h:], w[:, h:])  # [..., N]
        return y if b is None else y + b


PERTURBATIONS: dict[str, type[TorchFunctionMode]] = {"float64-linear": Float64Linear, "split-k-linear": SplitKLinear}


class PerturbedRunner:
    """``runner`` with every prefill and decode computed under one of ``PERTURBATIONS``; its ``session`` (a
    Session runner's: what verify reads a candidate's cache and quantization from) is the runner's. Set
    ``prefill_logits="last"`` to return (and be compared on) the prefill's last position only (default: the
    runner's own)."""

    def __init__(self, runner: Runner, perturbation: str, prefill_logits: str | None = None):
        self.runner, self.perturbation = runner, perturbation
        self._mode = PERTURBATIONS[perturbation]
        self.name = f"{runner.name}+{perturbation}"
        self.session = getattr(runner, "session", None)
        self.prefill_logits = prefill_logits or getattr(runner, "prefill_logits", "all")

    def reset(self) -> None:
        self.runner.reset()

    def initial_state_error(self) -> str:
        check = getattr(self.runner, "initial_state_error", None)
        return check() if check is not None else ""

    def prefill(self, tokens: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        with self._mode():
            logits = self.runner.prefill(tokens, **inputs)  # [B, T, V] (or [B, 1, V])
        return logits[:, -1:] if self.prefill_logits == "last" else logits  # "last": as a last-only program's

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        with self._mode():
            return self.runner.decode(token)

    def cache(self) -> list[LayerKV]:
        return self.runner.cache()
