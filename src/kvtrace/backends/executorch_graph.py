"""Rewrites of a captured decoder program that keep it whole inside XNNPACK's delegate (``delegable``).

XNNPACK takes a node only in the forms it supports, and its delegate cannot hold a node it refuses: every
refused node splits a layer's delegated graph, and each piece is one more delegate call (with the token
count symbolic, one more runtime reshape per call). Captured as it is, a SmolLM2 layer fell into ~4 pieces
around nodes XNNPACK refuses with a symbolic token count (its slice, hence its split, needs static shapes):
the fused q/k/v projection's split, RoPE's two rotate-half chunks and the fused gate/up chunk: 124
delegate calls and 120 portable split kernels per step. Each rewrite gives the same values in a form
XNNPACK takes:

- ``_delegable_norms``: an RMSNorm's ``mean(x [B, T, C], -1)`` as XNNPACK's 4-D mean;
- ``_delegable_views``: a view to a shape holding the symbolic token count, with that size as ``-1``;
- ``_split_projections``: ``split(linear(x, W), sizes, -1)`` as one linear per piece over ``W``'s rows (the
  rows sliced once, here, as the program's constants; ``W`` itself dropped when nothing else reads it); for an
  8da4w weight, ``W = dequantize_affine(q, scale, zero)``, its q, scale and zero rows sliced alike;
- ``_rotate_half_as_linear``: RoPE's ``cat(-x2, x1)`` of the halves of ``x [..., D]`` as ``linear(x, R)``
  with R [D, D] holding one ±1 per row (each output the one input it is, negated or not: exact);
- ``_cancel_transposes``: ``transpose(transpose(x, a, b), a, b)`` as ``x``.

They run on the captured (ATen-level) program, before ExecuTorch lowers it; each returns the program it
was given, changed in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["delegable"]


def delegable(ep: torch.export.ExportedProgram, rotate_half: bool = True) -> torch.export.ExportedProgram:
    """``ep`` with the rewrites of this module applied (in place).

    ``rotate_half`` False leaves RoPE as captured: with ring (sliding-window) layers, whose cache update stays
    outside the delegate, XNNPACK's partitioner proposed a partition with a dependency cycle around the
    rotation's linear and ExecuTorch refused it (tiny Mistral, window 4)."""
    rewrites = (_delegable_norms, _split_projections, *((_rotate_half_as_linear,) if rotate_half else ()),
                _cancel_transposes, _delegable_views)
    for rewrite in rewrites:
        ep = rewrite(ep)
    return ep


