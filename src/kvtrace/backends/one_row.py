"""One-row linears as Inductor reductions, for the CPUs where ATen's GEMV is slow.

Batch-1 decode multiplies one row of activations by every weight matrix: ``y[n] = sum_k x[k] * W[n, k]``, a
GEMV that reads each weight once. ATen sends ``linear`` to MKL, whose fp32 and bf16 GEMV on AMD CPUs streams
a fraction of the machine's bandwidth; written as a multiply and a sum over K, Inductor generates one
vectorized reduction per matrix instead (outputs split over the threads, K contiguous in each row of W). Per
matrix, 2 threads, weights rotated past the L3, torch.compile, on a 2-vCPU AMD EPYC (Zen 4, stop 45):

=================  ======================  ======================
[N, K]             fp32 MKL -> reduction    bf16 MKL -> reduction
=================  ======================  ======================
[1536, 576]        379 -> 145 us            143 -> 91 us
[576, 1536]        268 -> 160 us            128 -> 74 us
[49152, 576] head  12.5 -> 3.5 ms           3.7 -> 2.0 ms
=================  ======================  ======================

``rewrite`` makes the change in a program's graph, for each ``aten.linear`` whose input has exactly one row
as a static size (a decode program's [1, 1, K]; prefill's symbolic T keeps ATen's GEMM, where a reduction
would read W once per row), and likewise for torch's weight-only int8 matmul (``aten._weight_int8pack_mm``:
``models.quant.Int8Linear`` and the int8 head of int4 weights), whose bf16 kernel streams 12-13 GB/s on the head
here against 25-26 for the reduction over the int8 weight. Each reduction's input row is computed into a buffer
first (``_materialized``): Inductor otherwise inlined its producer (the layer's RMSNorm, for the first layer
the embedding lookup too) into the reduction, recomputing it for every output. SmolLM2 decode, ``aoti``,
alternated in one process (stop 47): fp32 51.8 -> 55.0 tokens/s; int8 weights 65 -> 88 with the int8 rewrite,
139 with the row materialized; int4 weights (the int8 head rewritten) 124.7 -> 155.

``wanted`` says where: backend ``aoti`` (weights not frozen; ``aoti-packed``'s GEMM templates are fast there
already), on the CPU, float32 / bfloat16, AMD. On Intel CPUs MKL's GEMV runs
near the bandwidth bound (``aoti`` fp32 decode at ~0.97 of it, stop 26) and is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["dominant_dtype", "reducible", "rewrite", "wanted", "weight_share"]


def wanted(dtype: torch.dtype | None, device_type: str, vendor: str) -> bool:
    """Whether a one-token program over unfrozen ``dtype`` weights on ``device_type`` computes its one-row
    linears as reductions (``rewrite``) on a CPU of ``vendor`` (/proc/cpuinfo's vendor_id)."""
    import torch

    return device_type == "cpu" and dtype in (torch.float32, torch.bfloat16) and vendor == "AuthenticAMD"


def reducible(module: torch.nn.Module) -> bool:
    """Whether ``rewrite`` computes ``module``'s one-row call as a reduction: a plain ``nn.Linear``, or a module
    declaring ``one_row_reduction`` (``models.quant.Int8Linear``: ``aten._weight_int8pack_mm``)."""
    import torch

    return type(module) is torch.nn.Linear or getattr(module, "one_row_reduction", False)


def dominant_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype | None:
    """The floating dtype holding most bytes of ``tensors`` (a program's weights); None if none is floating."""
    size: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.is_floating_point():
            size[t.dtype] = size.get(t.dtype, 0) + t.numel() * t.element_size()
    return max(size, key=size.__getitem__) if size else None


def weight_share(module: torch.nn.Module, counts: Callable[[torch.nn.Module], bool]) -> float:
    """The share of ``module``'s weight bytes (parameters and buffers, a tied table once) held directly by the
    submodules for which ``counts`` is true: e.g. plain ``nn.Linear``, what ``rewrite`` can speed up."""
    seen: set[int] = set()
    part = total = 0
    for m in module.modules():
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
            if t is None or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            n = t.numel() * t.element_size()
            total += n
            part += n if counts(m) else 0
    return part / total if total else 0.0


def rewrite(gm: torch.fx.GraphModule) -> int:
    """Every ``aten.linear(x, W, b)`` of ``gm`` whose ``x`` [..., K] holds one row (every leading size a static
    1) replaced, in place, by ``sum(x[..., None, :] * W, -1) (+ b)`` [..., N]: the same sum of products, added
    in Inductor's order (float32 accumulation; within the fp32 rule of verify). Every one-row
    ``aten._weight_int8pack_mm(x, q, scale)`` (bf16 x [1, K], int8 q [N, K], bf16 scale [N]) likewise, by
    ``sum(float(x) * float(q), -1) * float(scale)`` rounded to the op's output dtype: float32 accumulation as the
    kernel's. Returns how many it replaced.

    ``gm``: an exported program's module (``ExportedProgram.module()``), its nodes carrying the export's
    ``meta["val"]``; the compile that follows traces it again."""
    import torch

    aten = torch.ops.aten
    graph, n_done = gm.graph, 0
    for node in list(graph.find_nodes(op="call_function", target=aten.linear.default)):
        x, w, *rest = node.args
        bias = rest[0] if rest else node.kwargs.get("bias")
        if not _one_row(x):
            continue
        val = x.meta["val"]
        with graph.inserting_before(node):
            x = _materialized(graph, x, list(val.shape), list(val.stride()), val.storage_offset())
            row = graph.call_function(aten.unsqueeze.default, (x, -2))  # [..., 1, K]
            prod = graph.call_function(aten.mul.Tensor, (row, w))  # [..., N, K]: never materialized
            out = graph.call_function(aten.sum.dim_IntList, (prod, [-1]))  # [..., N]
            if bias is not None:
                out = graph.call_function(aten.add.Tensor, (out, bias))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        n_done += 1
    for node in list(graph.find_nodes(op="call_function", target=aten._weight_int8pack_mm.default)):
        x, q, scale = node.args  # x [1, K] bf16, q [N, K] int8, scale [N] bf16 -> [1, N] bf16
        if not _one_row(x):
            continue
        f32 = torch.float32
        with graph.inserting_before(node):
            shape = list(x.meta["val"].shape)
            xf = graph.call_function(aten._to_copy.default, (x,), {"dtype": f32})  # contiguous
            xf = _materialized(graph, xf, shape, [math.prod(shape[i + 1:]) for i in range(len(shape))], 0)
            row = graph.call_function(aten.unsqueeze.default, (xf, -2))  # [1, 1, K]
            wq = graph.call_function(aten._to_copy.default, (q,), {"dtype": f32})  # [N, K]: never materialized
            dot = graph.call_function(aten.sum.dim_IntList, (graph.call_function(aten.mul.Tensor, (row, wq)), [-1]))
            y = graph.call_function(aten.mul.Tensor, (  # [1, N]: (x . q) * scale per output, float32
                dot, graph.call_function(aten._to_copy.default, (scale,), {"dtype": f32})))
            out = graph.call_function(aten._to_copy.default, (y,), {"dtype": node.meta["val"].dtype})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        n_done += 1
    if n_done:
        graph.lint()
        gm.recompile()
    return n_done


def _one_row(x: object) -> bool:
    """Whether ``x`` (a graph node) holds one row: [..., K] with every leading size a static 1."""
    import torch

    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if val is None or len(val.shape) < 2 or not all(isinstance(s, int) for s in val.shape[:-1]):
        return False
    return math.prod(val.shape[:-1]) == 1


def _materialized(graph: torch.fx.Graph, x: torch.fx.Node, shape: list[Any], stride: list[Any], offset: Any
                  ) -> torch.fx.Node:
    """``x`` itself (``as_strided`` to its own size, stride and offset: the same view), which Inductor computes into a
    buffer of its own, as ``as_strided`` needs one. Otherwise Inductor inlines the producer of a reduction's input (an
    RMSNorm, the embedding lookup) into the reduction and recomputes it for every output it sums."""
    import torch

    if not all(isinstance(v, int) for v in (*shape, *stride, offset)):  # a symbolic layout: left as it is
        return x
    return graph.call_function(torch.ops.aten.as_strided.default, (x, shape, stride, offset))
