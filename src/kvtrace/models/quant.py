"""Quantized weights for kvtrace's own decoders: linear layers and the embedding / output head stored
quantized and computed by kernels torch already ships (see ``spec/quant.py`` for the schemes).

``quantize_decoder(decoder, spec)`` replaces, in place, every ``nn.Linear`` of a decoder that owns its
weights (and, with ``spec.head``, its ``nn.Embedding`` and the head tied to it) by one of:

- ``Int8Linear``: weight int8 ``[N, K]``, scale ``[N]`` bf16 -> ``aten._weight_int8pack_mm`` (bf16 activations);
- ``Int4Linear``: weight in the CPU int4pack layout ``[N, K/2]`` uint8 and ``scale_zeros [K/g, N, 2]`` bf16 ->
  ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations), ``w = (q - 8) * scale + zero``; 8da4w quantizes
  each activation row to int8 first;
- ``GGUFLinear``: a GGUF's Q4_0 / Q4_1 / Q8_0 blocks, the file's values rearranged but not re-quantized
  (4-bit values two per byte, 32 output rows side by side: ``q [N/32, K/32, 16, 32]``, float16 ``d`` and ``m``
  ``[N/32, K/32, 32]``), computed in float32. A one-row call (decode) is a fused multiply-reduce (d * (x . q) per
  block) that Inductor generates from ``GGUFLinear._decode``, reading the tiles once; more rows (prefill) dequantize the
  weight (``d * q + m`` in float32, bit for bit what gguf's dequantize gives) and multiply it with ATen;
- ``Int8Embedding`` / ``GGUFEmbedding``: the embedding rows gathered and dequantized; a tied head shares
  their buffers (stored once);
- ``DynQuantLinear`` (8da4w with ``act="int8-asym"``, the ``executorch`` backend's): the same int4 weights (and int8
  head) as signed integers with float32 scales, each activation row quantized to int8 with a zero point, float32
  otherwise, written with torchao's quantize / dequantize ops: ExecuTorch's XNNPACK partitioner lowers that
  pattern to its dynamically quantized GEMMs, and eager computes the same formula.

The kernels take bfloat16 activations: their float32 paths are scalar reference loops (~30-60x slower
on SmolLM2's shapes, measured), and Inductor's CPU WOQ GEMM templates take bf16 only. So int8/int4/8da4w
programs round each quantized matmul's input and output to bf16; the rest of the model (norms, attention,
the cache, residuals) stays in the model's dtype.

``reference=True`` builds what ``kvtrace verify`` compares a quantized program with: the same modules with
their weights dequantized to float32 (``DequantLinear`` / ``nn.Embedding``), computed by plain ``F.linear``
with the same activation rounding, from the source weights by the same quantizer but without any kernel
layout (packing), so a packing fault (a wrong group size, a dropped zero) shows. ``activations="float32"``
gives the same weights with float32 activations: the second route of the bf16 tolerance.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.spec.quant import GROUP_SIZES, QuantSpec

__all__ = ["DequantLinear", "DynQuantLinear", "GGUFEmbedding", "GGUFLinear", "GGUFRows", "Int4Linear", "Int8Embedding",
           "Int8Linear", "dequantize_int4", "dynamic_int8_rows", "pack_int4", "quantize_decoder", "quantize_int4",
           "quantize_int8", "template_ops"]

BF16 = torch.bfloat16
# gguf: a lookup from a float32 weight [N, K] to its GGUF blocks: (format, q [N, K/32, 32], d [N, K/32], m or None),
# or (None, why) when its rows are not all blocks of one kept type
GGUFRows = Callable[[torch.Tensor], tuple[Any, ...]]


# --- quantizers: float32 weights -> logical (q, scale, zero); no kernel layout ---------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale bf16 [N]): symmetric per row, q = round(w / scale) against the
    stored (bf16) scale."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(BF16)  # [N]
    q = torch.round(w / scale.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q uint8 [N, K] in 0..15, scale bf16 [N, K/g], zero bf16 [N, K/g]) with
    ``w ~ (q - 8) * scale + zero``. Asymmetric: min/max per group (torchao's int4 weight-only choice);
    symmetric (8da4w): zero 0, scale = max|w| / 7.5, q - 8 in -8..7."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-10).to(BF16)
        zero = torch.zeros_like(scale)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-10).to(BF16)
        zero = (lo + 8 * scale.float()).to(BF16)
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None]) + 8
    return q.clamp(0, 15).to(torch.uint8).reshape(n, k), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q [N, K] 0..15, scale, zero [N, K/g]) -> w float32 [N, K] = (q - 8) * scale + zero."""
    n, k = q.shape
    g = q.reshape(n, scale.shape[1], -1).float() - 8
    return (g * scale.float()[..., None] + zero.float()[..., None]).reshape(n, k)


