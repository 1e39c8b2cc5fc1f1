"""CacheSpec: the declared shape, size and initial state of a decoder's KV cache.

Everything that allocates, exports, checks or reports a cache derives from a CacheSpec;
nothing guesses a cache's shape from tensors at run time.

Invariants (checked in ``__post_init__``):
  * every layer's ``max_len`` is ``max_seq_len`` for FULL layers, ``window`` for SLIDING layers,
    and the fixed number of encoder/image tokens for CROSS layers;
  * buffers are named uniquely and listed in program-signature order (``buffers()``);
  * initial values are plain numbers; a buffer is (re)set by ``fill_(init)``;
  * ``kv_dtype`` None: K/V are held in ``dtype``; ``"int8"``: each layer holds K, V as int8 plus one
    float16 scale per token and KV head (``k_scale``/``v_scale`` ``[B, H_kv, S, 1]``, symmetric, no zero
    point; see ``cache/int8.py``), all starting at 0 (dequantized: 0). Omitted from the manifest when None.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch

from kvtrace._errors import ArtifactError, UsageError

__all__ = ["KV_DTYPES", "SCALE_DTYPE", "BufferSpec", "CacheSpec", "LayerKind", "LayerSpec", "LayerState"]

LAYOUT = "[B, H_kv, S, D]"
KV_DTYPES = ("int8",)  # quantized K/V a CacheSpec can declare (kv_dtype); None: K/V in the cache's dtype
SCALE_DTYPE = "float16"  # an int8 cache's per-token, per-head scales [B, H_kv, S, 1] (as llama.cpp's q8_0)


class LayerKind(enum.StrEnum):
    FULL = "full"  # self-attention over every past token, grows up to max_seq_len
    SLIDING = "sliding"  # self-attention over the last `window` tokens
    CROSS = "cross"  # cross-attention to a fixed number of encoder/image tokens, filled once at prefill


@dataclass(frozen=True)
class BufferSpec:
    """One tensor of cache state as it appears in a program signature."""

    name: str  # e.g. "layers.3.k"
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    init: float = 0.0  # the declared initial value; reset() refills with it

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"a state buffer needs a non-empty name, got {self.name!r}")
        object.__setattr__(self, "shape", tuple(self.shape))
        if not all(_is_int(n) and n >= 0 for n in self.shape):
            raise UsageError(f"buffer {self.name}: shape must hold non-negative ints, got {self.shape}")
        _check_dtype(self.dtype, f"buffer {self.name}")
        _check_init(self.init, f"buffer {self.name}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.full(self.shape, self.init, dtype=self.torch_dtype, device=device)


@dataclass(frozen=True)
class LayerSpec:
    kind: LayerKind
    n_kv_heads: int
    head_dim: int
    max_len: int  # S in [B, H_kv, S, D]
    window: int | None = None  # only for SLIDING

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", LayerKind(self.kind))  # "full" -> LayerKind.FULL
        except ValueError as e:
            raise UsageError(f"unknown layer kind {self.kind!r}; expected one of {[k.value for k in LayerKind]}") from e
        for name in ("n_kv_heads", "head_dim", "max_len"):
            v = getattr(self, name)
            if not (_is_int(v) and v >= 1):
                raise UsageError(f"LayerSpec.{name} must be an int >= 1, got {v!r}")
        if self.window is not None and not (_is_int(self.window) and self.window >= 1):
            raise UsageError(f"LayerSpec.window must be None or an int >= 1, got {self.window!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_dtype(name: Any, what: str) -> None:
    if not isinstance(name, str) or not isinstance(getattr(torch, name, None), torch.dtype):
        raise UsageError(f"{what}: dtype must name a torch dtype without 'torch.' (e.g. 'float32'), got {name!r}")


def _check_init(v: Any, what: str) -> None:
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
        raise UsageError(f"{what}: the initial value must be a finite plain number, got {v!r}")


class LayerState(NamedTuple):
    """One layer's state tensors, taken from the flat state by ``CacheSpec.layer_state``."""

    k: torch.Tensor  # [B, H_kv, S, D] (int8 when the spec's kv_dtype is "int8")
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # int8 caches: [B, H_kv, S, 1] float16, one scale per slot and head
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of an int8 layer, None for a layer holding K/V in the cache's dtype."""
        return None if self.k_scale is None or self.v_scale is None else (self.k_scale, self.v_scale)


