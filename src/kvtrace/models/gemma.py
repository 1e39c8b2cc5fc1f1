"""GemmaDecoder: Gemma, Gemma 2 and Gemma 3 text written out directly over a declared static cache.

Built from an HF ``GemmaForCausalLM`` / ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (model types
``gemma``, ``gemma2``, ``gemma3_text``); the same lean layout as ``llama.LlamaDecoder`` (q/k/v and
gate/up fused into one matmul each, RoPE as a table indexed by ``input_pos``, one ``index_copy_`` per
cache tensor) with what sets the Gemmas apart, each as transformers 5.24 computes it:

* every RMSNorm is Gemma's: normalised in fp32, times ``(1 + w)`` in fp32, then cast (``_gemma_norm``);
* embeddings times ``sqrt(hidden_size)`` rounded to the model's dtype (HF's ``embed_scale`` buffer);
* a gated MLP with ``gelu_pytorch_tanh``; the head tied to the embeddings;
* Gemma 2 / 3: norms after attention and after the MLP as well as before them; attention scaled by
  ``query_pre_attn_scalar ** -0.5``; final logits soft-capped (``tanh(x / c) * c``) when the config
  sets ``final_logit_softcapping``; layers per ``config.layer_types``, ``sliding_attention`` ones as
  rings of ``sliding_window`` slots (``hf_cache_spec``);
* Gemma 2: attention scores soft-capped before the mask (``attn_logit_softcapping``); SDPA cannot do
  that, so such a config's attention is written out (``_attend``), as HF's eager attention does it;
* Gemma 3: per-head q/k norms (Gemma-style) before RoPE, and one RoPE table per layer type: HF's single
  rotary module keeps ``{layer_type}_inv_freq`` / ``_attention_scaling`` (sliding layers
  ``rope_local_base_freq`` unscaled, full layers the global rope with its scaling). HF 5.24's Gemma 3
  attention never passes ``attn_logit_softcapping`` on, so neither does this decoder.

Decoder contract (spec/decoder.py), programs as LlamaDecoder's (``forward_live`` with ``key_pos``: full
layers read the live prefix, sliding layers their ring plus the call's own keys)::

    forward(tokens [B, T], input_pos [T], k0, v0, k1, v1, ...) -> logits [B, T, V]
    k_i, v_i: [B, H_kv, S, D] (a SLIDING layer: S = window, written at input_pos % window)

``supports`` accepts only configs reproduced exactly; anything else (bidirectional attention, biases,
other activations, length-dependent RoPE, ...) falls through to the general family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtrace._errors import UnsupportedError
from kvtrace.cache import attend, full
from kvtrace.models.hf_generic import hf_cache_spec
from kvtrace.models.llama import LENGTH_DEPENDENT_ROPE, _rope, _rope_table
from kvtrace.models.registry import Family
from kvtrace.models.step import Step, programs_for, ring_layers
from kvtrace.spec import config as hfconfig
from kvtrace.spec.cache import CacheSpec, LayerState

__all__ = ["FAMILY", "GemmaArgs", "GemmaDecoder", "supports"]

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
ACTIVATION = "gelu_pytorch_tanh"  # F.gelu(approximate="tanh"), HF's GELUTanh
LAYER_TYPES = (hfconfig.FULL_ATTENTION, hfconfig.SLIDING_ATTENTION)


@dataclass(frozen=True)
class GemmaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int  # MLP width
    vocab_size: int
    norm_eps: float
    scale: float  # attention scale: head_dim ** -0.5 (Gemma) or query_pre_attn_scalar ** -0.5 (Gemma 2/3)
    post_norms: bool  # Gemma 2/3: norms after attention and after the MLP too
    qk_norm: bool  # Gemma 3: per-head q/k norms before RoPE
    attn_softcap: float | None  # Gemma 2: tanh soft-capping of the attention scores
    final_softcap: float | None  # Gemma 2/3: tanh soft-capping of the logits
    rope_of: tuple[int, ...]  # per layer: which RoPE table (index into the stacked tables)
    tie_embeddings: bool


def _activation(cfg: Any) -> str | None:
    return getattr(cfg, "hidden_act" if cfg.model_type == "gemma" else "hidden_activation", None)


def _rope_types(cfg: Any) -> tuple[str, ...] | None:
    """The RoPE type of every table the model builds; None when the config's rope is not understood."""
    if cfg.model_type != "gemma3_text":
        return (hfconfig.rope_type(cfg),)
    params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict) or not all(isinstance(params.get(t), dict) for t in set(cfg.layer_types)):
        return None
    return tuple(str(params[t].get("rope_type", "default")) for t in sorted(set(cfg.layer_types)))


