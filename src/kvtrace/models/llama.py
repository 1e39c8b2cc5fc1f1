"""LlamaDecoder: a small, direct Llama-family decoder over a declared static cache (gpt-fast style).

Built from an HF model's weights and config (Llama, SmolLM2, Qwen2, Mistral, Qwen3, SmolLM3, Granite, OLMo2,
Phi-3 incl. LongRoPE; with or without a sliding window); each family's quirks are ``LlamaArgs`` fields read
once from the config (``llama_args.py``); verified against the HF model by ``kvtrace verify``. It exists
because a lean graph compiles to a lean program: q/k/v and gate/up projections are fused into one matmul
each, RoPE is a table lookup by ``input_pos`` (LongRoPE: two tables, the call's max position picks one), and
the cache is written and read in one function (``cached_attention``, over ``cache.attend.update``).

Decoder contract (see spec/decoder.py)::

    forward(tokens [B, T], input_pos [T], k0, v0, k1, v1, ...) -> logits [B, T, V]
    k_i, v_i: [B, H_kv, S, D], written in place at input_pos
    (a SLIDING layer: S = window, a ring written at input_pos % window, see cache/sliding.py)
    (an int8 cache, ``kv_dtype="int8"``: k_i, v_i int8 then k_scale_i, v_scale_i [B, H_kv, S, 1], see cache/int8.py;
    state is split per layer by ``CacheSpec.layer_state``)

The exported programs use ``forward_live(tokens, input_pos, key_pos [L], *state)``: the same, but
attention reads only the live prefix ``[0, L)`` of each cache (L symbolic), so a short conversation
does not pay for max_seq_len (see ``ProgramSpec.key_pos``). Sliding-window layers (Mistral's
``sliding_window``, Qwen2's / Qwen3's ``use_sliding_window`` layers) attend over their ring plus the call's own keys,
masked by each slot's position (``sliding.attention_inputs``); a cache of sliding layers only exports
``forward``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtrace._errors import UnsupportedError
from kvtrace.cache import attend, full
from kvtrace.models import fused
from kvtrace.models.hf_generic import hf_cache_spec
from kvtrace.models.llama_args import LENGTH_DEPENDENT_ROPE, MODEL_TYPES, LlamaArgs, read_args, supports
from kvtrace.models.registry import Family
from kvtrace.models.step import Step, programs_for, ring_layers
from kvtrace.spec import config as hfconfig
from kvtrace.spec.cache import CacheSpec, LayerState

__all__ = ["FAMILY", "LENGTH_DEPENDENT_ROPE", "LlamaArgs", "LlamaDecoder", "supports"]


class _Layer(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.attn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))  # on the sublayer's input, or output (post_norms)
        self.wqkv = nn.Linear(a.dim, q + 2 * kv, bias=a.qkv_bias, dtype=dtype)
        if a.qk_norm is not None:  # "head": [D] per head; "proj": [H * D] and [H_kv * D] over the projections
            self.q_norm = nn.Parameter(torch.empty(a.head_dim if a.qk_norm == "head" else q, dtype=dtype))
            self.k_norm = nn.Parameter(torch.empty(a.head_dim if a.qk_norm == "head" else kv, dtype=dtype))
        self.wo = nn.Linear(q, a.dim, bias=a.o_bias, dtype=dtype)
        self.ffn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
        self.w13 = nn.Linear(a.dim, 2 * a.hidden_dim, bias=False, dtype=dtype)  # gate and up, fused
        self.w2 = nn.Linear(a.hidden_dim, a.dim, bias=False, dtype=dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, upcast: bool = False) -> torch.Tensor:
    """As HF: normalise in fp32, cast back, then scale; ``upcast`` (OLMo2): scale in fp32, then cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype) if upcast else weight * xf.to(x.dtype)