@dataclass(frozen=True)
class CacheSpec:
    """Declared KV cache of one decoder.

    ``layers[i]`` describes decoder layer i. Each layer owns a K and a V buffer of shape
    ``[batch_size, n_kv_heads, max_len, head_dim]`` (``LAYOUT``). ``extra`` lists further state
    buffers (e.g. a position counter or a sentinel) with their declared initial values. ``kv_dtype``
    ``"int8"``: K and V are int8 and each layer also owns ``k_scale``/``v_scale`` ``[B, H_kv, S, 1]``
    (``SCALE_DTYPE``); decoders take a layer's tensors with ``layer_state``.
    """

    layers: tuple[LayerSpec, ...]
    batch_size: int
    max_seq_len: int
    dtype: str
    layout: str = LAYOUT
    kv_init: float = 0.0
    extra: tuple[BufferSpec, ...] = field(default_factory=tuple)
    kv_dtype: str | None = None  # None: K/V in `dtype`; "int8": quantized, with per-token, per-head scales

    def __post_init__(self) -> None:
        if not (_is_int(self.batch_size) and _is_int(self.max_seq_len)) or self.batch_size < 1 or self.max_seq_len < 1:
            raise UsageError(
                f"CacheSpec needs batch_size >= 1 and max_seq_len >= 1, got {self.batch_size} and {self.max_seq_len}"
            )
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "extra", tuple(self.extra))
        if not all(isinstance(x, LayerSpec) for x in self.layers):
            raise UsageError(f"CacheSpec.layers must hold LayerSpecs, got {[type(x).__name__ for x in self.layers]}")
        if not all(isinstance(x, BufferSpec) for x in self.extra):
            raise UsageError(f"CacheSpec.extra must hold BufferSpecs, got {[type(x).__name__ for x in self.extra]}")
        _check_dtype(self.dtype, "CacheSpec")
        _check_init(self.kv_init, "CacheSpec.kv_init")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise UsageError(f"CacheSpec.kv_dtype must be None (K/V in {self.dtype}) or one of {list(KV_DTYPES)}, "
                             f"got {self.kv_dtype!r}")
        if self.kv_dtype is not None and self.kv_init != 0.0:
            raise UsageError(f"an {self.kv_dtype} cache starts at 0 (values and scales); got kv_init={self.kv_init}. "
                             "Use kv_init=0.0 or kv_dtype=None")
        if self.layout != LAYOUT:
            raise UsageError(f"CacheSpec layout must be {LAYOUT!r}, got {self.layout!r}")
        for i, layer in enumerate(self.layers):
            if layer.kind is LayerKind.FULL and layer.max_len != self.max_seq_len:
                raise UsageError(
                    f"layer {i}: a full-attention layer holds max_seq_len={self.max_seq_len} positions, "
                    f"but its spec says max_len={layer.max_len}"
                )
            if layer.kind is LayerKind.SLIDING and layer.window != layer.max_len:
                raise UsageError(f"layer {i}: sliding window {layer.window} != max_len {layer.max_len}")
        names = [b.name for b in self.buffers()]
        if len(set(names)) != len(names):
            raise UsageError(f"CacheSpec buffer names must be unique, got {names}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def per_layer(self) -> int:
        """State tensors per layer: 2 (k, v), or 4 for an int8 cache (k, v, k_scale, v_scale)."""
        return 2 if self.kv_dtype is None else 4

    def buffers(self) -> tuple[BufferSpec, ...]:
        """All state tensors in program-signature order: k0, v0, k1, v1, ..., then extras; an int8 cache
        k0, v0, k0_scale, v0_scale, k1, ... (``layers.{i}.k``, ``.v``, ``.k_scale``, ``.v_scale``)."""
        out: list[BufferSpec] = []
        for i, layer in enumerate(self.layers):
            shape = (self.batch_size, layer.n_kv_heads, layer.max_len, layer.head_dim)  # [B, H_kv, S, D]
            if self.kv_dtype is None:
                out.append(BufferSpec(f"layers.{i}.k", shape, self.dtype, self.kv_init))
                out.append(BufferSpec(f"layers.{i}.v", shape, self.dtype, self.kv_init))
                continue
            scale = (*shape[:3], 1)  # [B, H_kv, S, 1]: one scale per slot and KV head
            out.append(BufferSpec(f"layers.{i}.k", shape, self.kv_dtype, 0))
            out.append(BufferSpec(f"layers.{i}.v", shape, self.kv_dtype, 0))
            out.append(BufferSpec(f"layers.{i}.k_scale", scale, SCALE_DTYPE, 0.0))
            out.append(BufferSpec(f"layers.{i}.v_scale", scale, SCALE_DTYPE, 0.0))
        out.extend(self.extra)
        return tuple(out)

    def layer_state(self, state: Sequence[torch.Tensor], i: int) -> LayerState:
        """Layer ``i``'s tensors of ``state`` (laid out as ``buffers()``): k, v and, int8, their scales."""
        n = self.per_layer
        return LayerState(*state[n * i : n * i + n])

    def allocate(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Fresh state tensors holding the declared initial values."""
        return [b.allocate(device) for b in self.buffers()]

    def reset_(self, state: list[torch.Tensor]) -> None:
        """Refill ``state`` in place with the declared initial values."""
        for b, t in zip(self.buffers(), state, strict=True):
            t.fill_(b.init)

    def nbytes(self) -> int:
        return sum(
            torch.Size(b.shape).numel() * torch.empty((), dtype=b.torch_dtype).element_size()
            for b in self.buffers()
        )

    # --- (de)serialisation: plain JSON, no pickles -------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.kv_dtype is None:
            del d["kv_dtype"]  # the manifest of a cache in its model's dtype reads as before int8 caches existed
        d["layers"] = [{**asdict(layer), "kind": layer.kind.value} for layer in self.layers]
        d["extra"] = [{**asdict(b), "shape": list(b.shape)} for b in self.extra]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheSpec:
        try:
            layers = tuple(LayerSpec(**{**x, "kind": LayerKind(x["kind"])}) for x in d["layers"])
            extra = tuple(BufferSpec(**{**b, "shape": tuple(b["shape"])}) for b in d.get("extra", ()))
            rest = {k: v for k, v in d.items() if k not in ("layers", "extra")}
            return cls(layers=layers, extra=extra, **rest)
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"cache spec in manifest is malformed ({e}); re-export the artifact") from e

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def describe(self) -> str:
        kinds = {}
        for layer in self.layers:
            kinds[layer.kind.value] = kinds.get(layer.kind.value, 0) + 1
        k = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        kv = self.dtype if self.kv_dtype is None else f"{self.kv_dtype} K/V with {SCALE_DTYPE} scales ({self.dtype} model)"
        return (
            f"{len(self.layers)} layers ({k}), batch {self.batch_size}, max_seq_len {self.max_seq_len}, "
            f"{kv}, {self.layout}, {self.nbytes() / 2**20:.1f} MiB"
        )