def supports(config: Any) -> bool:
    """True when the HF config is a Gemma / Gemma 2 / Gemma 3 text decoder this module reproduces exactly."""
    cfg = config
    if getattr(cfg, "model_type", None) not in MODEL_TYPES:  # not the text config of a composite (gemma3)
        return False
    if _activation(cfg) != ACTIVATION or getattr(cfg, "attention_bias", False):
        return False
    if getattr(cfg, "use_bidirectional_attention", False):
        return False
    if cfg.model_type == "gemma" and getattr(cfg, "sliding_window", None):
        return False  # HF's Gemma never slides; a window here would make the spec declare rings
    if not set(hfconfig.layer_types(cfg)) <= set(LAYER_TYPES):
        return False
    rope = _rope_types(cfg)
    if rope is None or any(t in LENGTH_DEPENDENT_ROPE for t in rope):
        return False
    if cfg.model_type == "gemma2" and getattr(cfg, "attn_logit_softcapping", None) is not None:
        # soft-capped scores are what HF's eager attention computes; other kernels compute them otherwise
        return getattr(cfg, "_attn_implementation", None) in (None, "eager")
    return True


class _Layer(nn.Module):
    def __init__(self, a: GemmaArgs, dtype: torch.dtype):
        super().__init__()
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.attn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))  # input_layernorm
        self.wqkv = nn.Linear(a.dim, q + 2 * kv, bias=False, dtype=dtype)
        self.wo = nn.Linear(q, a.dim, bias=False, dtype=dtype)
        self.ffn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))  # pre-MLP norm
        self.w13 = nn.Linear(a.dim, 2 * a.hidden_dim, bias=False, dtype=dtype)  # gate and up, fused
        self.w2 = nn.Linear(a.hidden_dim, a.dim, bias=False, dtype=dtype)
        if a.post_norms:
            self.post_attn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
            self.post_ffn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
        if a.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(a.head_dim, dtype=dtype))
            self.k_norm = nn.Parameter(torch.empty(a.head_dim, dtype=dtype))


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF's GemmaRMSNorm: normalise in fp32, scale by (1 + w) in fp32, then cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, H_kv, S, D] with mask [T, S] or per row [B, 1, T, S] (True = visible)
    -> [B, H, T, D].

    Without soft-capping: SDPA. With it (HF's eager attention, op for op): scores = q k^T * scale in the
    model's dtype, tanh(scores / cap) * cap, masked, softmax in fp32 cast back, times v. Each KV head's
    group of query heads is one batch entry ([B, H_kv, H / H_kv, T, S]) instead of HF's repeated keys.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, h // hkv, t, d)  # query head i uses KV head i // (H / H_kv), as repeat_kv
    if mask.dim() == 4:  # per row (a slots program): [R, 1, T, S] -> [R, 1, 1, T, S] over the groups
        mask = mask[:, :, None]
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, H_kv, G, T, S]
    scores = _softcap(scores, softcap).masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v.unsqueeze(2)).view(b, h, t, d)  # [B, H, T, D]


