"""kvtrace.jit's capture examples: synthetic tensors (never the caller's) with symbolic lengths.

Example sizes are >= 2 and pairwise distinct (also the sums P + T and N_c + N), so no length is
specialised or unified; an exact capture (a call no earlier program admits) uses the call's own sizes.
A cache with sliding-window layers: HF's sliding code branches on P and T against the window (stored tail
shorter than, exactly or over W - 1; mask offset once P >= W), so a key holds one regime
(``jit_call.sliding_regime``) and its examples (``sliding_lengths``) lie inside it, away from its edges where
it has room, pairwise distinct where the regime allows; the stored tail is a static W - 1 once P >= W.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtrace.cache import hf as hfc
from kvtrace.runtime.jit_call import (
    _SEQ_DIM,
    CallKey,
    _Call,
    _carries_past,
    _held,
    cache_dtype,
    key_regime,
    past_carrier,
    static_slots,
)
from kvtrace.runtime.jit_cross import _CROSS

# Example sizes used for capture: >= 2 and pairwise distinct (also the sums P + T and N_c + N), so no
# length is specialised or unified: T new tokens, P past tokens, N new and N_c cached image tokens.
_T_EX, _P_EX, _N_EX, _NC_EX = 3, 5, 7, 11
# T of an unmasked causal cross-attention program: above N_c + N. HF's sdpa path slices the image keys to
# key[:, :, :T] when there are more of them than tokens; under its top-left causal mask that changes nothing,
# but a compiled slice assumes the example's side of N > T. Captured with T > N, the graph has no slice.
_T_CAUSAL_EX = 19


def examples(call: _Call, exact: bool, n_layers: int, n_kv: int,
             head_dim: int) -> tuple[list[torch.Tensor], list[Any]]:
    """Synthetic example inputs (never the caller's tensors) and their dynamic-shape spec."""
    from torch.export import Dim

    key = call.key
    t_ex = call.tensors[0].shape[1] if exact else _T_EX
    if key.sizes[0] < 2:  # T = 1 is this program's graph, not a length: keep it static (see CallKey.sizes)
        t_ex = key.sizes[0]
    elif key.unmasked_cross == "causal" and not exact:
        t_ex = _T_CAUSAL_EX
    p_ex = call.past_len if exact else (0 if key.cache.fresh else _P_EX)
    if _sized_past(key) and key.sizes[1] < 2:  # P = 0 or 1: likewise static
        p_ex = key.sizes[1]
    nc_ex = call.cross_len if exact else (_NC_EX if any(hfc.length_of(s) == hfc.IMAGE for s in key.layers) else 0)
    if key.static_len is not None:
        p_ex = min(p_ex, max(key.static_len - t_ex, 0))
    if key.regime and not exact:  # inside the key's sliding regime (the call itself is one such pair)
        p_ex, t_ex = sliding_lengths(key) or (call.past_len, call.tensors[0].shape[1])
    n_ex, x_ex = _image_examples(call, exact, nc_ex)
    examples: list[torch.Tensor] = []
    shapes: list[Any] = []
    for name, t in zip(key.inputs, call.tensors, strict=True):
        if name in _CROSS:
            ex, spec = _cross_example(name, t, t_ex, n_ex, x_ex)
            examples.append(ex)
            shapes.append({d: dim for d, dim in spec.items() if ex.shape[d] != 1})  # 1: as below
            continue
        dim = _SEQ_DIM[name] % t.dim()
        size = list(t.shape)
        size[dim] = p_ex + t_ex if name == "attention_mask" else t_ex
        if name in ("position_ids", "cache_position"):
            ex = (torch.arange(t_ex, device=t.device, dtype=t.dtype) + p_ex).expand(size).clone()  # not a view
        elif name == "attention_mask":
            ex = torch.ones(size, dtype=t.dtype, device=t.device)
        else:
            ex = torch.zeros(size, dtype=t.dtype, device=t.device)
        examples.append(ex)
        # 1: a one-token program's T, or an exact capture's size 1 (torch.export specialises it anyway;
        # the program's Contract then admits only that size)
        shapes.append({dim: Dim.AUTO} if size[dim] != 1 else {})
    if key.cache.dynamic:
        for i in _held(key):
            k = call.cache.layers[i].keys  # [B, H_kv, P, D] (self) or [B, H_kv, N_c, D] (cross)
            length = hfc.length_of(key.layers[i])
            s_ex = nc_ex if length == hfc.IMAGE else p_ex
            full_tail = False
            if length == hfc.TAIL:  # the stored tail: min(P, W - 1), a fixed size once the window is full
                s_ex, full_tail = min(p_ex, key.windows[i] - 1), p_ex >= key.windows[i]
            shape = (key.batch, k.shape[1], s_ex, k.shape[3])
            examples += [torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in range(2)]
            shapes += [{2: Dim.AUTO} if shape[2] != 1 and not full_tail else {}] * 2
        if _carries_past(key):  # P of the sliding layers (hfc.build_dynamic's past)
            examples.append(past_carrier(p_ex, key.device))
            shapes.append({1: Dim.AUTO} if p_ex != 1 else {})
    elif key.cache.static:
        dtype = cache_dtype(call)
        for slots in static_slots(key, n_layers):
            shape = (key.batch, n_kv, slots, head_dim)  # [B, H_kv, S_max or W, D]
            examples += [torch.zeros(shape, dtype=dtype, device=key.device),
                         torch.zeros(shape, dtype=dtype, device=key.device),
                         torch.tensor(p_ex, dtype=torch.int64, device=key.device)]
            shapes += [None, None, None]
        if _carries_past(key):  # P of the sliding layers (hfc.build_static's past)
            examples.append(past_carrier(p_ex, key.device))
            shapes.append({1: Dim.AUTO} if p_ex >= 2 else {})
    return examples, shapes


def _sized_past(key: CallKey) -> bool:
    """P is a tensor size of the program (a held DynamicCache layer's S, or the carrier [0, P])."""
    return key.cache.filled or (key.cache.static and _carries_past(key))


def sliding_lengths(key: CallKey, target: tuple[int, int] = (_P_EX, _T_EX),
                    avoid: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """Example (P, T) of a key with sliding layers: in its size classes and ``key.regime``; None if none is.

    Preferred, in order: the symbolic sizes (T, P, P + T; those of size class >= 2) pairwise distinct and
    distinct from the static tails W - 1 (a StaticCache's buffers W) (so none is unified with another by its
    value); other than
    ``avoid`` in each symbolic size (a second capture for comparison); nearest ``target`` (for a full
    regime P nearest W + 3 or beyond: inside it, not on its edge P = W).
    """
    wins = sorted({w for w in key.windows if w})
    # candidates: small sizes, the targets, and sizes around each window's edges (P + T = W - 1, P = W): a
    # handful per window, so a real window (4096) costs no more than a tiny one
    near = {v for w in wins for v in (*range(w - 4, w + 5), *(w - 1 - d for d in range(9)), 2 * w, 2 * w + 1)}
    values = sorted(v for v in {*range(2, 9), 11, *target, *(avoid or ()), *near} if v >= 2)
    t_sym, p_sym = key.sizes[0] >= 2, _sized_past(key) and key.sizes[1] >= 2
    # static sizes a symbolic one must not equal: the stored tails W - 1 (DynamicCache), the buffers W (static)
    fixed = {w if key.cache.static else w - 1 for w in wins}
    ts = values if t_sym else (key.sizes[0],)
    ps = (0,) if key.cache.fresh else values if p_sym else (key.sizes[1],)
    room = key.static_len  # a StaticCache's full layers hold P + T <= max_cache_len
    full = [w for w, r in zip(wins, key.regime.split(","), strict=False) if r == "full"]
    p_target = max(target[0], *(w + 3 for w in full)) if full else target[0]
    ps = sorted({*ps, p_target}) if p_sym else ps

    def score(p: int, t: int) -> tuple[int, int, int]:
        sym = [v for v, s in ((p, p_sym), (t, t_sym)) if s] + ([p + t] if p_sym or t_sym else [])
        clash = len(sym) - len(set(sym)) + sum(v in fixed for v in sym)
        same = 0 if avoid is None else (p_sym and p == avoid[0]) + (t_sym and t == avoid[1])
        return clash, same, abs(p - p_target) + abs(t - target[1])

    found = [(p, t) for p in ps for t in ts if (p, t) != avoid and key_regime(key, t, p) == key.regime
             and (room is None or p + t <= room)]
    return min(found, key=lambda pt: score(*pt)) if found else None


def _image_examples(call: _Call, exact: bool, nc_ex: int) -> tuple[int, int]:
    """Example sizes (N, X): new image tokens, and image tokens the cross layers attend (N_c + N)."""
    given = dict(zip(call.key.inputs, call.tensors, strict=True))
    states = given.get("cross_attention_states")  # [B, N, hidden]
    n_ex = 0 if states is None else states.shape[1] if exact else _N_EX
    mask = given.get("cross_attention_mask")  # [B, 1, T, X]
    if exact and mask is not None:
        return n_ex, mask.shape[3]
    return n_ex, (nc_ex + n_ex) or _N_EX  # a mask no cross layer reads (text-only call) still needs a size


def _cross_example(name: str, t: torch.Tensor, t_ex: int, n_ex: int, x_ex: int) -> tuple[torch.Tensor, dict[int, Any]]:
    """A synthetic cross-attention input like ``t`` and its dynamic dims (see ``_CROSS``)."""
    from torch.export import Dim

    b, kw = t.shape[0], dict(dtype=t.dtype, device=t.device)
    if name == "cross_attention_states":  # [B, N, hidden]
        return torch.zeros(b, n_ex, t.shape[2], **kw), {1: Dim.AUTO}
    if name == "cross_attention_mask":  # [B, 1, T, X], additive: 0 = attend
        return torch.zeros(b, 1, t_ex, x_ex, **kw), {2: Dim.AUTO, 3: Dim.AUTO}
    return torch.ones(b, 1, t_ex, 1, **kw), {2: Dim.AUTO}  # full_text_row_masked_out_mask [B, 1, T, 1]