def _delegable_norms(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``mean(x [B, T, C], -1, keepdim)`` (an RMSNorm's) as ``mean(x [B, T, C, 1], [2, 3], keepdim)``: the same
    values, in the one form XNNPACK takes (a 4-D mean over the two innermost dims), so a norm no longer
    splits a layer's delegated graph in two."""
    import torch

    aten = torch.ops.aten
    graph, changed = ep.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.mean.dim or node.kwargs.get("dtype") is not None:
            continue
        x, dims = node.args[0], node.args[1]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if val is None or val.dim() != 3 or list(dims) not in ([-1], [2]) or not keep:
            continue
        with graph.inserting_before(node):
            up = graph.call_function(aten.unsqueeze.default, (x, -1))  # [B, T, C, 1]
            mean = graph.call_function(aten.mean.dim, (up, [2, 3], True))  # [B, T, 1, 1]
            shape = _inferred_shape(node.meta["val"].shape)  # [B, T, 1] with T (symbolic) as -1: XNNPACK's reshape
            down = graph.call_function(*((aten.view.default, (mean, shape)) if shape is not None
                                         else (aten.squeeze.dims, (mean, [-1]))))
        up.meta["val"], mean.meta["val"] = val.unsqueeze(-1), node.meta["val"].unsqueeze(-1)
        down.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(down)
        graph.erase_node(node)
        changed = True
    if changed:
        ep.graph_module.recompile()
    return ep


def _inferred_shape(shape: Iterable[Any]) -> list[int] | None:
    """``shape`` with its one symbolic size as -1 (None unless exactly one size is symbolic)."""
    out = [d if isinstance(d, int) else -1 for d in shape]
    return out if out.count(-1) == 1 else None


def _delegable_views(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``view``/``reshape`` to a shape holding the token count (symbolic) as ``-1`` instead: the same view, in the form
    XNNPACK's reshape takes (one inferred size, no symbolic ones), so head splits and merges stay delegated."""
    import torch

    aten = torch.ops.aten
    changed = False
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in (aten.view.default, aten.reshape.default):
            continue
        shape = list(node.args[1])
        symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
        if len(symbolic) != 1 or -1 in shape:
            continue
        shape[symbolic[0]] = -1
        node.args = (node.args[0], shape, *node.args[2:])
        changed = True
    if changed:
        ep.graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return ep


# --- splits of a projection's output -------------------------------------------------------------------------
def _last_dim_pieces(node: torch.fx.Node) -> list[int] | None:
    """The sizes a ``split_with_sizes`` / ``split`` / ``chunk`` of the last (static) dim cuts into, else None."""
    import torch

    aten = torch.ops.aten
    if node.op != "call_function" or node.target not in (aten.split_with_sizes.default, aten.split.Tensor,
                                                          aten.chunk.default):
        return None
    val = node.args[0].meta.get("val")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if val is None or dim not in (-1, val.dim() - 1) or not isinstance(val.shape[-1], int):
        return None
    n = val.shape[-1]
    if node.target is aten.split_with_sizes.default:
        sizes = list(node.args[1])
    elif node.target is aten.split.Tensor:
        step = node.args[1]
        sizes = [min(step, n - a) for a in range(0, n, step)]
    else:  # chunk: torch's rule, ceil(n / chunks) per piece
        step = -(-n // node.args[1])
        sizes = [min(step, n - a) for a in range(0, n, step)]
    return sizes if sum(sizes) == n and all(isinstance(s, int) and s > 0 for s in sizes) else None


def _constant(ep: torch.export.ExportedProgram, node: Any) -> torch.Tensor | None:
    """The tensor a parameter / constant placeholder holds (None for anything else)."""
    import torch

    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    sig = ep.graph_signature
    if node.name in sig.inputs_to_parameters:
        return ep.state_dict[sig.inputs_to_parameters[node.name]]
    if node.name in sig.inputs_to_lifted_tensor_constants:
        return ep.constants[sig.inputs_to_lifted_tensor_constants[node.name]]
    buffer = sig.inputs_to_buffers.get(node.name)
    if buffer is not None and buffer not in sig.buffers_to_mutate.values():
        return ep.state_dict.get(buffer, ep.constants.get(buffer))
    return None


def _first_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in graph.nodes if n.op == "placeholder")


def _add_constant(ep: torch.export.ExportedProgram, name: str, data: torch.Tensor) -> torch.fx.Node:
    """A new parameter ``name`` holding ``data``, as the program's weights are (ExecuTorch's helper keeps the graph
    signature in step; as a lifted tensor constant, ExecuTorch's partitioner could not re-create the delegated
    submodule that reads it)."""
    from executorch.backends.transforms.utils import create_constant_placeholder
    from torch.export.graph_signature import InputKind

    with ep.graph.inserting_before(_first_placeholder(ep.graph)):
        return create_constant_placeholder(ep, ep.graph, name, InputKind.PARAMETER, data)


def _dequantized(ep: torch.export.ExportedProgram, node: Any) -> list[tuple[torch.fx.Node, torch.Tensor]] | None:
    """[(q, its tensor), (scale, ...), (zero, ...)] when ``node`` is torchao's ``dequantize_affine`` of constants in
    blocks within a row (``block_size [1, g]``: ``models.quant.DynQuantLinear``'s weight), else None."""
    import torch

    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and str(node.target) == "torchao.dequantize_affine.default" and len(node.args) >= 4):
        return None
    block = node.args[1]
    out = [(c, _constant(ep, c)) for c in node.args[0:1] + node.args[2:4]]
    if list(block)[:1] != [1] or len(block) != 2 or any(t is None or t.dim() != 2 for _, t in out):
        return None
    return out  # type: ignore[return-value]


def _drop_if_unused(ep: torch.export.ExportedProgram, node: torch.fx.Node) -> None:
    from executorch.backends.transforms.utils import delete_constant_placeholder

    if not node.users:
        delete_constant_placeholder(ep, node)


def _split_projections(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``split(linear(x, W, b), sizes, -1)`` -> one ``linear(x, W[rows], b[rows])`` per piece (see the module)."""
    import torch

    aten = torch.ops.aten
    graph, changed = ep.graph, False
    for split in list(graph.nodes):
        sizes = _last_dim_pieces(split)
        lin = split.args[0] if sizes else None
        if lin is None or lin.op != "call_function" or lin.target is not aten.linear.default or len(lin.users) != 1:
            continue
        if not all(u.op == "call_function" and u.target.__name__ == "getitem" for u in split.users):
            continue
        x, w_node, b_node = lin.args[0], lin.args[1], lin.args[2] if len(lin.args) > 2 else None
        w = _constant(ep, w_node)
        dq = _dequantized(ep, w_node) if w is None else None  # 8da4w: W = dequantize(q, scale, zero) per row
        b = _constant(ep, b_node) if b_node is not None else None
        if (w is None and dq is None) or (w is not None and w.dim() != 2) or (b_node is not None and b is None):
            continue
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        pieces = []
        for a, n in zip(starts, sizes, strict=True):
            if dq is None:
                wi = _add_constant(ep, f"{w_node.name}_rows_{a}_{a + n}", w.detach()[a:a + n].contiguous())
            else:  # the quantized rows, their scales and zeros sliced alike; dequantized by a node of their own
                rows = [_add_constant(ep, f"{c.name}_rows_{a}_{a + n}", t.detach()[a:a + n].contiguous())
                        for c, t in dq]
                with graph.inserting_before(split):
                    wi = graph.call_function(w_node.target, (rows[0], w_node.args[1], rows[1], rows[2],
                                                             *w_node.args[4:]), dict(w_node.kwargs))
                wi.meta.update({k: v for k, v in w_node.meta.items() if k != "val"})
                wi.meta["val"] = w_node.meta["val"][a:a + n]
            bi = (_add_constant(ep, f"{b_node.name}_rows_{a}_{a + n}", b.detach()[a:a + n].contiguous())
                  if b is not None else None)
            with graph.inserting_before(split):
                piece = graph.call_function(aten.linear.default, (x, wi) if bi is None else (x, wi, bi))
            piece.meta.update({k: v for k, v in lin.meta.items() if k != "val"})
            piece.meta["val"] = lin.meta["val"][..., a:a + n]
            pieces.append(piece)
        for user in list(split.users):
            user.replace_all_uses_with(pieces[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(split)
        graph.erase_node(lin)
        if dq is None:
            _drop_if_unused(ep, w_node)
        elif not w_node.users:
            graph.erase_node(w_node)
            for c, _ in dq:
                _drop_if_unused(ep, c)
        if b_node is not None:
            _drop_if_unused(ep, b_node)
        changed = True
    if changed:
        ep.graph_module.recompile()
    return ep


# --- RoPE's rotate-half --------------------------------------------------------------------------------------
def _halves(a: Any, b: Any) -> torch.fx.Node | None:
    """x when ``a`` is ``neg(second half of x)`` and ``b`` the first half of it (halves of x's last dim)."""
    import torch

    aten = torch.ops.aten
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return None
    if a.op != "call_function" or a.target is not aten.neg.default:
        return None
    second, first = a.args[0], b
    for half, index in ((second, 1), (first, 0)):
        if not (isinstance(half, torch.fx.Node) and half.op == "call_function"
                and getattr(half.target, "__name__", "") == "getitem" and half.args[1] == index):
            return None
    cut = first.args[0]
    pieces = _last_dim_pieces(cut) if second.args[0] is cut else None
    return cut.args[0] if pieces is not None and len(pieces) == 2 and pieces[0] == pieces[1] else None


def _rotate_half_as_linear(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``cat([-x2, x1], -1)`` of the halves of ``x [..., D]`` -> ``linear(x, R)``, R [D, D]: R[j, j + D/2] = -1 and
    R[j + D/2, j] = 1 for j < D/2 (each output row one ±1: the same values, exactly)."""
    import torch

    aten = torch.ops.aten
    graph, changed, rotations = ep.graph, False, {}
    for cat in list(graph.nodes):
        if cat.op != "call_function" or cat.target is not aten.cat.default or len(cat.args[0]) != 2:
            continue
        val = cat.meta.get("val")
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if val is None or dim not in (-1, val.dim() - 1):
            continue
        x = _halves(*cat.args[0])
        if x is None or not isinstance(val.shape[-1], int):
            continue
        d, dtype = val.shape[-1], val.dtype
        if (d, dtype) not in rotations:
            r = torch.zeros(d, d, dtype=dtype)
            h = torch.arange(d // 2)
            r[h, h + d // 2] = -1
            r[h + d // 2, h] = 1
            rotations[d, dtype] = _add_constant(ep, f"kvtrace_rotate_half_{d}_{str(dtype).split('.')[-1]}", r)
        with graph.inserting_before(cat):
            rotated = graph.call_function(aten.linear.default, (x, rotations[d, dtype]))
        rotated.meta.update({k: v for k, v in cat.meta.items()})
        cat.replace_all_uses_with(rotated)
        graph.erase_node(cat)
        changed = True
    if changed:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return ep


def _cancel_transposes(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``transpose(transpose(x, a, b), a, b)`` -> ``x`` (the layout changes around the fused attention kernels)."""
    import torch

    aten = torch.ops.aten

    def dims(node: torch.fx.Node) -> set[int] | None:
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if val is None:
            return None
        return {d % val.dim() for d in node.args[1:3]}

    changed = False
    for node in list(ep.graph.nodes):
        if node.op != "call_function" or node.target is not aten.transpose.int:
            continue
        inner = node.args[0]
        if not (isinstance(inner, torch.fx.Node) and inner.op == "call_function" and inner.target is aten.transpose.int):
            continue
        if dims(node) is None or dims(node) != dims(inner):
            continue
        node.replace_all_uses_with(inner.args[0])
        ep.graph.erase_node(node)
        changed = True
    if changed:
        ep.graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return ep