def _block(a: GemmaArgs, layer: _Layer, x: torch.Tensor, input_pos: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, mask: torch.Tensor, kv: LayerState, key_pos: torch.Tensor | None, ring: bool,
           slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer. x [B, T, dim]; cos/sin [T, D]; ``kv``: the layer's cache state (k/v [B, H_kv, S, D],
    and an int8 cache's scales); mask [T, S] or, with ``key_pos [L]``, [T, L] over the live prefix; ``ring``: a
    SLIDING layer (mask/key_pos unused). The cache is read and written by ``cache.attend.update``; with
    ``slots [R]`` (a slots program: x [R, T, dim], input_pos [R, T], cos/sin [R, 1, T, D], mask [R, 1, T, L])
    by ``cache.attend.update_rows``, rows ``slots`` only."""
    b, t, _ = x.shape
    q_size, kv_size = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    h = _gemma_norm(x, layer.attn_norm, a.norm_eps)
    q, k, v = layer.wqkv(h).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(b, t, a.n_heads, a.head_dim).transpose(1, 2)  # [B, H, T, D]
    k = k.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
    v = v.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)
    if a.qk_norm:
        q, k = _gemma_norm(q, layer.q_norm, a.norm_eps), _gemma_norm(k, layer.k_norm, a.norm_eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if slots is None:
        keys, values, ring_mask = attend.update(kv, ring, input_pos, k, v, key_pos)  # [B, H_kv, S or L or W + T, D]
    else:
        keys, values, ring_mask = attend.update_rows(kv, ring, slots, input_pos, k, v, key_pos)  # [R, H_kv, L or W + T, D]
    o = _attend(q, keys, values, mask if ring_mask is None else ring_mask, a.scale, a.attn_softcap)
    o = layer.wo(o.transpose(1, 2).reshape(b, t, q_size))
    if a.post_norms:
        o = _gemma_norm(o, layer.post_attn_norm, a.norm_eps)
    x = x + o
    gate, up = layer.w13(_gemma_norm(x, layer.ffn_norm, a.norm_eps)).chunk(2, dim=-1)
    m = layer.w2(F.gelu(gate, approximate="tanh") * up)
    if a.post_norms:
        m = _gemma_norm(m, layer.post_ffn_norm, a.norm_eps)
    return x + m


class GemmaDecoder(Step):
    """A Gemma-family Decoder whose weights come from an HF model (fused, stored once)."""

    last_logits = False  # True on a program's copy (ProgramSpec.logits == "last"): the head on the last row only

    def __init__(self, a: GemmaArgs, spec: CacheSpec, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                 embed_scale: torch.Tensor):
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
        self.register_buffer("embed_scale", embed_scale, persistent=True)  # [] in the model's dtype
        self.register_buffer("rope_cos", rope_cos, persistent=True)  # [tables, S_max, D]
        self.register_buffer("rope_sin", rope_sin, persistent=True)
        self._rings = ring_layers(spec)  # attention over a ring
        self.programs = programs_for(spec)

    def slots_refusal(self) -> str | None:
        return None  # forward_slots: every row at its own positions (RoPE tables indexed per row)

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor | None,
             state: tuple[torch.Tensor, ...], slots: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T], input_pos [T]; or (``slots [R]``, a slots program) tokens [R, T], input_pos [R, T]."""
        a = self.args
        x = self.tok_embeddings(tokens) * self.embed_scale  # [B, T, dim]
        cos, sin = self.rope_cos[:, input_pos], self.rope_sin[:, input_pos]  # [tables, T, D] ([tables, R, T, D])
        keys = key_pos if key_pos is not None else torch.arange(self.cache_spec.max_seq_len, device=tokens.device)
        mask = full.position_mask(keys, input_pos)  # [T, L]; per row [R, 1, T, L]
        if slots is not None:  # RoPE per row, broadcast over heads
            cos, sin = cos[:, :, None], sin[:, :, None]  # [tables, R, 1, T, D]
        for i, layer in enumerate(self.layers):
            j = a.rope_of[i]
            x = _block(a, layer, x, input_pos, cos[j], sin[j], mask, self.cache_spec.layer_state(state, i), key_pos,
                       self._rings[i], slots)
        if self.last_logits:
            x = x[:, -1:]  # [B, 1, dim]: a trace-time choice, never a runtime branch
        logits = self.output(_gemma_norm(x, self.norm, a.norm_eps))  # [B, T or 1, V]
        return logits if a.final_softcap is None else _softcap(logits, a.final_softcap)

    @classmethod
    def from_hf(cls, model: nn.Module, spec: CacheSpec) -> GemmaDecoder:
        """Copy (and fuse) the weights of an HF Gemma / Gemma 2 / Gemma 3 text causal LM."""
        cfg = model.config
        if not supports(cfg):
            raise UnsupportedError(f"GemmaDecoder does not reproduce {cfg.model_type!r} configs like this one; "
                                   f"export it through the general HF family")
        hf, gemma1 = model.model, cfg.model_type == "gemma"
        types = hfconfig.layer_types(cfg)
        tables = sorted(set(types)) if cfg.model_type == "gemma3_text" else [None]  # HF: one rotary per type
        a = GemmaArgs(
            dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
            n_kv_heads=hfconfig.kv_heads(cfg), head_dim=hfconfig.head_dim(cfg), hidden_dim=cfg.intermediate_size,
            vocab_size=cfg.vocab_size, norm_eps=cfg.rms_norm_eps,
            scale=hfconfig.head_dim(cfg) ** -0.5 if gemma1 else cfg.query_pre_attn_scalar ** -0.5,
            post_norms=not gemma1, qk_norm=cfg.model_type == "gemma3_text",
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if cfg.model_type == "gemma2" else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None),
            rope_of=tuple(tables.index(t) if tables != [None] else 0 for t in types),
            tie_embeddings=model.lm_head.weight.data_ptr() == hf.embed_tokens.weight.data_ptr(),
        )
        dt = spec.torch_dtype
        cos, sin = zip(*(_rope_table(_rotary(hf.rotary_emb, t), spec.max_seq_len, dt) for t in tables), strict=True)
        dec = cls(a, spec, torch.stack(cos), torch.stack(sin), hf.embed_tokens.embed_scale.detach().to(dt).clone())
        with torch.no_grad():
            dec.tok_embeddings.weight.copy_(hf.embed_tokens.weight.to(dt))
            if not a.tie_embeddings:
                dec.output.weight.copy_(model.lm_head.weight.to(dt))
            dec.norm.copy_(hf.norm.weight.to(dt))
            for mine, theirs in zip(dec.layers, hf.layers, strict=True):
                _copy_layer(a, mine, theirs, dt)
        return dec.eval().requires_grad_(False)


