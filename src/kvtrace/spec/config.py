"""Reading HF model configs: the few facts about a decoder config every layer above derives from.

Duck-typed over ``transformers.PretrainedConfig`` objects (nothing here imports transformers): a
composite config (e.g. a vision-language model) is read through its decoder's text config.

    text_config(config)        the decoder's config (``get_text_config(decoder=True)``), else config itself
    head_dim(cfg)              ``cfg.head_dim`` when set, else hidden_size // num_attention_heads
    kv_heads(cfg)              ``cfg.num_key_value_heads`` when set (and a field of its config class), else
                               num_attention_heads (no GQA)
    rope_type(cfg)             "default", "llama3", "longrope", ... (transformers 5 and 4.x spellings)
    max_positions(cfg)         ``max_position_embeddings``, or None when the config declares none
    check_max_seq_len(...)     UsageError when a cache would outgrow the model's positions
    sliding_window(cfg)        the attention window in tokens, or None when the model attends to everything
    layer_types(cfg)           one "full_attention" / "sliding_attention" / ... per layer
"""

from __future__ import annotations

from typing import Any

from kvtrace._errors import UsageError

__all__ = ["check_max_seq_len", "head_dim", "kv_heads", "layer_types", "max_positions", "rope_type",
           "sliding_window", "text_config"]

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def text_config(config: Any) -> Any:
    """The decoder's config: ``config.get_text_config(decoder=True)``, or ``config`` for plain objects."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def head_dim(config: Any) -> int:
    """Per-head width D of the attention (and of every K/V cache tensor ``[B, H_kv, S, D]``)."""
    cfg = text_config(config)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def kv_heads(config: Any) -> int:
    """H_kv: key/value heads (fewer than the query heads under grouped-query attention)."""
    cfg = text_config(config)
    fields = getattr(type(cfg), "__dataclass_fields__", None)  # transformers 5 configs: declared fields
    declared = fields is None or "num_key_value_heads" in fields  # GPT-NeoX's would be a stray kwarg
    return (getattr(cfg, "num_key_value_heads", None) if declared else None) or cfg.num_attention_heads


def rope_type(config: Any) -> str:
    """The config's RoPE variant: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x), else "default"."""
    cfg = text_config(config)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"


def max_positions(config: Any) -> int | None:
    """``max_position_embeddings``: the positions the model was built for; None when it declares none."""
    return getattr(text_config(config), "max_position_embeddings", None) or None


def check_max_seq_len(config: Any, max_seq_len: int) -> None:
    """UsageError when ``max_seq_len`` exceeds the model's ``max_position_embeddings``."""
    limit = max_positions(config)
    if limit and max_seq_len > limit:
        raise UsageError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings {limit}")


def sliding_window(config: Any) -> int | None:
    """The sliding-attention window in tokens, or None when the config attends to every past token
    (no ``sliding_window``, or ``use_sliding_window=False`` as Qwen2 configs say)."""
    cfg = text_config(config)
    window = getattr(cfg, "sliding_window", None)
    return window if window and getattr(cfg, "use_sliding_window", True) else None


def layer_types(config: Any) -> tuple[str, ...]:
    """One attention type per layer: the config's ``layer_types`` (transformers 5) when it has them, else
    every layer "sliding_attention" when a window is in use, "full_attention" otherwise."""
    cfg = text_config(config)
    declared = getattr(cfg, "layer_types", None)
    if declared:
        return tuple(str(t) for t in declared)
    kind = SLIDING_ATTENTION if sliding_window(cfg) else FULL_ATTENTION
    return (kind,) * cfg.num_hidden_layers