def _norm(a: LlamaArgs, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _rms_norm(x, weight, a.norm_eps, a.norm_upcast)


def _qkv(a: LlamaArgs, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         rope: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [B, T, dim] -> q [B, H, T, D], k and v [B, H_kv, T, D]: projected, q/k-normed, rotated (unless not rope)."""
    b, t, _ = h.shape
    q_size, kv_size = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    q, k, v = layer.wqkv(h).split([q_size, kv_size, kv_size], dim=-1)  # [B, T, H * D], [B, T, H_kv * D] x 2
    if a.qk_norm == "proj":  # OLMo2: over the whole projection, before the split into heads
        q, k = _norm(a, q, layer.q_norm), _norm(a, k, layer.k_norm)
    q, k = q.view(b, t, a.n_heads, a.head_dim), k.view(b, t, a.n_kv_heads, a.head_dim)
    if a.qk_norm == "head":  # Qwen3: per head
        q, k = _norm(a, q, layer.q_norm), _norm(a, k, layer.k_norm)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if rope:
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return q, k, v.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)


def cached_attention(a: LlamaArgs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor,
                     mask: torch.Tensor, layer: LayerState, key_pos: torch.Tensor | None, ring: bool,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
    """The one place a layer touches its cache: write k, v [B, H_kv, T, D] at input_pos and attend -> [B, H, T, D].

    What it reads and writes per kind and kv_dtype is ``cache.attend.update``'s: a full layer attends over
    all S slots with ``mask`` [T, S], or (``key_pos [L]``, the live prefix) over those L slots with mask [T, L];
    a ring (``ring``: a SLIDING layer, S = window) over the ring plus the new keys with its own mask.
    In one-token calls the live prefix is a view of the cache's first L slots (``cache.full.live``, no copy),
    gathered otherwise. Measured on SmolLM2 fp32 (decode tokens/s at position 32 / 300 / 900, stop 26): a gather
    (a copy of L slots) 47.0 / 42.6 / 35.7; one SDPA per KV head over per-head slices 43.7 / 40.1 / 36.6; all
    max_seq_len slots with a mask 37.0 / - / 37.7; the view against the gather: see ``cache.full.live``
    (33 -> 75 tokens/s for Q4_1 after 900 positions).
    ``slots [R]`` (a slots program): q, k, v are rows ``slots`` of the cache, row r written at ``input_pos[r]``
    ([R, T]); a full layer attends over its slots ``key_pos`` with ``mask`` [R, 1, T, L], a ring over its own
    ring plus the new keys with the ring's mask (``cache.attend.update_rows``).
    """
    if slots is not None:
        keys, values, ring_mask = attend.update_rows(layer, ring, slots, input_pos, k, v, key_pos)  # [R, H_kv, K, D]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask if ring_mask is None else ring_mask,
                                              scale=a.attention_scale, enable_gqa=True)  # [R, H, T, D]
    if not ring and layer.scales is None:  # a backend's own kernels, only while one substitutes them for a
        o = fused.attention(q, k, v, input_pos, layer.k, layer.v, a.attention_scale)  # capture (models/fused.py)
        if o is not None:
            return o
    one = isinstance(k.shape[2], int) and k.shape[2] == 1  # decode: the live prefix read as a view (full.live)
    keys, values, ring_mask = attend.update(layer, ring, input_pos, k, v, key_pos, view=one)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask if ring_mask is None else ring_mask,
                                          scale=a.attention_scale, enable_gqa=True)  # [B, H, T, D]


def _residual(a: LlamaArgs, x: torch.Tensor, out: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """x + a sublayer's output: normed first under post_norms (OLMo2), scaled by residual_multiplier (Granite)."""
    if a.post_norms:
        out = _norm(a, out, norm)
    if a.residual_multiplier != 1.0:
        out = out * a.residual_multiplier
    return x + out


def self_attention_block(a: LlamaArgs, layer: _Layer, x: torch.Tensor, input_pos: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, mask: torch.Tensor, kv: LayerState, key_pos: torch.Tensor | None = None,
                         ring: bool = False, rope: bool = True, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer: attention over the cache (``cached_attention``), then the SwiGLU MLP.

    x [B, T, dim]; cos/sin [T, D_rot]; ``kv``: the layer's cache state (k/v [B, H_kv, S, D], and an int8 cache's
    scales); mask, key_pos, ring: see ``cached_attention``. ``rope`` False: this layer applies no RoPE
    (SmolLM3). ``slots``: a slots program's rows (x [R, T, dim], cos/sin [R, 1, T, D_rot], input_pos [R, T];
    see ``cached_attention``). Pre-norm sublayers, or
    with ``a.post_norms`` the norms on each sublayer's output (``_residual``).
    """
    b, t, _ = x.shape
    h = x if a.post_norms else _norm(a, x, layer.attn_norm)
    q, k, v = _qkv(a, layer, h, cos, sin, rope)
    o = cached_attention(a, q, k, v, input_pos, mask, kv, key_pos, ring, slots)  # [B, H, T, D]
    x = _residual(a, x, layer.wo(o.transpose(1, 2).reshape(b, t, a.n_heads * a.head_dim)), layer.attn_norm)
    h = x if a.post_norms else _norm(a, x, layer.ffn_norm)
    return _residual(a, x, swiglu(layer, h), layer.ffn_norm)


def swiglu(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU with gate and up fused in ``layer.w13``."""
    gate, up = layer.w13(h).chunk(2, dim=-1)
    return layer.w2(F.silu(gate) * up)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [T, D_rot], or [B, 1, T, D_rot] per row (HF's rotate-half convention). D_rot < D (a partial rotary table,
    Phi-3's partial_rotary_factor): the first D_rot features rotate, the rest pass (shapes: a trace-time choice)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaDecoder(Step):
    """A Llama-family Decoder whose weights come from an HF model (fused, stored once)."""

    last_logits = False  # True on a program's copy (ProgramSpec.logits == "last"): the head on the last row only
    fused_attention = True  # every full layer's attention goes through cached_attention (models/fused.py)

    def __init__(self, a: LlamaArgs, spec: CacheSpec, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                 rope_long: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        dtype = spec.torch_dtype
        self.args = a
        self.cache_spec = spec
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(a, dtype) for _ in range(a.n_layers))
        self.norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False, dtype=dtype)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", rope_cos, persistent=True)  # [S_max, D]
        self.register_buffer("rope_sin", rope_sin, persistent=True)
        if a.rope_switch is not None:  # longrope: the long factors' table, [S_max, D] each
            self.register_buffer("rope_cos_long", rope_long[0], persistent=True)
            self.register_buffer("rope_sin_long", rope_long[1], persistent=True)
        self._rings = ring_layers(spec)  # attention over a ring
        self.programs = programs_for(spec)

    def slots_refusal(self) -> str | None:
        return None  # forward_slots: every row at its own positions, RoPE (longrope's switch too) per row

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor | None,
             state: tuple[torch.Tensor, ...], slots: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T], input_pos [T]; or (``slots [R]``, a slots program) tokens [R, T], input_pos [R, T]."""
        a = self.args
        x = self.tok_embeddings(tokens)  # [B, T, dim]
        if a.embedding_multiplier != 1.0:  # LlamaArgs fields: trace-time constants, never runtime branches
            x = x * a.embedding_multiplier
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, D_rot] ([R, T, D_rot] with slots)
        if a.rope_switch is not None:  # longrope, as HF: all of a call's positions go long once its last passes
            # [] (a tensor: the cache keeps what each call wrote); per row [R, 1, 1] with slots
            long = (input_pos.max() if slots is None else input_pos.amax(-1, keepdim=True)[..., None]) + 1 > a.rope_switch
            cos = torch.where(long, self.rope_cos_long[input_pos], cos)
            sin = torch.where(long, self.rope_sin_long[input_pos], sin)
        keys = key_pos if key_pos is not None else torch.arange(self.cache_spec.max_seq_len, device=tokens.device)
        # key j is visible to query i iff j <= input_pos[i]; stale slots past the position stay hidden
        mask = full.position_mask(keys, input_pos)  # [T, L] (L = S without key_pos); per row [R, 1, T, L]
        if slots is not None:  # RoPE per row, broadcast over heads
            cos, sin = cos[:, None], sin[:, None]  # [R, 1, T, D_rot]
        for i, layer in enumerate(self.layers):
            kv = self.cache_spec.layer_state(state, i)  # k, v (+ an int8 cache's scales)
            x = self_attention_block(a, layer, x, input_pos, cos, sin, mask, kv, key_pos, ring=self._rings[i],
                                     rope=i not in a.no_rope, slots=slots)
        if self.last_logits:
            x = x[:, -1:]  # [B, 1, dim]: a trace-time choice, never a runtime branch
        logits = self.output(_norm(a, x, self.norm))  # [B, T or 1, V]
        return logits / a.logits_scaling if a.logits_scaling != 1.0 else logits

    @classmethod
    def from_hf(cls, model: nn.Module, spec: CacheSpec) -> LlamaDecoder:
        """Copy (and fuse) the weights of an HF Llama-family causal LM."""
        cfg = hfconfig.text_config(model.config)
        if not supports(cfg):
            raise UnsupportedError(f"LlamaDecoder does not reproduce {cfg.model_type!r} configs like this one; "
                                   f"export it through the general HF decoder")
        hf = model.model
        att = hf.layers[0].self_attn
        qkv = att.qkv_proj if hasattr(att, "qkv_proj") else att.q_proj  # Phi-3 fuses q/k/v in HF already
        a = read_args(cfg, qkv_bias=qkv.bias is not None, o_bias=att.o_proj.bias is not None,
                      tie_embeddings=model.lm_head.weight.data_ptr() == hf.embed_tokens.weight.data_ptr())
        n, rotary = spec.max_seq_len, hf.rotary_emb
        with torch.device(hf.embed_tokens.weight.device):  # made where the HF weights are: a GPU model, no host copy
            if a.rope_switch is None:
                dec = cls(a, spec, *_rope_table(rotary, n, spec.torch_dtype))
            else:  # the short factors' table (HF's original_inv_freq: inv_freq itself may hold the long ones by now)
                short = _rope_table(rotary, n, spec.torch_dtype, rotary.original_inv_freq)
                dec = cls(a, spec, *short, _rope_table(rotary, n, spec.torch_dtype, _long_inv_freq(rotary, cfg)))
        dt = spec.torch_dtype
        with torch.no_grad():
            dec.tok_embeddings.weight.copy_(hf.embed_tokens.weight.to(dt))
            if not a.tie_embeddings:
                dec.output.weight.copy_(model.lm_head.weight.to(dt))
            dec.norm.copy_(hf.norm.weight.to(dt))
            for mine, theirs in zip(dec.layers, hf.layers, strict=True):
                copy_hf_layer(mine, theirs, dt)
        return dec.eval().requires_grad_(False)


def _put(dst: torch.Tensor | None, src: torch.Tensor | None, dt: torch.dtype, what: str) -> None:
    if (dst is None) != (src is None):
        raise UnsupportedError(f"{what}: the HF layer has {'no ' if src is None else ''}bias where LlamaDecoder "
                               f"expects {'one' if src is None else 'none'}; export it through the general HF decoder")
    if dst is not None:
        dst.copy_(src.to(dt))


@torch.no_grad()
def copy_hf_layer(mine: _Layer, theirs: nn.Module, dt: torch.dtype) -> None:
    """Copy an HF self-attention decoder layer's weights into ``mine``, fusing q/k/v and gate/up.

    Pre-norm layers (input_layernorm, post_attention_layernorm: the attention's and the MLP's input norms)
    or OLMo2's post-norm layers (post_attention_layernorm, post_feedforward_layernorm: their output norms).
    """
    att = theirs.self_attn
    pre = hasattr(theirs, "input_layernorm")
    mine.attn_norm.copy_((theirs.input_layernorm if pre else theirs.post_attention_layernorm).weight.to(dt))
    mine.ffn_norm.copy_((theirs.post_attention_layernorm if pre else theirs.post_feedforward_layernorm).weight.to(dt))
    if hasattr(att, "qkv_proj"):  # Phi-3: rows q, k, v already fused in this order
        mine.wqkv.weight.copy_(att.qkv_proj.weight.to(dt))
        _put(mine.wqkv.bias, att.qkv_proj.bias, dt, "qkv_proj")
    else:
        mine.wqkv.weight.copy_(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).to(dt))
        biases = [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]
        _put(mine.wqkv.bias, None if biases[0] is None else torch.cat(biases), dt, "q/k/v_proj")
    if hasattr(mine, "q_norm"):
        mine.q_norm.copy_(att.q_norm.weight.to(dt))
        mine.k_norm.copy_(att.k_norm.weight.to(dt))
    mine.wo.weight.copy_(att.o_proj.weight.to(dt))
    _put(mine.wo.bias, att.o_proj.bias, dt, "o_proj")
    copy_hf_mlp(mine, theirs.mlp, dt)


@torch.no_grad()
def copy_hf_mlp(mine: nn.Module, hf_mlp: nn.Module, dt: torch.dtype) -> None:
    """gate/up fused into w13 (Phi-3's gate_up_proj: gate rows first, as HF chunks it), down into w2."""
    fused = getattr(hf_mlp, "gate_up_proj", None)
    gate_up = fused.weight if fused is not None else torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight])
    mine.w13.weight.copy_(gate_up.to(dt))
    mine.w2.weight.copy_(hf_mlp.down_proj.weight.to(dt))