def _rotary(rotary: nn.Module, layer_type: str | None) -> Any:
    """HF's rotary module as ``llama._rope_table`` reads it (``inv_freq``, ``attention_scaling``): Gemma 3's
    keeps one pair per layer type (``{layer_type}_inv_freq``, ``{layer_type}_attention_scaling``)."""
    if layer_type is None:
        return rotary
    return SimpleNamespace(inv_freq=getattr(rotary, f"{layer_type}_inv_freq"),
                           attention_scaling=getattr(rotary, f"{layer_type}_attention_scaling"))


@torch.no_grad()
def _copy_layer(a: GemmaArgs, mine: _Layer, theirs: nn.Module, dt: torch.dtype) -> None:
    """Copy an HF Gemma decoder layer's weights into ``mine``, fusing q/k/v and gate/up."""
    att, mlp = theirs.self_attn, theirs.mlp
    mine.attn_norm.copy_(theirs.input_layernorm.weight.to(dt))
    if a.post_norms:  # Gemma 2/3: post_attention_layernorm follows attention, pre_feedforward precedes the MLP
        mine.post_attn_norm.copy_(theirs.post_attention_layernorm.weight.to(dt))
        mine.ffn_norm.copy_(theirs.pre_feedforward_layernorm.weight.to(dt))
        mine.post_ffn_norm.copy_(theirs.post_feedforward_layernorm.weight.to(dt))
    else:  # Gemma: post_attention_layernorm is the pre-MLP norm
        mine.ffn_norm.copy_(theirs.post_attention_layernorm.weight.to(dt))
    if a.qk_norm:
        mine.q_norm.copy_(att.q_norm.weight.to(dt))
        mine.k_norm.copy_(att.k_norm.weight.to(dt))
    mine.wqkv.weight.copy_(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]).to(dt))
    mine.wo.weight.copy_(att.o_proj.weight.to(dt))
    mine.w13.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).to(dt))
    mine.w2.weight.copy_(mlp.down_proj.weight.to(dt))


def _build(model: nn.Module, *, max_seq_len: int, batch_size: int, image_tokens: int | None = None,
           kv_dtype: str | None = None) -> GemmaDecoder:
    dtype = next(model.parameters()).dtype
    spec = hf_cache_spec(model.config, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype)
    return GemmaDecoder.from_hf(model, dataclasses.replace(spec, kv_dtype=kv_dtype))


# Gemma, Gemma 2, Gemma 3 text (hybrid local/global layers as rings + live prefixes): before the general HFDecoder.
# Offers int8 KV caches.
FAMILY = Family("gemma", MODEL_TYPES, supports, _build, priority=20, kv_dtypes=("int8",))
