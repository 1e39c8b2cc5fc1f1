"""MllamaDecoder: the Llama 3.2 Vision text decoder (HF ``MllamaForCausalLM``) over a declared cache.

Self-attention layers are Llama layers (a growing cache, written at ``input_pos``). Cross-attention
layers attend to ``N`` image tokens whose K/V are computed once, by the image prefill, and then read
by every later token until ``reset()``. Both caches are declared in the CacheSpec:

    layers.i.k / layers.i.v   self layer:  [B, H_kv, max_seq_len, D]   (LayerKind.FULL)
                              cross layer: [B, H_kv, N, D]             (LayerKind.CROSS, N = image tokens)
    cross.mask   [B, N]  1 = attend; the image-mask row that tokens after the image prefill use
    cross.active [1]     1 once image K/V are in the cache; 0 = text only (cross layers are skipped)

Programs (see ``spec.program``)::

    prefill       forward(tokens [B, T], input_pos [T], *state)           text tokens
    decode        forward(tokens [B, 1], input_pos [1], *state)
    prefill_image forward_image(tokens [B, T], input_pos [T],
                                cross_attention_states [B, N, dim], cross_attention_mask [B, T, N], *state)

Semantics follow HF eager exactly, as HF ``generate`` drives it:
  * text only (``cross.active == 0``): cross-attention layers are skipped, as eager skips them when
    its cache holds no image states (``torch.where``, not a Python branch: one program serves both);
  * ``cross_attention_mask [B, T, N]`` (1 = the text token sees that image token) becomes HF's additive
    mask; a text token that sees no image token gets an all-zero mask row and its cross-attention MLP
    output zeroed (HF's ``full_text_row_masked_out_mask``);
  * tokens after the image prefill reuse the mask row of its last token, as ``generate`` extends
    ``cross_attention_mask`` by repeating its last row.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.cache import cross as cross_kind
from kvtrace.cache.kinds import kind_of
from kvtrace.models.llama import (
    LlamaArgs,
    _Layer,
    _rms_norm,
    _rope_table,
    copy_hf_layer,
    copy_hf_mlp,
    self_attention_block,
    swiglu,
)
from kvtrace.models.registry import Family
from kvtrace.spec import config as hfconfig
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec, LayerState
from kvtrace.spec.program import InputSpec, ProgramSpec

__all__ = ["DEFAULT_IMAGE_TOKENS", "FAMILY", "MllamaDecoder", "cross_mask_bias", "hf_cross_kwargs", "is_mllama",
           "mllama_cache_spec"]

MODEL_TYPES = ("mllama_text_model",)
# Llama 3.2 Vision: 4 tiles x (40 x 40 patches + 1 class token) image tokens per image.
DEFAULT_IMAGE_TOKENS = 4 * 1601


def is_mllama(config: Any) -> bool:
    return hfconfig.text_config(config).model_type in MODEL_TYPES


def _head_dim(cfg: Any) -> int:
    """D, from ``config.head_dim`` when set; transformers' Mllama sizes its attention by hidden_size //
    num_attention_heads and fails on configs that say otherwise, so those are refused here too."""
    d, split = hfconfig.head_dim(cfg), cfg.hidden_size // cfg.num_attention_heads
    if d != split:
        raise UnsupportedError(f"this Mllama config sets head_dim {d}, but MllamaForCausalLM's attention uses "
                               f"hidden_size // num_attention_heads = {split} (and fails on it); "
                               "remove head_dim from the config or set it to hidden_size // num_attention_heads")
    return d


def _cross_layers(cfg: Any) -> tuple[int, ...]:
    return tuple(sorted(int(i) for i in (cfg.cross_attention_layers or ())))


def mllama_cache_spec(config: Any, *, max_seq_len: int, batch_size: int, dtype: torch.dtype,
                      image_tokens: int) -> CacheSpec:
    """FULL layers for self-attention, CROSS layers of ``image_tokens`` slots, plus cross.mask/cross.active."""
    cfg = hfconfig.text_config(config)
    if not (isinstance(image_tokens, int) and image_tokens >= 1):
        raise UsageError(f"image_tokens must be an int >= 1 (the N of cross_attention_states [B, N, dim]), "
                         f"got {image_tokens!r}")
    hfconfig.check_max_seq_len(cfg, max_seq_len)
    head_dim, n_kv = _head_dim(cfg), hfconfig.kv_heads(cfg)
    cross = _cross_layers(cfg)
    layers = tuple(
        LayerSpec(LayerKind.CROSS, n_kv, head_dim, image_tokens) if i in cross
        else LayerSpec(LayerKind.FULL, n_kv, head_dim, max_seq_len)
        for i in range(cfg.num_hidden_layers)
    )
    name = str(dtype).removeprefix("torch.")
    extra = cross_kind.extra_buffers(batch_size, image_tokens, name)  # cross.mask [B, N], cross.active [1]
    return CacheSpec(layers=layers, batch_size=batch_size, max_seq_len=max_seq_len, dtype=name, extra=extra)


def cross_mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cross-attention mask from a 0/1 mask ``[B, T, N]`` (1 = attend).

    Returns ``bias [B, 1, T, N]`` (0 = attend, dtype min = masked; a text row that sees no image token
    is all 0) and ``row_ok [B, T, 1]`` (0 for such rows: their cross-attention MLP output is dropped).
    """
    lowest = torch.finfo(dtype).min
    bias = torch.where(mask > 0, 0.0, lowest).to(dtype)  # [B, T, N]
    row_ok = (bias != lowest).any(dim=-1, keepdim=True).to(dtype)  # [B, T, 1]
    return (bias * row_ok).unsqueeze(1), row_ok