@functools.cache
def int4pack_layout() -> str:
    """The CPU int4pack layout this process's torch packs and reads (``spec.quant.INT4_LAYOUTS``): torch picks it by
    the CPU capability it dispatches (``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY``
    can lower), and its int4 matmul reads the layout of its own dispatch. Found by packing a probe: 64 outputs,
    output n holding n // 4, whose first byte pairs output 0 with output 32 (n64), 16 (n32) or 1 (pairs)."""
    probe = (torch.arange(64, dtype=torch.int32) // 4)[:, None].expand(64, 2).contiguous()  # [N=64, K=2]
    first = int(torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1).flatten()[0])
    layouts = {8 << 4: "n64", 4 << 4: "n32", 0: "pairs"}
    if first not in layouts:
        raise UnsupportedError(f"torch's CPU int4pack layout on this machine is not one kvtrace knows (probe byte "
                               f"{first}, expected one of {sorted(layouts)}); int4 needs torch's x86 or default layout")
    return layouts[first]


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU int4pack kernel's layout: (weight uint8 [N, K/2], scale_zeros bf16 [K/g, N, 2]). The weight's byte
    order depends on the CPU capability torch dispatches (``int4pack_layout``), recorded in the QuantSpec."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    return packed, torch.stack([scale.t(), zero.t()], dim=-1).contiguous()


# --- modules ----------------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [M, K]


