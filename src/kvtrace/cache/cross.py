"""LayerKind.CROSS: cross-attention to a fixed number N of encoder/image tokens, filled once.

    k, v: [B, H_kv, N, D]   every slot written by the image prefill, read by every later token
    cross.mask   [B, N]     shared by the cross layers: 1 = attend; the mask row later tokens use
    cross.active [1]        1 once image K/V are cached; 0 = text only (cross layers are skipped)

Only a prefill program that runs once (``ProgramSpec.once``, e.g. ``prefill_image``) writes it, all N
slots at once; decode only reads it. Its slots are not indexed by text position, so rewinding the text
leaves them as they are. In a transformers DynamicCache a cross layer holds the N_c image tokens
``[B, H_kv, N_c, D]`` (label ``"cross-filled"``) or nothing (``"cross-empty"``: uninitialized, empty, or
not even created), as eager leaves it in a text-only run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from kvtrace._errors import UsageError
from kvtrace.cache.kinds import IMAGE, KindOps
from kvtrace.spec.cache import BufferSpec, CacheSpec, LayerKind

__all__ = ["ACTIVE", "CROSS_EMPTY", "CROSS_FILLED", "MASK", "OPS", "CrossOps", "check_hf_layers",
           "extra_buffers", "holds_image", "shared_state"]

CROSS_FILLED = "cross-filled"  # HF layer-pattern label: a cross layer holding the K/V of N_c image tokens
CROSS_EMPTY = "cross-empty"  # HF layer-pattern label: a cross layer without image tokens
MASK = "cross.mask"  # [B, N] 1 = attend
ACTIVE = "cross.active"  # [1] int64, 1 once image K/V are cached


def extra_buffers(batch: int, image_tokens: int, dtype: str) -> tuple[BufferSpec, BufferSpec]:
    """The state the cross layers share, after every layer's K/V: ``cross.mask`` and ``cross.active``."""
    return (BufferSpec(MASK, (batch, image_tokens), dtype, 0.0),  # [B, N] 1 = attend
            BufferSpec(ACTIVE, (1,), "int64", 0))  # 1 once image K/V are cached


def shared_state(spec: CacheSpec, state: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cross.mask [B, N], cross.active [1])`` of ``state`` (laid out as ``spec.buffers()``), by name."""
    names = [b.name for b in spec.buffers()]
    if MASK not in names or ACTIVE not in names:
        raise UsageError(f"a cache with cross-attention layers declares {MASK} and {ACTIVE} among its extra "
                         f"buffers; this one has {names[2 * len(spec.layers):]}. Build it with mllama_cache_spec")
    return state[names.index(MASK)], state[names.index(ACTIVE)]


class CrossOps(KindOps):
    kind = LayerKind.CROSS
    written_by_decode = False
    hf_labels = (CROSS_FILLED, CROSS_EMPTY)

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """All N slots at once: k, v [B, H_kv, N, D] (``input_pos`` does not index them)."""
        k_cache.copy_(k)
        v_cache.copy_(v)

    def valid(self, k: torch.Tensor, v: torch.Tensor, position: int,
              prefilled: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All N slots once the image prefill ran (``prefilled``), else None (the layer holds nothing)."""
        return (k, v) if prefilled else None

    def hf_label(self, cache: Any, i: int) -> str:
        return CROSS_FILLED if holds_image(cache, i) else CROSS_EMPTY

    def hf_held(self, label: str, has_past: bool) -> bool:
        """A program takes the image K/V the layer holds, whatever the text cache holds."""
        return label == CROSS_FILLED

    def hf_written(self, label: str, image: bool) -> bool:
        """Returned only when the call brings new image features, which eager appends ([B, H_kv, N_c + N, D])."""
        return image

    def hf_length(self, label: str) -> str | None:
        return IMAGE if label == CROSS_FILLED else None


def holds_image(cache: Any, i: int) -> bool:
    """Whether HF cache layer ``i`` holds image K/V: HF's own test (``_has_cached_cross_attention_states``)."""
    if cache is None or i >= len(cache.layers):
        return False
    layer = cache.layers[i]
    return bool(layer.is_initialized and layer.keys.numel() > 0)


def check_hf_layers(cache: Any, cross: Collection[int]) -> None:
    """Cross layers hold image tokens all together (with one length) or not at all, as eager leaves them."""
    filled = [i for i in sorted(cross) if holds_image(cache, i)]
    if not filled:
        return
    empty = [i for i in sorted(cross) if i not in filled]
    if empty:
        raise UsageError(
            f"DynamicCache cross-attention layers {filled} hold image tokens but {empty} do not; expected all "
            "or none. Pass a fresh DynamicCache() or the one returned by the previous call."
        )
    lengths = {cache.layers[i].keys.shape[-2] for i in filled}
    if len(lengths) != 1:
        raise UsageError(
            f"DynamicCache cross-attention layers hold different numbers of image tokens {sorted(lengths)}; "
            "expected one"
        )


OPS = CrossOps()
