"""LlamaDecoder: a small, direct Llama-family decoder over a declared static cache (gpt-fast style).

Built from an HF model's weights and config (Llama, SmolLM2, Qwen2, Mistral, with or without a sliding window);
verified against the HF model by ``kvtrace verify``. It exists because a lean graph compiles to a
lean program: q/k/v and gate/up projections are fused into one matmul each, RoPE is a table lookup
by ``input_pos``, and the cache is written with one ``index_copy_`` per tensor.

Decoder contract (see spec/decoder.py)::

    forward(tokens [B, T], input_pos [T], k0, v0, k1, v1, ...) -> logits [B, T, V]
    k_i, v_i: [B, H_kv, S, D], written in place at input_pos
    (a SLIDING layer: S = window, a ring written at input_pos % window, see cache/sliding.py)
    (an int8 cache, ``kv_dtype="int8"``: k_i, v_i int8 then k_scale_i, v_scale_i [B, H_kv, S, 1], see cache/int8.py;
    state is split per layer by ``CacheSpec.layer_state``)

The exported programs use ``forward_live(tokens, input_pos, key_pos [L], *state)``: the same, but
attention reads only the live prefix ``[0, L)`` of each cache (L symbolic), so a short conversation
does not pay for max_seq_len (see ``ProgramSpec.key_pos``). Sliding-window layers (Mistral's
``sliding_window``, Qwen2's ``use_sliding_window`` layers) attend over their ring plus the call's own keys,
masked by each slot's position (``sliding.attention_inputs``); a cache of sliding layers only exports
``forward``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtrace._errors import UnsupportedError
from kvtrace.cache import full, int8, sliding
from kvtrace.cache.kinds import kind_of
from kvtrace.models.hf_generic import hf_cache_spec
from kvtrace.models.registry import Family
from kvtrace.spec import config as hfconfig
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.program import DEFAULT_PROGRAMS, ProgramSpec

__all__ = ["FAMILY", "LlamaArgs", "LlamaDecoder", "supports"]

MODEL_TYPES = ("llama", "qwen2", "mistral")
# RoPE variants whose frequencies depend on the whole sequence's length, not only on a position: HF's
# longrope switches every position to the long factors once the sequence passes
# original_max_position_embeddings, dynamic NTK rescales past max_position_embeddings. A table indexed by
# input_pos cannot express that; such models go through HFDecoder, which traces HF's own rotary code.
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")
# Caches this small attend to every slot: nothing to save, and export needs example lengths L > T >= 2.
MIN_LIVE_PREFIX = 8
LIVE_PROGRAMS = (ProgramSpec("prefill", method="forward_live", key_pos=True),
                 ProgramSpec("decode", method="forward_live", single_token=True, key_pos=True))


@dataclass(frozen=True)
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # MLP width
    vocab_size: int
    norm_eps: float
    qkv_bias: bool
    tie_embeddings: bool


def supports(config: Any) -> bool:
    """True when the HF config is a plain Llama-family decoder this module reproduces exactly."""
    cfg = hfconfig.text_config(config)
    if cfg.model_type not in MODEL_TYPES or getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    if getattr(cfg, "mlp_bias", False) or (cfg.model_type == "llama" and getattr(cfg, "attention_bias", False)):
        return False
    return hfconfig.rope_type(cfg) not in LENGTH_DEPENDENT_ROPE


class _Layer(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.attn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
        self.wqkv = nn.Linear(a.dim, q + 2 * kv, bias=a.qkv_bias, dtype=dtype)
        self.wo = nn.Linear(q, a.dim, bias=False, dtype=dtype)
        self.ffn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
        self.w13 = nn.Linear(a.dim, 2 * a.hidden_dim, bias=False, dtype=dtype)  # gate and up, fused
        self.w2 = nn.Linear(a.hidden_dim, a.dim, bias=False, dtype=dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As HF: normalise in fp32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def self_attention_block(a: LlamaArgs, layer: _Layer, x: torch.Tensor, input_pos: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, mask: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         key_pos: torch.Tensor | None = None, ring: bool = False,
                         scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One pre-norm decoder layer: attention over the cache (written at input_pos), then the SwiGLU MLP.

    x [B, T, dim]; cos/sin [T, D]; k_cache/v_cache [B, H_kv, S, D]; mask [T, S] (True = visible), or
    with ``key_pos [L]`` (the live prefix 0..L-1) mask [T, L] and the attention reads those L slots only.
    ``ring``: a SLIDING layer (S = window): attention over the ring plus the new keys with the mask of
    ``sliding.attention_inputs`` (``mask``/``key_pos`` unused), then the ring write.
    ``scales``: an int8 cache's (k_scale, v_scale) [B, H_kv, S, 1] (``int8_attention``).
    """
    b, t, _ = x.shape
    q_size, kv_size = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    h = _rms_norm(x, layer.attn_norm, a.norm_eps)
    q, k, v = layer.wqkv(h).split([q_size, kv_size, kv_size], dim=-1)
    q = _rope(q.view(b, t, a.n_heads, a.head_dim).transpose(1, 2), cos, sin)  # [B, H, T, D]
    k = _rope(k.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2), cos, sin)  # [B, H_kv, T, D]
    v = v.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
    if scales is not None:
        o = int8_attention(q, k, v, input_pos, mask, k_cache, v_cache, scales, key_pos, ring)  # [B, H, T, D]
    elif ring:
        keys, values, ring_mask = sliding.attention_inputs(k_cache, v_cache, input_pos, k, v)  # [B, H_kv, W + T, D]
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=ring_mask, enable_gqa=True)  # [B, H, T, D]
        sliding.OPS.write(k_cache, v_cache, input_pos, k, v)  # slots input_pos % W
    else:
        full.OPS.write(k_cache, v_cache, input_pos, k, v)  # slots input_pos of [B, H_kv, S, D]
        if key_pos is None:
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)  # [B, H, T, D]
        else:
            o = _live_attention(q, k_cache, v_cache, key_pos, mask)
    x = x + layer.wo(o.transpose(1, 2).reshape(b, t, q_size))
    return x + swiglu(layer, _rms_norm(x, layer.ffn_norm, a.norm_eps))


