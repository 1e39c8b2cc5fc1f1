"""LlamaArgs: what a Llama-family HF config says about the fast decoder (``models/llama.py``), read once.

Every family quirk LlamaDecoder reproduces is a field here, fixed when the decoder is built (a trace-time
constant, never a runtime branch); per-layer quirks are tuples of layer indices::

    family   quirk (HF config)                                  LlamaArgs
    qwen2    q/k/v biases                                       qkv_bias (o_bias False)
    qwen3    per-head q/k RMSNorm before RoPE (q_norm, k_norm)  qk_norm="head"
    smollm3  layers without RoPE (no_rope_layers[i] == 0)       no_rope
    granite  embedding/residual/attention multipliers, logits   embedding_multiplier, residual_multiplier,
             divided by logits_scaling                          attention_scale, logits_scaling
    olmo2    norms on the sublayer outputs (no pre-norms), q/k  post_norms, qk_norm="proj",
             RMSNorm over the whole projection, norms that      norm_upcast
             scale in fp32 before casting back
    phi3     fused qkv_proj / gate_up_proj (weights only);      (the RoPE table is rotary_dim wide)
             partial_rotary_factor; longrope (every position    rope_switch (a second, long table)
             of a call uses the long factors once its last
             position + 1 exceeds original_max_position_...)

``supports(config)`` is strict: anything else (other activations, MLP biases, RoPE whose frequencies depend
on the sequence length, layer types other than full / sliding attention, a family's unknown flags) is
refused, so the config falls through to the general HF decoder.

May import: ``spec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtrace.spec import config as hfconfig

__all__ = ["LENGTH_DEPENDENT_ROPE", "MODEL_TYPES", "LlamaArgs", "read_args", "supports"]

MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "smollm3", "granite", "olmo2", "phi3")
# RoPE variants whose frequencies depend on the whole sequence's length, not only on a position: HF's
# longrope switches every position to the long factors once the sequence passes
# original_max_position_embeddings, dynamic NTK rescales past max_position_embeddings. A table indexed by
# input_pos cannot express that; such models go through HFDecoder, which traces HF's own rotary code. Except
# Phi-3's longrope (the longrope checkpoints): two tables and a per-call switch on max(input_pos) reproduce it.
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")
_GRANITE = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
_LAYER_TYPES = (hfconfig.FULL_ATTENTION, hfconfig.SLIDING_ATTENTION)


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
    o_bias: bool = False
    qk_norm: str | None = None  # "head": RMSNorm [D] per head (Qwen3); "proj": [H * D] over q / k (OLMo2)
    post_norms: bool = False  # sublayer norms on the outputs, before the residual add (OLMo2), not the inputs
    norm_upcast: bool = False  # RMSNorm as (w * x_fp32).to(dtype) (OLMo2), not w * x_fp32.to(dtype)
    no_rope: tuple[int, ...] = ()  # layers that apply no RoPE (SmolLM3)
    embedding_multiplier: float = 1.0  # Granite: the embeddings scaled by this
    residual_multiplier: float = 1.0  # Granite: attention and MLP outputs scaled by this before the add
    attention_scale: float | None = None  # SDPA scale; None: 1/sqrt(head_dim) (Granite: attention_multiplier)
    logits_scaling: float = 1.0  # Granite: logits divided by this
    rope_switch: int | None = None  # longrope (Phi-3): a call whose last position + 1 exceeds this uses long factors


def _partial_rotary_factor(cfg: Any) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(factor if factor is not None else getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)


def _no_rope_flags(cfg: Any) -> list[int]:
    flags = list(getattr(cfg, "no_rope_layers", None) or [1] * cfg.num_hidden_layers)
    return flags if len(flags) == cfg.num_hidden_layers and set(flags) <= {0, 1} else []


def _longrope_switch(cfg: Any) -> int | None:
    """Phi-3's longrope switch point (rope_parameters' original_max_position_embeddings), else None."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    switch = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    return int(switch) if switch else None


def supports(config: Any) -> bool:
    """True when the HF config is a Llama-family decoder this decoder reproduces exactly (module docstring)."""
    cfg = hfconfig.text_config(config)
    family = cfg.model_type
    if family not in MODEL_TYPES or getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return False
    rope = hfconfig.rope_type(cfg)
    if rope in LENGTH_DEPENDENT_ROPE and not (rope == "longrope" and family == "phi3" and _longrope_switch(cfg)):
        return False
    if _partial_rotary_factor(cfg) != 1.0 and family != "phi3":  # only Phi-3's apply_rotary_pos_emb slices
        return False
    if any(t not in _LAYER_TYPES for t in hfconfig.layer_types(cfg)):
        return False
    if family == "smollm3" and not _no_rope_flags(cfg):
        return False
    if family != "smollm3" and getattr(cfg, "no_rope_layers", None):
        return False
    if family != "granite" and any(getattr(cfg, m, 1.0) != 1.0 for m in _GRANITE):
        return False  # a multiplier this family's HF code would not apply either: a config we don't know
    return True


def read_args(config: Any, *, qkv_bias: bool, o_bias: bool, tie_embeddings: bool) -> LlamaArgs:
    """The LlamaArgs of a config ``supports`` accepts; biases and tying come from the weights (``from_hf``)."""
    cfg = hfconfig.text_config(config)
    family = cfg.model_type
    granite = family == "granite"
    return LlamaArgs(
        dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
        n_kv_heads=hfconfig.kv_heads(cfg), head_dim=hfconfig.head_dim(cfg), hidden_dim=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, norm_eps=cfg.rms_norm_eps, qkv_bias=qkv_bias, o_bias=o_bias,
        tie_embeddings=tie_embeddings,
        qk_norm={"qwen3": "head", "olmo2": "proj"}.get(family),
        post_norms=family == "olmo2", norm_upcast=family == "olmo2",
        no_rope=tuple(i for i, f in enumerate(_no_rope_flags(cfg)) if not f) if family == "smollm3" else (),
        embedding_multiplier=float(cfg.embedding_multiplier) if granite else 1.0,
        residual_multiplier=float(cfg.residual_multiplier) if granite else 1.0,
        attention_scale=float(cfg.attention_multiplier) if granite else None,
        logits_scaling=float(cfg.logits_scaling) if granite else 1.0,
        rope_switch=_longrope_switch(cfg) if hfconfig.rope_type(cfg) == "longrope" else None,
    )

