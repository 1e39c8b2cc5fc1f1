"""One copy of each frozen weight in a packed library: linear weights handed to Inductor pre-transposed.

With ``freezing`` (``aot_inductor.package_constants_in_so``: the weights live in the compiled library),
Inductor's CPU GEMM template packs each matmul's weight into a new constant and then prunes the original
(``cpp_gemm_template.prune_tensors``) — but only when the template's weight input is the constant itself.
``aten.linear(x, w)`` decomposes to ``mm(x, permute(w))``: the template sees a view of ``w`` and keeps it, so
a library compiled from a decoder's linear layers held every weight twice (measured, stop 32: SmolLM2's
aoti-packed library 1076 MB of constants for 538 MB of weights — the originals unused, declared
``[[maybe_unused]]`` in the generated wrapper; Inductor counted 0 prunes).

``pretransposed(gm)`` rewrites ``linear(x, w[, b])`` over a module weight as ``matmul(x, w_t)`` (``+ b``) with
``w_t = w.t().contiguous()`` registered once per weight: the same product, its weight a plain constant the
template packs and prunes. A weight read elsewhere too (a tied embedding) is left as it is: the library needs
its original for that read, so a transposed copy would be one more.

Only for the GEMM templates' packing (``aoti._module`` decides): Inductor's MKL weight packing (fp32 on Intel)
already kept one copy (SmolLM2 538.6 MB of constants), and there the rewrite only added the tied head's copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["pretransposed"]


def pretransposed(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm``'s linear layers over its own 2-D weights in place (see the module docstring); returns how
    many linear calls were rewritten."""
    import torch

    linear = torch.ops.aten.linear.default
    made: dict[str, str] = {}  # weight's attribute path -> its transposed copy's attribute
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not linear or node.args[1].op != "get_attr":
            continue
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        weight = _attr(gm, w.target)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not _only_linear_reads(gm, w.target):
            continue
        if w.target not in made:
            name = _free_name(gm, w.target.replace(".", "_") + "_t")
            gm.register_parameter(name, torch.nn.Parameter(weight.detach().t().contiguous(), requires_grad=False))
            made[w.target] = name  # [in, out]
        with gm.graph.inserting_before(node):
            y = gm.graph.call_function(torch.ops.aten.matmul.default, (x, gm.graph.get_attr(made[w.target])))
            if bias is not None:
                y = gm.graph.call_function(torch.ops.aten.add.Tensor, (y, bias))
        y.meta.update(node.meta)
        node.replace_all_uses_with(y)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        for node in list(gm.graph.nodes):  # a weight no longer read: its get_attr goes, so it is no constant
            if node.op == "get_attr" and not node.users:
                gm.graph.erase_node(node)
        gm.recompile()
    return rewritten


def _only_linear_reads(gm: torch.fx.GraphModule, target: str) -> bool:
    """Whether every read of the weight at ``target`` is a linear's weight: a weight read elsewhere too (a tied
    embedding's table) must stay in the library for that read, and a transposed copy would be a second one."""
    import torch

    linear = torch.ops.aten.linear.default
    reads = [u for n in gm.graph.nodes if n.op == "get_attr" and n.target == target for u in n.users]
    return all(u.op == "call_function" and u.target is linear and u.args[1].target == target for u in reads)


def _attr(gm: torch.nn.Module, path: str) -> object:
    obj: object = gm
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _free_name(gm: torch.nn.Module, name: str) -> str:
    base, i = name, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}{i}"
    return name
