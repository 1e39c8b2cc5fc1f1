"""Rewrites that keep a captured decoder program whole inside XNNPACK (``backends/executorch_graph.py``).

Each is checked on a small exported module with a symbolic token count, as the decoder's programs are
captured: the pattern is gone, the program still runs (its graph signature kept in step) and gives the same
values. The lowering itself is covered by the export tests in test_executorch.py.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.export import Dim

from kvtrace.backends import executorch_graph as g

# Skipped only where the optional executorch extra is absent (its graph helpers keep the signature in step):
# `make test` installs the dev extra, which includes it, so CI runs every test here.
pytest.importorskip("executorch", reason="the executorch extra (pip install 'kvtrace[executorch]')")

aten = torch.ops.aten


def _export(module: torch.nn.Module, *args: torch.Tensor) -> torch.export.ExportedProgram:
    shapes = tuple({1: Dim("T", min=1, max=64)} for _ in args)
    return torch.export.export(module.eval(), args, dynamic_shapes=shapes, strict=False)


def _ops(ep: torch.export.ExportedProgram) -> collections.Counter[str]:
    return collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


class _Qkv(torch.nn.Module):
    """A fused projection split three ways (Qwen2's has a bias); ``tied`` reads its weight once more."""

    def __init__(self, bias: bool = False, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wqkv = torch.nn.Linear(16, 8 + 4 + 4, bias=bias)
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).split([8, 4, 4], dim=-1)
        out = q.sum(-1) + 2 * k.sum(-1) + 3 * v.sum(-1)
        return out + self.wqkv.weight.sum() if self.tied else out


@pytest.mark.parametrize("bias", [False, True])
def test_a_split_projection_becomes_one_linear_per_piece_over_its_rows(bias):
    model, x = _Qkv(bias), torch.randn(1, 5, 16)
    ep = g._split_projections(_export(model, x))
    ops = _ops(ep)
    assert ops["aten.split_with_sizes.default"] == 0 and ops["aten.linear.default"] == 3
    assert "wqkv.weight" not in ep.state_dict  # nothing else reads the fused weight: dropped, not stored twice
    rows = sorted(tuple(t.shape) for n, t in ep.state_dict.items() if "rows" in n)
    assert rows == sorted([(8, 16), (4, 16), (4, 16)] + ([(8,), (4,), (4,)] if bias else []))
    for t in (5, 1):  # the symbolic token count still symbolic
        y = torch.randn(1, t, 16)
        torch.testing.assert_close(ep.module()(y), model(y), rtol=1e-6, atol=1e-6)


def test_a_weight_read_elsewhere_is_kept():
    model, x = _Qkv(tied=True), torch.randn(1, 5, 16)
    ep = g._split_projections(_export(model, x))
    assert _ops(ep)["aten.split_with_sizes.default"] == 0 and "wqkv.weight" in ep.state_dict
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-6, atol=1e-6)


class _GateUp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w13 = torch.nn.Linear(16, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def test_a_chunked_projection_is_split_too():
    model, x = _GateUp(), torch.randn(1, 3, 16)
    ep = g._split_projections(_export(model, x))
    assert _ops(ep)["aten.chunk.default"] == 0 and _ops(ep)["aten.linear.default"] == 2
    torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-6, atol=1e-6)


class _Rope(torch.nn.Module):
    """HF's rotate-half RoPE on x [B, H, T, D], and a cat of two halves that is not one (kept)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = x * cos + torch.cat((-x2, x1), dim=-1) * (1 - cos)
        not_a_rotation = torch.cat((x1, -x2), dim=-1)
        return rotated + not_a_rotation


def test_rotate_half_becomes_an_exact_linear():
    x, cos = torch.randn(1, 2, 5, 8), torch.rand(1, 2, 5, 8)
    ep = g._rotate_half_as_linear(torch.export.export(
        _Rope(), (x, cos), dynamic_shapes=({2: Dim("T", min=1, max=64)}, {2: Dim("T", min=1, max=64)})))
    ops = _ops(ep)
    assert ops["aten.linear.default"] == 1 and ops["aten.cat.default"] == 1  # the other cat is left alone
    (rotation,) = [t for n, t in ep.state_dict.items() if "rotate_half" in n]
    assert rotation.shape == (8, 8) and sorted(rotation.abs().sum(1).tolist()) == [1.0] * 8
    for t in (5, 1):
        y, c = torch.randn(1, 2, t, 8), torch.rand(1, 2, t, 8)
        assert torch.equal(ep.module()(y, c), _Rope()(y, c))  # one ±1 per output: the same values exactly


class _Transposes(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D]
        return (y * 2).transpose(1, 2) + y.transpose(2, 1) + y.transpose(-3, -2)  # the last two undo it


def test_a_transpose_undone_by_the_next_is_dropped():
    model, x = _Transposes(), torch.randn(1, 5, 2, 4)
    ep = g._cancel_transposes(_export(model, x))
    assert _ops(ep)["aten.transpose.int"] == 2  # the first, and the one after the multiply
    assert torch.equal(ep.module()(x), model(x))


def test_delegable_leaves_a_decoder_layer_without_the_nodes_xnnpack_refuses():
    """A tiny Llama captured as the executorch backend captures it: no split, chunk, cat or neg left."""
    import dataclasses

    import kvtrace.backends.executorch as ex
    from conftest import tiny_model
    from kvtrace.models.registry import make_decoder
    from kvtrace.spec.program import program_specs

    dec = make_decoder(tiny_model("llama"), max_seq_len=16, batch_size=1)
    (prefill,) = [p for p in ex.EXECUTORCH.program_specs(program_specs(dec), dec) if p.name == "prefill"]
    ep = ex.EXECUTORCH.capture(dec, (dataclasses.replace(prefill, logits="last"),))["prefill"]
    before = _ops(ep)
    assert before["aten.split_with_sizes.default"] and before["aten.chunk.default"] and before["aten.cat.default"]
    tokens, pos = torch.tensor([[3, 4, 5]]), torch.arange(3)
    want = ep.module()(tokens, pos)
    after = _ops(g.delegable(ep))
    assert not any(after[op] for op in ("aten.split_with_sizes.default", "aten.chunk.default", "aten.cat.default",
                                        "aten.neg.default"))
    torch.testing.assert_close(ep.module()(tokens, pos), want, rtol=1e-5, atol=1e-5)
