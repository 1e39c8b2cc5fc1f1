"""``backends/packing.pretransposed``: linear layers rewritten over pre-transposed weights, so Inductor's CPU
GEMM templates can pack each weight and drop its original (one copy per weight in a packed library)."""

from __future__ import annotations

import torch

from kvtrace.backends.packing import pretransposed


class _Tied(torch.nn.Module):
    """An embedding whose table is also the output head (SmolLM2's tied 49152 x 576), one plain linear with a
    bias and one without."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.up = torch.nn.Linear(8, 6)
        self.down = torch.nn.Linear(6, 8, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)  # [B, T, 8]
        h = self.down(torch.relu(self.up(h)))
        return torch.nn.functional.linear(h, self.emb.weight)  # [B, T, 11]


def _linears(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.linear.default]


def test_linears_over_own_weights_become_matmuls_over_one_transposed_copy():
    torch.manual_seed(0)
    model = _Tied().eval()
    ids = torch.tensor([[1, 4, 9, 2]])
    gm = torch.export.export(model, (ids,)).module()
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    assert len(_linears(gm)) == 3

    assert pretransposed(gm) == 2  # up and down; the head reads the embedding's table and stays a linear
    [head] = _linears(gm)
    assert head.args[1].target.endswith("emb.weight")
    torch.testing.assert_close(gm(ids), model(ids), rtol=0, atol=1e-6)

    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert not any(a.endswith(("up.weight", "down.weight")) for a in attrs), attrs  # the originals are no constants
    transposed = {a: getattr(gm, a) for a in attrs if a.endswith("_t")}
    assert sorted(t.shape for t in transposed.values()) == [torch.Size([6, 8]), torch.Size([8, 6])]  # [in, out]
    assert all(t.is_contiguous() and not t.requires_grad for t in transposed.values())
    for k, v in before.items():  # the caller's weights are untouched
        torch.testing.assert_close(gm.state_dict()[k], v, rtol=0, atol=0)


def test_a_weight_shared_by_two_linears_gets_one_copy():
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(5, 5, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin(x))

    model = Twice().eval()
    x = torch.randn(2, 5)
    gm = torch.export.export(model, (x,)).module()
    assert pretransposed(gm) == 2
    copies = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(set(copies)) == 1 and copies[0].endswith("_t")
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=1e-6)


def test_nothing_to_rewrite_leaves_the_graph_as_it_was():
    model = torch.nn.Sequential(torch.nn.ReLU()).eval()
    gm = torch.export.export(model, (torch.randn(3),)).module()
    code = gm.code
    assert pretransposed(gm) == 0 and gm.code == code