def hf_cross_kwargs(mask: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The kwargs HF's MllamaForCausalLM takes for a 0/1 mask ``[B, T, N]``: ``cross_attention_mask``
    ``[B, 1, T, N]`` (additive) and ``full_text_row_masked_out_mask`` ``[B, 1, T, 1]``."""
    bias, row_ok = cross_mask_bias(mask, dtype)
    return {"cross_attention_mask": bias, "full_text_row_masked_out_mask": row_ok.unsqueeze(1)}


class _CrossLayer(nn.Module):
    def __init__(self, a: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.attn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
        self.wq = nn.Linear(a.dim, q, bias=False, dtype=dtype)
        self.wkv = nn.Linear(a.dim, 2 * kv, bias=False, dtype=dtype)  # k and v of the image, fused
        self.q_norm = nn.Parameter(torch.empty(a.head_dim, dtype=dtype))
        self.k_norm = nn.Parameter(torch.empty(a.head_dim, dtype=dtype))
        self.wo = nn.Linear(q, a.dim, bias=False, dtype=dtype)
        self.attn_gate = nn.Parameter(torch.empty(1, dtype=dtype))  # output scaled by tanh(gate)
        self.ffn_norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
        self.w13 = nn.Linear(a.dim, 2 * a.hidden_dim, bias=False, dtype=dtype)
        self.w2 = nn.Linear(a.hidden_dim, a.dim, bias=False, dtype=dtype)
        self.mlp_gate = nn.Parameter(torch.empty(1, dtype=dtype))


def _image_kv(a: LlamaArgs, layer: _CrossLayer, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """image [B, N, dim] -> K (k-normed), V: [B, H_kv, N, D] each."""
    b, n, _ = image.shape
    k, v = layer.wkv(image).chunk(2, dim=-1)
    k = _rms_norm(k.view(b, n, a.n_kv_heads, a.head_dim).transpose(1, 2), layer.k_norm, a.norm_eps)
    return k, v.view(b, n, a.n_kv_heads, a.head_dim).transpose(1, 2)


def _cross_block(a: LlamaArgs, layer: _CrossLayer, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 bias: torch.Tensor, row_ok: torch.Tensor) -> torch.Tensor:
    """x [B, T, dim] attends to the image K/V [B, H_kv, N, D] with bias [B, 1, T, N]; tanh-gated residuals."""
    b, t, _ = x.shape
    h = _rms_norm(x, layer.attn_norm, a.norm_eps)
    q = layer.wq(h).view(b, t, a.n_heads, a.head_dim).transpose(1, 2)  # [B, H, T, D]
    q = _rms_norm(q, layer.q_norm, a.norm_eps)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)  # [B, H, T, D]
    x = x + layer.attn_gate.tanh() * layer.wo(o.transpose(1, 2).reshape(b, t, -1))
    h = swiglu(layer, _rms_norm(x, layer.ffn_norm, a.norm_eps)) * row_ok  # rows that see no image: 0
    return x + layer.mlp_gate.tanh() * h


class MllamaDecoder(nn.Module):
    """Llama 3.2 Vision text decoder as a Decoder with three programs (module docstring)."""

    last_logits = False  # True on a program's copy (ProgramSpec.logits == "last"): the head on the last row only
    fused_attention = True  # self-attention layers go through llama.cached_attention (models/fused.py)

    def __init__(self, a: LlamaArgs, cross: tuple[int, ...], spec: CacheSpec, embed_rows: int,
                 rope_cos: torch.Tensor, rope_sin: torch.Tensor):
        super().__init__()
        dtype = spec.torch_dtype
        self.args = a
        self.cross = cross
        self.cache_spec = spec
        n = spec.layers[cross[0]].max_len if cross else 0
        self.image_tokens = n
        self.tok_embeddings = nn.Embedding(embed_rows, a.dim, dtype=dtype)
        self.layers = nn.ModuleList(
            _CrossLayer(a, dtype) if i in cross else _Layer(a, dtype) for i in range(a.n_layers)
        )
        self.norm = nn.Parameter(torch.empty(a.dim, dtype=dtype))
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("rope_cos", rope_cos, persistent=True)  # [S_max, D]
        self.register_buffer("rope_sin", rope_sin, persistent=True)
        self.programs = (
            ProgramSpec("prefill"),
            ProgramSpec("decode", single_token=True),
            ProgramSpec("prefill_image", method="forward_image", once=True, inputs=(
                InputSpec("cross_attention_states", ("B", n, a.dim), spec.dtype,
                          doc="projected image features (the vision tower's output)"),
                InputSpec("cross_attention_mask", ("B", "T", n), spec.dtype, default=1.0, binary=True,
                          doc="1 where a text token sees an image token (default: all 1)"),
            )),
        )

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        """Text tokens; cross layers read the cached image K/V when ``cross.active`` (else skipped)."""
        return self._run(tokens, input_pos, None, None, state)

    def forward_image(self, tokens: torch.Tensor, input_pos: torch.Tensor, cross_attention_states: torch.Tensor,
                      cross_attention_mask: torch.Tensor, *state: torch.Tensor) -> torch.Tensor:
        """Text tokens with an image: fills the cross-attention caches, cross.mask and cross.active."""
        return self._run(tokens, input_pos, cross_attention_states, cross_attention_mask, state)

    def _run(self, tokens: torch.Tensor, input_pos: torch.Tensor, image: torch.Tensor | None,
             image_mask: torch.Tensor | None, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        a = self.args
        b, t = tokens.shape
        dtype = self.cache_spec.torch_dtype
        mask_row, active = cross_kind.shared_state(self.cache_spec, state)  # [B, N], [1]
        x = self.tok_embeddings(tokens)  # [B, T, dim]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, D]
        causal = torch.arange(self.cache_spec.max_seq_len, device=tokens.device)[None, :] <= input_pos[:, None]
        m = image_mask if image is not None else mask_row[:, None, :].expand(b, t, self.image_tokens)  # [B, T, N]
        bias, row_ok = cross_mask_bias(m, dtype)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = state[2 * i], state[2 * i + 1]
            if i not in self.cross:
                x = self_attention_block(a, layer, x, input_pos, cos, sin, causal, LayerState(k_cache, v_cache))
            elif image is not None:
                k, v = _image_kv(a, layer, image)
                # [B, H_kv, N, D], read by every later token
                kind_of(self.cache_spec.layers[i]).write(k_cache, v_cache, input_pos, k, v)
                x = _cross_block(a, layer, x, k, v, bias, row_ok)
            else:  # skipped while no image is cached, exactly as eager skips the layer
                x = torch.where(active.bool(), _cross_block(a, layer, x, k_cache, v_cache, bias, row_ok), x)
        if image is not None:
            mask_row.copy_(m[:, -1])  # later tokens see what the last prompt token saw
            active.fill_(1)
        if self.last_logits:
            x = x[:, -1:]  # [B, 1, dim]
        return self.output(_rms_norm(x, self.norm, a.norm_eps))  # [B, T or 1, V]

    @classmethod
    def from_hf(cls, model: nn.Module, spec: CacheSpec) -> MllamaDecoder:
        """Copy (and fuse) the weights of an HF ``MllamaForCausalLM``."""
        cfg = hfconfig.text_config(model.config)
        if not is_mllama(cfg) or getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedError(f"MllamaDecoder reproduces MllamaForCausalLM (silu); got {cfg.model_type!r}")
        hf = model.model
        a = LlamaArgs(dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
                      n_kv_heads=hfconfig.kv_heads(cfg), head_dim=_head_dim(cfg),
                      hidden_dim=cfg.intermediate_size, vocab_size=cfg.vocab_size, norm_eps=cfg.rms_norm_eps,
                      qkv_bias=False, tie_embeddings=False)
        cos, sin = _rope_table(hf.rotary_emb, spec.max_seq_len, spec.torch_dtype)
        dec = cls(a, _cross_layers(cfg), spec, hf.embed_tokens.weight.shape[0], cos, sin)
        dt = spec.torch_dtype
        with torch.no_grad():
            dec.tok_embeddings.weight.copy_(hf.embed_tokens.weight.to(dt))
            dec.output.weight.copy_(model.lm_head.weight.to(dt))
            dec.norm.copy_(hf.norm.weight.to(dt))
            for i, (mine, theirs) in enumerate(zip(dec.layers, hf.layers, strict=True)):
                if i not in dec.cross:
                    copy_hf_layer(mine, theirs, dt)
                    continue
                att = theirs.cross_attn
                mine.attn_norm.copy_(theirs.input_layernorm.weight.to(dt))
                mine.wq.weight.copy_(att.q_proj.weight.to(dt))
                mine.wkv.weight.copy_(torch.cat([att.k_proj.weight, att.v_proj.weight]).to(dt))
                mine.q_norm.copy_(att.q_norm.weight.to(dt))
                mine.k_norm.copy_(att.k_norm.weight.to(dt))
                mine.wo.weight.copy_(att.o_proj.weight.to(dt))
                mine.attn_gate.copy_(theirs.cross_attn_attn_gate.to(dt))
                mine.ffn_norm.copy_(theirs.post_attention_layernorm.weight.to(dt))
                copy_hf_mlp(mine, theirs.mlp, dt)
                mine.mlp_gate.copy_(theirs.cross_attn_mlp_gate.to(dt))
        return dec.eval().requires_grad_(False)


def _build(model: nn.Module, *, max_seq_len: int, batch_size: int, image_tokens: int | None = None) -> MllamaDecoder:
    spec = mllama_cache_spec(model.config, max_seq_len=max_seq_len, batch_size=batch_size,
                             dtype=next(model.parameters()).dtype,
                             image_tokens=DEFAULT_IMAGE_TOKENS if image_tokens is None else image_tokens)
    return MllamaDecoder.from_hf(model, spec)


# The Llama 3.2 Vision text decoder: asked first, the only family that takes image_tokens.
FAMILY = Family("mllama", MODEL_TYPES, is_mllama, _build, priority=10, vision=True)