def _materialized(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself (a view of the same values), which Inductor computes into a buffer of its own: ``as_strided``
    needs one. Otherwise Inductor inlines the producer of a generated reduction's input (an RMSNorm, a residual add)
    into the reduction, recomputing it for every output tile it reads the input for. GGUF decode on SmolLM2 (aoti, 2
    threads, alternated in one process, stop 39): 72.9 vs 64.3 tokens/s, the same greedy tokens."""
    return t.as_strided(t.shape, t.stride())


def _quant_rows_int8(x: torch.Tensor) -> torch.Tensor:
    """8da4w's activations: each row quantized to int8 (symmetric, one scale per row) and back."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=1e-10)
    return torch.round(xf / s).clamp(-128, 127) * s


def dynamic_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """Activations "int8-asym": each row of ``x`` (float32) quantized to int8 with its own scale and zero point (the
    range widened to hold 0) and back, with torchao's ops (a dependency of executorch): the pattern ExecuTorch's
    XNNPACK partitioner takes for its dynamically quantized (qd8) GEMMs, and what eager computes alike."""
    import torchao.quantization.quant_primitives  # noqa: F401  (registers torch.ops.torchao)

    ops = torch.ops.torchao
    block = [1] * (x.dim() - 1) + [x.shape[-1]]  # one row
    scale, zero = ops.choose_qparams_affine(x, "ASYMMETRIC", block, torch.int8, -128, 127,
                                            torch.finfo(torch.float32).eps, torch.float32, torch.int8)
    q = ops.quantize_affine(x, block, scale, zero, torch.int8, -128, 127)
    return ops.dequantize_affine(q, block, scale, zero, torch.int8, -128, 127, output_dtype=torch.float32)


class DynQuantLinear(nn.Module):
    """y = rows(x) @ W.T (+ bias), ``rows``: ``dynamic_int8_rows``; W = q * scale per group of ``group_size`` input
    features (symmetric: q int8 in [-8, 7] for int4, [-128, 127] for an int8 head with one group per row); float32.
    The executorch backend's 8da4w: ExecuTorch's XNNPACK partitioner lowers it to qd8-f32-qb4w / qc8w GEMMs."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, group_size: int, bits: int, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", q)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N, K / group_size] float32 (bf16 values: the quantizer's)
        self.register_buffer("zero", torch.zeros(scale.shape, dtype=torch.int8))  # [N, K / group_size]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group_size, self.bits = group_size, bits
        self.qmin, self.qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torchao.quantization.quant_primitives  # noqa: F401

        w = torch.ops.torchao.dequantize_affine(self.weight, [1, self.group_size], self.scale, self.zero, torch.int8,
                                                self.qmin, self.qmax, output_dtype=torch.float32)  # [N, K]
        y = F.linear(dynamic_int8_rows(x.float()), w)  # [..., N] float32
        if y.dtype != x.dtype:  # a trace-time choice: no conversion node for a float32 model (it would hide the linear
            y = y.to(x.dtype)  # from the executorch backend's split rewrite, ``executorch_graph._split_projections``)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """y = x @ (weight * scale).T (+ bias), weight int8 [N, K], scale bf16 [N]; bf16 activations."""

    # In a frozen program (aoti-packed) Inductor's CPU GEMM template runs this matmul with a micro-kernel it picks by
    # the row count M: for a T-symbolic M, AMX over weight blocks dequantized to bf16 on the fly; for M = 1, an
    # AVX-512 one. Read by ``backends.aoti_packed.own_decode`` (a decoder mostly of these gets its own decode program).
    one_row_template = True
    # Unfrozen (aoti) on a CPU where ``backends.one_row.wanted``, a one-row call is rewritten as a reduction over the
    # int8 weight (``one_row.rewrite``), the kernel's bf16 rounding of input and output kept (Inductor's
    # ``emulate_precision_casts``, ``backends.aoti.export_options``), and the decoder gets a decode program of its own.
    one_row_reduction = True

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N] bf16
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_rows(x).to(BF16), self.weight, self.scale)  # [M, N] bf16
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ W.T (+ bias), W = (q - 8) * scale + zero per group of ``group_size`` input features, in the CPU
    int4pack layout; bf16 activations (8da4w: each row quantized to int8 first)."""

    # Captured for a frozen program (aoti-packed, ``template_ops``), this calls the aten op, which Inductor's CPU
    # int4 GEMM template lowers, picking its micro-kernel by the row count as it does for int8: so a decoder mostly of
    # these gets its own decode program too (``backends.aoti_packed.own_decode``). SmolLM2 int4, 2 threads,
    # alternated in one process (stop 40): the template with decode on its own program, prefill of 37 tokens 34.8 ms
    # and decode 104.0 tokens/s, against 89.6 ms / 89.1 for the kernel on one program (and 92.9 / 97.2 for the kernel
    # with its own decode; the template on the one T-symbolic program decodes at 58.3).
    one_row_template = True
    template_op = False  # True while ``template_ops`` captures it

    def __init__(self, weight: torch.Tensor, scale_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
                 act_int8: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)  # [N, K/2] uint8 (int4pack)
        self.register_buffer("scale_zeros", scale_zeros)  # [K/g, N, 2] bf16
        # the group size as a tensor: the kernel's tensor-argument form (see ``forward``)
        self.register_buffer("group", torch.tensor([group_size], dtype=torch.int64))  # [1]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group_size, self.act_int8 = group_size, act_int8
        self.out_features = scale_zeros.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if self.act_int8:
            rows = _quant_rows_int8(rows)
        # quantized::int4mm_packed_weight_cpu is aten._weight_int4pack_mm_for_cpu with the group size as a tensor:
        # Inductor lowers the aten op by creating that tensor as a constant of its own, which an AOTInductor
        # library built without its weights then expects from the caller; as a buffer it is stored with the rest
        if self.template_op:  # the weights frozen into the library with the program: no caller-side constant
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(BF16), self.weight, self.group_size, self.scale_zeros)
        else:
            y = torch.ops.quantized.int4mm_packed_weight_cpu(rows.to(BF16), self.weight, self.group, self.scale_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


@contextlib.contextmanager
def template_ops(decoder: nn.Module) -> Iterator[None]:
    """While captured inside this, ``decoder``'s Int4Linear modules call ``aten._weight_int4pack_mm_for_cpu``, the op
    Inductor's int4 GEMM template lowers; for programs whose weights are frozen into the library (aoti-packed):
    the aten op takes the group size as an int, which Inductor turns into a constant of its own, one a library built
    without its weights (``aoti``) would then expect from the caller. Restored on exit, also on error."""
    mods = [(m, m.__dict__.get("template_op")) for m in decoder.modules() if isinstance(m, Int4Linear)]
    for m, _ in mods:
        m.template_op = True
    try:
        yield
    finally:
        for m, before in mods:
            if before is None:
                del m.template_op  # the class's False again
            else:
                m.template_op = before


LANES = 32  # GGUFLinear's output tile: 32 output features side by side, so decode's reduction is vertical


def _tile_blocks(fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GGUF blocks by row (q [N, G, 32], d and m [N, G]) -> GGUFLinear's tiles, N padded to a multiple of 32
    with zero blocks: q4 packed two per byte, q [N/32, G, 16, 32] uint8 (low nibble element 2j, high 2j+1 of
    block g, for output 32t + lane); q8_0 q [N/32, G, 32, 32] int8; d and m [N/32, G, 32] float16.
    The same values, rearranged: nothing is re-quantized."""
    n, g, _ = q.shape
    pad = -n % LANES
    if pad:
        q = torch.cat([q, q.new_zeros(pad, g, 32)])
        d = torch.cat([d, d.new_zeros(pad, g)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, g)])
    t = (n + pad) // LANES
    if fmt == "q8_0":
        qt = q.reshape(t, LANES, g, 32).permute(0, 2, 3, 1)  # [T, G, 32, lane]
    else:
        pairs = q.reshape(t, LANES, g, 16, 2)  # [T, lane, G, 16, (even, odd)]
        qt = (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 3, 1)  # [T, G, 16, lane]

    def by_tile(v: torch.Tensor) -> torch.Tensor:
        return v.reshape(t, LANES, g).permute(0, 2, 1).contiguous()  # [T, G, lane]

    return qt.contiguous(), by_tile(d), None if m is None else by_tile(m)


class GGUFLinear(nn.Module):
    """y = x @ W.T (+ bias) over a GGUF's blocks, in float32: W = d * q + m (q4_1), d * (q - 8) (q4_0), d * q (q8_0),
    per block of 32 input features. Built from the blocks by row (q [N, K/32, 32]: uint8 0..15, or int8 for q8_0;
    d and m float16 [N, K/32]) and stored as ``_tile_blocks`` lays them out: 4-bit values two per byte (what the
    file stores, ~0.6 bytes a weight with d and m), 32 output rows side by side.

    Decode (one row) is one fused multiply-reduce over the blocks that Inductor generates from ``_decode``: it
    reads the tiles once, with 32 outputs side by side in a vector. Prefill (more rows) dequantizes the weight
    (``weight_t``, bit for bit what gguf's dequantize gives) and multiplies with ATen."""

    one_token_path = True  # a one-token call computes differently: a decoder of these needs its own decode program

    def __init__(self, fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bias: torch.Tensor | None):
        super().__init__()
        self.fmt = fmt
        self.out_features, self.in_features = q.shape[0], q.shape[1] * q.shape[2]
        qt, dt, mt = _tile_blocks(fmt, q, d, m)
        self.register_buffer("q", qt)  # [T, G, 16, lane] uint8 (q4) or [T, G, 32, lane] int8 (q8_0)
        self.register_buffer("d", dt)  # [T, G, lane] float16
        self.register_buffer("m", mt)  # [T, G, lane] float16 (q4_1) or None
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def weight_t(self) -> torch.Tensor:
        """W.T float32 [K, N'] (N' = N padded to whole tiles), dequantized as gguf does it (d * q exact: a 4-bit or
        8-bit q times a float16 d fits float32's mantissa; then + m, rounded once). Built in this orientation
        because the tiles are read 32 outputs at a time: [N, K] would transpose each tile (~4x slower, measured)."""
        if self.fmt == "q8_0":
            q8 = self.q.permute(1, 2, 0, 3)  # [G, 32, T, lane]
            return (q8.float() * self.d.permute(1, 0, 2).float()[:, None]).reshape(self.in_features, -1)
        q = self.q.permute(1, 2, 0, 3)[:, :, None]  # [G, 16, 1, T, lane]
        d = self.d.permute(1, 0, 2).float()[:, None, None]  # [G, 1, 1, T, lane]
        lo = (q & 15).float()  # input features 2j of each block
        hi = (q.float() - lo) * 0.0625  # the high nibbles (2j + 1), without a uint8 shift (slow in Inductor); exact
        if self.fmt == "q4_0":
            lo, hi = lo - 8, hi - 8
        # one pointwise pass writing [G, 16, (even, odd), T, lane]: a torch.stack of the two halves was three
        # passes in Inductor (each half to a buffer, then the interleave; 3072x576: 0.86 vs 0.41 ms)
        odd = torch.arange(2, device=q.device).view(1, 1, 2, 1, 1) == 1
        w = torch.where(odd, hi, lo) * d  # exact: a 4-bit value times a float16 d fits float32's mantissa
        if self.m is not None:
            w = w + self.m.permute(1, 0, 2).float()[:, None, None]  # rounded once, as gguf's d * q + m
        return w.reshape(self.in_features, -1)

    def dequantized(self) -> torch.Tensor:
        """W float32 [N, K], bit for bit what gguf's dequantize gives."""
        return self.weight_t()[:, : self.out_features].t()

    def _decode(self, row: torch.Tensor) -> torch.Tensor:
        """row [K] float32 -> y [N]: per block, d * (x . q) (+ m * sum(x)), q read once as stored, with the 32
        outputs of a tile side by side in a vector (a reduction per 32-weight block was ~1.7x slower, and
        dequantizing each weight before the multiply ~1.5x, measured). Rows [R, K] -> [R, N] (a slots decode: R
        conversations of one token each) the same way per row: every index counts from the right, so one row
        ([K]) traces exactly the graph it always did."""
        lead = row.shape[:-1]  # () or (R,)
        blocks = row.view(*lead, -1, 32)  # [..., G, 32]
        if self.fmt == "q8_0":
            dot = (blocks[..., None, :, :, None] * self.q.float()).sum(-2)  # [..., T, G, lane]: x . q per block
        else:
            # byte b = lo + 16 hi holds inputs 2j (lo) and 2j+1 (hi): x_even lo + x_odd hi
            # = (x_odd / 16) b + (x_even - x_odd / 16) lo, so each byte costs two conversions and two multiply-adds
            # (no per-weight subtraction); the two coefficients per byte are computed once per token, into a
            # buffer of their own (3072x576 Q4_1: 80 vs 90 us, alternated, stop 44)
            pairs = row.view(*lead, -1, 16, 2)  # [..., G, 16, (even, odd)]
            odd16 = pairs[..., 1] * 0.0625  # exact: a power of two
            coef = _materialized(torch.stack([odd16, pairs[..., 0] - odd16], -1))[..., None, :, :, :, None]
            b = self.q.to(torch.int32)  # widened once, then masked: one widening a byte, not two (3072x576: -6 %)
            lo = (b & 15).float()  # [T, G, 16, lane]
            dot = (coef[..., 0, :] * b.float() + coef[..., 1, :] * lo).sum(-2)  # [..., T, G, lane]
            if self.fmt == "q4_0":
                dot = dot - 8 * blocks.sum(-1)[..., None, :, None]
        y = dot * self.d.float()
        if self.m is not None:
            y = y + blocks.sum(-1)[..., None, :, None] * self.m.float()
        return y.sum(-2).reshape(*lead, -1)[..., : self.out_features]  # [..., N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x).float()  # [M, K]
        m_rows = rows.shape[0]
        if isinstance(m_rows, int) and m_rows == 1:  # decode (a trace-time size): one pass over the tiles
            y = self._decode(_materialized(rows[0]))[None]  # [1, N]
        elif x.dim() == 3 and isinstance(x.shape[1], int) and x.shape[1] == 1:
            # a slots decode (x [R, 1, K], R symbolic): every row through the one-token path, not a dequantized
            # weight per call. SmolLM2 Q4_1, aoti, 4 slots (stop 50): a step of R rows dequantizing the weights
            # took 52-91 ms at R = 1 and 120-134 at R = 4
            y = self._decode(_materialized(rows))  # [R, N]
        else:
            y = (rows @ self.weight_t())[:, : self.out_features]  # [M, N]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Embedding(nn.Module):
    """Rows of an int8 table [V, D] with one bf16 scale per row, dequantized on lookup."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight)  # [V, D] int8
        self.register_buffer("scale", scale)  # [V] bf16
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.weight[tokens].float() * self.scale[tokens].float()[..., None]).to(self.dtype)


class GGUFEmbedding(nn.Module):
    """Rows of a GGUF table (``GGUFLinear``'s tiles, shared with a tied head), dequantized on lookup: token v is
    lane v % 32 of tile v // 32."""

    def __init__(self, linear: GGUFLinear, dtype: torch.dtype):
        super().__init__()
        self.fmt, self.dtype = linear.fmt, dtype
        self.register_buffer("q", linear.q)
        self.register_buffer("d", linear.d)
        self.register_buffer("m", linear.m)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t, lane = tokens // LANES, tokens % LANES  # [B, T] each
        q = self.q[t, :, :, lane]  # [B, T, G, 16] packed (q4) or [B, T, G, 32] (q8_0)
        d = self.d[t, :, lane].float()[..., None]  # [B, T, G, 1]
        if self.fmt == "q8_0":
            w = q.float() * d
        else:
            w = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2).float()  # [B, T, G, 32]
            w = (w - 8) * d if self.fmt == "q4_0" else w * d
            if self.m is not None:
                w = w + self.m[t, :, lane].float()[..., None]
        return w.flatten(-2).to(self.dtype)


class DequantLinear(nn.Module):
    """The reference of a quantized linear: its weight dequantized to float32, ``F.linear``, with the program's
    activation rounding (``activations``: "bfloat16", "int8-dynamic" (then bf16), "int8-asym" (float32 otherwise)
    or "float32": none)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activations: str):
        super().__init__()
        self.register_buffer("weight", weight.float())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.activations = activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float()
        if self.activations == "int8-dynamic":
            rows = _quant_rows_int8(rows)
        elif self.activations == "int8-asym":
            rows = dynamic_int8_rows(rows)
        bf16 = self.activations in ("bfloat16", "int8-dynamic")
        if bf16:
            rows = rows.to(BF16).float()
        y = F.linear(rows, self.weight)
        if bf16:
            y = y.to(BF16)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


# --- applying a QuantSpec to a decoder ----------------------------------------------------------------
def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _targets(decoder: nn.Module) -> tuple[dict[str, nn.Linear], dict[str, nn.Embedding], dict[str, str]]:
    """(linears, embeddings, tied linear name -> embedding name) of ``decoder``."""
    linears = {n: m for n, m in decoder.named_modules(remove_duplicate=False) if type(m) is nn.Linear}
    embeds = {n: m for n, m in decoder.named_modules(remove_duplicate=False) if type(m) is nn.Embedding}
    by_weight = {id(e.weight): n for n, e in embeds.items()}
    tied = {n: by_weight[id(m.weight)] for n, m in linears.items() if id(m.weight) in by_weight}
    return linears, embeds, tied


@torch.no_grad()
def quantize_decoder(decoder: nn.Module, spec: QuantSpec, *, gguf: GGUFRows | None = None,
                     reference: bool = False, activations: str | None = None) -> QuantSpec:
    """Quantize ``decoder``'s linear layers (and embedding / head) in place; returns ``spec`` with every module's
    format recorded (``tensors``) and, for gguf, what was dequantized and why.

    ``reference``: build verify's reference instead (``DequantLinear``, dequantized ``nn.Embedding``), choosing
    exactly the modules ``spec.tensors`` names when it names any. ``activations`` (reference only): override
    the activation rounding (e.g. "float32"). ``gguf``: the lookup of GGUF blocks (scheme "gguf").
    """
    if not hasattr(decoder, "cache_spec"):
        raise UnsupportedError(f"{type(decoder).__name__} is not a kvtrace Decoder; quantization applies to the "
                               "decoders kvtrace builds (the llama family)")
    if spec.scheme == "gguf" and gguf is None and not reference:
        raise UnsupportedError("quant='gguf' keeps a GGUF file's blocks; this model was not loaded from a GGUF file. "
                               "Pass a .gguf source, or use --quant int8 / int4")
    act = activations or spec.activations
    asym = spec.activations == "int8-asym"  # the executorch backend's modules (``DynQuantLinear``)
    dtype = decoder.cache_spec.torch_dtype
    linears, embeds, tied = _targets(decoder)
    chosen = spec.tensors or None  # a recorded spec: exactly its modules
    tensors: dict[str, str] = {}
    dequantized: dict[str, str] = {}

    def wanted(name: str) -> bool:
        return chosen is None or name in chosen

    # the embedding (and a head tied to it)
    for ename, emb in embeds.items():
        heads = [n for n, e in tied.items() if e == ename]
        if (spec.scheme != "gguf" and not spec.head) or not wanted(ename):
            continue
        if spec.scheme == "gguf":
            found = gguf(emb.weight) if gguf is not None else (None, "reference")
            if found[0] is None:
                dequantized[ename] = found[1]
                continue
            lin = GGUFLinear(*found, None)
            if reference:
                _set(decoder, ename, nn.Embedding.from_pretrained(lin.dequantized().to(dtype), freeze=True))
            else:
                _set(decoder, ename, GGUFEmbedding(lin, dtype))
            tensors[ename] = found[0]
            for h in heads:
                _set(decoder, h, DequantLinear(lin.dequantized(), None, act) if reference else lin)
                tensors[h] = f"tied:{ename}"
            continue
        q, scale = quantize_int8(emb.weight)
        if reference:
            w = q.float() * scale.float()[:, None]
            _set(decoder, ename, nn.Embedding.from_pretrained(w.to(dtype), freeze=True))
            for h in heads:
                _set(decoder, h, DequantLinear(w, None, act))
        else:
            _set(decoder, ename, Int8Embedding(q, scale, dtype))
            for h in heads:
                _set(decoder, h, _int8_linear(q, scale, None, asym))
        tensors[ename] = "int8"
        tensors.update({h: f"tied:{ename}" for h in heads})
    for name, lin in linears.items():
        if name in tied or not wanted(name):
            continue
        is_head = lin is getattr(decoder, "output", None)  # the output head (LlamaDecoder.output)
        bias = None if lin.bias is None else lin.bias.detach().clone()
        w = lin.weight
        if spec.scheme == "gguf":
            found = gguf(w) if gguf is not None else (None, "reference")
            if found[0] is None:
                dequantized[name] = found[1]
                continue
            mod = GGUFLinear(*found, bias)
            _set(decoder, name, DequantLinear(mod.dequantized(), bias, act) if reference else mod)
            tensors[name] = found[0]
        elif spec.scheme == "int8" or (is_head and chosen is None):
            if is_head and not spec.head:
                continue
            q, scale = quantize_int8(w)
            _set(decoder, name, DequantLinear(q.float() * scale.float()[:, None], bias, act) if reference
                 else _int8_linear(q, scale, bias, asym))
            tensors[name] = "int8"
        else:  # int4 / 8da4w
            if chosen is not None and chosen[name] == "int8":  # a recorded int8 head
                q, scale = quantize_int8(w)
                _set(decoder, name, DequantLinear(q.float() * scale.float()[:, None], bias, act) if reference
                     else _int8_linear(q, scale, bias, asym))
                tensors[name] = "int8"
                continue
            g = spec.group_size
            if w.shape[1] % g:
                dequantized[name] = f"in_features {w.shape[1]} is not a multiple of group_size {g}"
                continue
            sym = spec.scheme == "8da4w"
            q, scale, zero = quantize_int4(w, g, symmetric=sym)
            if reference:
                mod = DequantLinear(dequantize_int4(q, scale, zero), bias, act)
            elif asym:  # signed values, the scales as float32: XNNPACK packs them itself (no int4pack layout)
                mod = DynQuantLinear(q.to(torch.int8) - 8, scale.float(), g, 4, bias)
            else:
                mod = Int4Linear(*pack_int4(q, scale, zero), g, bias, act_int8=sym)
            _set(decoder, name, mod)
            tensors[name] = "int4-sym" if sym else "int4"
    if chosen is not None and set(chosen) != set(tensors) and not reference:
        raise UnsupportedError(f"the decoder's modules do not match the recorded quantization: "
                               f"{sorted(set(chosen) ^ set(tensors))[:4]}")
    if chosen is None and not reference and spec.scheme in ("int4", "8da4w"):
        _check_group_size(spec, linears, tensors, dequantized)
    packed = not reference and not asym and any(f.startswith("int4") for f in tensors.values())
    return QuantSpec(spec.scheme, spec.group_size, spec.head, tensors, dequantized,
                     int4_layout=int4pack_layout() if packed else None, act=spec.act)


def _check_group_size(spec: QuantSpec, linears: dict[str, nn.Linear], tensors: dict[str, str],
                      dequantized: dict[str, str]) -> None:
    """UsageError when ``spec.group_size`` left linears in float32 (their in_features not a multiple of it) that
    another group size would have quantized: the user asked for int4 weights and would get mostly float32 ones
    (SmolLM2 at group size 128: 90 of 120 linears, in_features 576, a 347 MiB "8da4w" artifact). Where no group
    size fits a layer, it stays float32 as recorded (``QuantSpec.dequantized``)."""
    left = [n for n, why in dequantized.items() if why.startswith("in_features")]
    if not left:
        return
    grouped = [n for n, f in tensors.items() if f.startswith("int4")] + left  # the linears taking int4 groups
    fits = [g for g in GROUP_SIZES if all(linears[n].in_features % g == 0 for n in grouped)]
    if fits:
        raise UsageError(f"quant={spec.scheme!r} with group_size {spec.group_size} would leave {len(left)} of "
                         f"{len(grouped)} linear layers in float32: their in_features "
                         f"({linears[left[0]].in_features} in {left[0]}) are not a multiple of {spec.group_size}. "
                         f"Group sizes that divide every layer: {fits}; pass one (--quant-group-size "
                         f"{max(fits)}, or quant_group_size={max(fits)})")


def _int8_linear(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, asym: bool) -> nn.Module:
    """An int8 head (per row): torch's weight-only kernel, or with "int8-asym" activations XNNPACK's qc8w pattern."""
    return DynQuantLinear(q, scale.float()[:, None], q.shape[1], 8, bias) if asym else Int8Linear(q, scale, bias)