def _rope_table(rotary: nn.Module, n: int, dtype: torch.dtype,
                inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, D] exactly as HF's rotary embedding computes them for positions 0..n-1 (from
    ``rotary.inv_freq``, or ``inv_freq [D/2]``)."""
    inv = (rotary.inv_freq if inv_freq is None else inv_freq).float()  # [D/2], on the model's device
    pos = torch.arange(n, dtype=torch.float32, device=inv.device)  # computed where eager computes its RoPE
    freqs = pos[:, None] * inv[None, :]  # [n, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
    scale = getattr(rotary, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _long_inv_freq(rotary: nn.Module, cfg: Any) -> torch.Tensor:
    """longrope's long-factor frequencies [D/2], as HF's longrope_frequency_update gets them (its cached
    ``long_inv_freq``, else the rope init function at original_max_position_embeddings + 1) and then uses
    them: copied into the ``inv_freq`` buffer, so rounded to that buffer's dtype (bf16 after ``model.to``)."""
    long = getattr(rotary, "long_inv_freq", None)
    if long is None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        switch = cfg.rope_parameters["original_max_position_embeddings"]
        long = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=switch + 1)[0]
    return long.to(rotary.inv_freq.dtype)


def _build(model: nn.Module, *, max_seq_len: int, batch_size: int, image_tokens: int | None = None,
           kv_dtype: str | None = None) -> LlamaDecoder:
    dtype = next(model.parameters()).dtype
    spec = hf_cache_spec(model.config, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype)
    return LlamaDecoder.from_hf(model, dataclasses.replace(spec, kv_dtype=kv_dtype))


# Llama-family configs (Llama, SmolLM2, Qwen2, Mistral, Qwen3, SmolLM3, Granite, OLMo2, Phi-3; sliding windows as
# rings) that ``supports`` accepts: before the general HFDecoder. Offers int8 KV caches and quantized weights.
FAMILY = Family("llama", MODEL_TYPES, supports, _build, priority=20, kv_dtypes=("int8",), quant=True)