def int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
                   key_pos: torch.Tensor | None = None, ring: bool = False) -> torch.Tensor:
    """The attention of ``self_attention_block`` over an int8 cache (cache/int8.py): k_cache/v_cache
    [B, H_kv, S, D] int8 with ``scales`` [B, H_kv, S, 1]; every key and value the queries see is read as the
    cache stores it (quantized, then dequantized), this call's own included. -> [B, H, T, D]."""
    if ring:  # the ring as it was, plus this call's keys as the ring will hold them; written after
        ring_k, ring_v = int8.read(k_cache, v_cache, scales, q.dtype)  # [B, H_kv, W, D]
        keys, values, ring_mask = sliding.attention_inputs(ring_k, ring_v, input_pos, int8.stored(k), int8.stored(v))
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=ring_mask, enable_gqa=True)
        int8.write(sliding.OPS, k_cache, v_cache, scales, input_pos, k, v)  # slots input_pos % W
        return o
    int8.write(full.OPS, k_cache, v_cache, scales, input_pos, k, v)  # slots input_pos
    keys, values = int8.read(k_cache, v_cache, scales, q.dtype, key_pos)  # [B, H_kv, L or S, D]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def _live_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_pos: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, H, T, D] over the live cache slots 0..L-1 (key_pos [L]; mask [T, L]) -> [B, H, T, D].

    The live slots are gathered ([B, H_kv, L, D], a copy of L slots). A slice k_cache[:, :, :L] would make
    torch.export guard L != S (the view's contiguity flips at L == S), so a program could never fill
    its last slot. Measured on SmolLM2 fp32 (decode tokens/s at position 32 / 300 / 900): gather
    47.0 / 42.6 / 35.7; one SDPA per KV head over contiguous per-head slices (no copy) 43.7 / 40.1 /
    36.6; all max_seq_len slots with a mask 37.0 / - / 37.7.
    """
    k, v = k_cache.index_select(2, key_pos), v_cache.index_select(2, key_pos)  # [B, H_kv, L, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, H, T, D]


def swiglu(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU with gate and up fused in ``layer.w13``."""
    gate, up = layer.w13(h).chunk(2, dim=-1)
    return layer.w2(F.silu(gate) * up)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [T, D] (HF's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaDecoder(nn.Module):
    """A Llama-family Decoder whose weights come from an HF model (fused, stored once)."""

    last_logits = False  # True on a program's copy (ProgramSpec.logits == "last"): the head on the last row only

    def __init__(self, a: LlamaArgs, spec: CacheSpec, rope_cos: torch.Tensor, rope_sin: torch.Tensor):
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
        self._rings = tuple(kind_of(layer) is sliding.OPS for layer in spec.layers)  # attention over a ring
        live = spec.max_seq_len >= MIN_LIVE_PREFIX and not all(self._rings)  # some layer reads a live prefix
        self.programs = LIVE_PROGRAMS if live else DEFAULT_PROGRAMS

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        """Attention over all max_seq_len cache slots (stale ones masked by position)."""
        return self._run(tokens, input_pos, None, state)

    def forward_live(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor,
                     *state: torch.Tensor) -> torch.Tensor:
        """Attention over cache slots ``key_pos = 0 .. L-1`` only (L = the position after this call)."""
        return self._run(tokens, input_pos, key_pos, state)

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor | None,
             state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        a = self.args
        x = self.tok_embeddings(tokens)  # [B, T, dim]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, D]
        keys = key_pos if key_pos is not None else torch.arange(self.cache_spec.max_seq_len, device=tokens.device)
        # key j is visible to query i iff j <= input_pos[i]; stale slots past the position stay hidden
        mask = keys[None, :] <= input_pos[:, None]  # [T, L] (L = S without key_pos)
        for i, layer in enumerate(self.layers):
            kv = self.cache_spec.layer_state(state, i)  # k, v (+ an int8 cache's scales)
            x = self_attention_block(a, layer, x, input_pos, cos, sin, mask, kv.k, kv.v, key_pos, ring=self._rings[i],
                                     scales=kv.scales)
        if self.last_logits:
            x = x[:, -1:]  # [B, 1, dim]: a trace-time choice, never a runtime branch
        return self.output(_rms_norm(x, self.norm, a.norm_eps))  # [B, T or 1, V]

    @classmethod
    def from_hf(cls, model: nn.Module, spec: CacheSpec) -> LlamaDecoder:
        """Copy (and fuse) the weights of an HF Llama-family causal LM."""
        cfg = hfconfig.text_config(model.config)
        if not supports(cfg):
            raise UnsupportedError(f"LlamaDecoder does not reproduce {cfg.model_type!r} configs like this one")
        hf = model.model
        a = LlamaArgs(
            dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
            n_kv_heads=hfconfig.kv_heads(cfg), head_dim=hfconfig.head_dim(cfg), hidden_dim=cfg.intermediate_size,
            vocab_size=cfg.vocab_size, norm_eps=cfg.rms_norm_eps,
            qkv_bias=hf.layers[0].self_attn.q_proj.bias is not None,
            tie_embeddings=model.lm_head.weight.data_ptr() == hf.embed_tokens.weight.data_ptr(),
        )
        cos, sin = _rope_table(hf.rotary_emb, spec.max_seq_len, spec.torch_dtype)
        dec = cls(a, spec, cos, sin)
        dt = spec.torch_dtype
        with torch.no_grad():
            dec.tok_embeddings.weight.copy_(hf.embed_tokens.weight.to(dt))
            if not a.tie_embeddings:
                dec.output.weight.copy_(model.lm_head.weight.to(dt))
            dec.norm.copy_(hf.norm.weight.to(dt))
            for mine, theirs in zip(dec.layers, hf.layers, strict=True):
                copy_hf_layer(mine, theirs, dt)
        return dec.eval().requires_grad_(False)


@torch.no_grad()
def copy_hf_layer(mine: _Layer, theirs: nn.Module, dt: torch.dtype) -> None:
    """Copy an HF self-attention decoder layer's weights into ``mine``, fusing q/k/v and gate/up."""
    att, hf_mlp = theirs.self_attn, theirs.mlp
    mine.attn_norm.copy_(theirs.input_layernorm.weight.to(dt))
    mine.ffn_norm.copy_(theirs.post_attention_layernorm.weight.to(dt))
    mine.wqkv.weight.copy_(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).to(dt))
    if mine.wqkv.bias is not None:
        mine.wqkv.bias.copy_(torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]).to(dt))
    mine.wo.weight.copy_(att.o_proj.weight.to(dt))
    copy_hf_mlp(mine, hf_mlp, dt)


@torch.no_grad()
def copy_hf_mlp(mine: nn.Module, hf_mlp: nn.Module, dt: torch.dtype) -> None:
    mine.w13.weight.copy_(torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]).to(dt))
    mine.w2.weight.copy_(hf_mlp.down_proj.weight.to(dt))


def _rope_table(rotary: nn.Module, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, D] exactly as HF's rotary embedding computes them for positions 0..n-1."""
    pos = torch.arange(n, dtype=torch.float32)
    freqs = pos[:, None] * rotary.inv_freq.float()[None, :]  # [n, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
    scale = getattr(rotary, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _build(model: nn.Module, *, max_seq_len: int, batch_size: int, image_tokens: int | None = None,
           kv_dtype: str | None = None) -> LlamaDecoder:
    dtype = next(model.parameters()).dtype
    spec = hf_cache_spec(model.config, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype)
    return LlamaDecoder.from_hf(model, dataclasses.replace(spec, kv_dtype=kv_dtype))


# Plain Llama-family configs (Llama, SmolLM2, Qwen2, Mistral; sliding windows as rings): before the general HFDecoder.
FAMILY = Family("llama", MODEL_TYPES, supports, _build, priority=20, kv_dtypes=("int8",))
