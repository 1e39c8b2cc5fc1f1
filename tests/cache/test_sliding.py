"""LayerKind.SLIDING (kvtrace.cache.sliding): a ring of window slots, checked against transformers' own
sliding-window mask and DynamicSlidingWindowLayer."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

from kvtrace._errors import UsageError
from kvtrace.cache import kinds, sliding
from kvtrace.runtime.session import Session
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

B, H, D, W = 1, 2, 3, 8


def _spec(max_seq_len: int = 64) -> CacheSpec:
    """A hybrid cache: FULL, SLIDING (window W), FULL."""
    full = LayerSpec(LayerKind.FULL, H, D, max_seq_len)
    ring = LayerSpec(LayerKind.SLIDING, H, D, W, window=W)
    return CacheSpec(layers=(full, ring, full), batch_size=B, max_seq_len=max_seq_len, dtype="float32")


def _tokens(positions: range) -> torch.Tensor:
    """K (or V) rows whose every value is the token's position: [B, H, T, D]."""
    return torch.tensor(list(positions), dtype=torch.float32).view(1, 1, -1, 1).expand(B, H, -1, D).contiguous()


def _held(ring: torch.Tensor) -> list[int]:
    return [int(x) for x in ring[0, 0, :, 0].tolist()]


def test_a_sliding_layers_buffers_are_window_long_in_a_hybrid_spec():
    spec = _spec()
    assert kinds.kind_of(spec.layers[1]) is sliding.OPS
    bufs = spec.buffers()
    assert [b.shape[2] for b in bufs] == [64, 64, W, W, 64, 64]  # [B, H_kv, S, D]: S = window for the ring
    assert spec.nbytes() == 4 * B * H * D * (2 * 64 + W) * 2  # memory O(window) for the ring


@pytest.mark.parametrize("t", [1, 3, W - 1, W, W + 3, 2 * W + 5])
def test_a_prefill_keeps_its_last_window_tokens_at_pos_mod_window(t):
    k_cache, v_cache = torch.full((B, H, W, D), -1.0), torch.full((B, H, W, D), -1.0)
    sliding.OPS.write(k_cache, v_cache, torch.arange(t), _tokens(range(t)), 2 * _tokens(range(t)))
    expected = [-1] * W
    for p in range(max(0, t - W), t):
        expected[p % W] = p
    assert _held(k_cache) == expected
    assert _held(v_cache) == [2 * p if p >= 0 else -1 for p in expected]


def test_decode_wraps_the_ring_and_a_later_prefill_wraps_it_too():
    k_cache, v_cache = torch.zeros(B, H, W, D), torch.zeros(B, H, W, D)
    sliding.OPS.write(k_cache, v_cache, torch.arange(5), _tokens(range(5)), _tokens(range(5)))
    for p in range(5, 11):  # decode past the window: slots 5, 6, 7, 0, 1, 2
        sliding.OPS.write(k_cache, v_cache, torch.tensor([p]), _tokens(range(p, p + 1)), _tokens(range(p, p + 1)))
    assert _held(k_cache) == [8, 9, 10, 3, 4, 5, 6, 7]
    sliding.OPS.write(k_cache, v_cache, torch.arange(11, 17), _tokens(range(11, 17)), _tokens(range(11, 17)))
    assert _held(k_cache) == [16, 9, 10, 11, 12, 13, 14, 15]  # a 6-token chunk across the wrap


def test_slot_positions_follow_from_the_position_alone():
    assert sliding.slot_positions(torch.tensor(0), W).lt(0).all()  # nothing held yet (or after reset)
    assert sliding.slot_positions(torch.tensor(5), W).tolist() == [0, 1, 2, 3, 4, -3, -2, -1]
    assert sliding.slot_positions(torch.tensor(11), W).tolist() == [8, 9, 10, 3, 4, 5, 6, 7]
    k_cache, v_cache = torch.zeros(B, H, W, D), torch.zeros(B, H, W, D)
    sliding.OPS.write(k_cache, v_cache, torch.arange(19), _tokens(range(19)), _tokens(range(19)))
    assert _held(k_cache) == sliding.slot_positions(torch.tensor(19), W).tolist()


def test_the_mask_is_transformers_sliding_window_mask():
    """visible(q, k) == HF's causal AND sliding_window_overlay(W): the previous W - 1 tokens and itself."""
    hf = and_masks(causal_mask_function, sliding_window_overlay(W))
    q, k = torch.arange(30), torch.arange(30)
    expected = torch.stack([torch.stack([hf(0, 0, i, j) for j in k]) for i in q])  # [T, K] bool
    assert torch.equal(sliding.visible(q, k, W), expected)
    assert sliding.visible(q, k, W)[20].sum() == W
    assert not sliding.visible(torch.tensor([3]), torch.tensor([-5, -1]), W).any()  # empty slots never seen


def test_attention_inputs_see_what_hf_sees_across_a_long_prefill():
    """A call at positions 5..16 over a ring holding 0..4: every query sees exactly positions q-W+1..q."""
    k_cache, v_cache = torch.zeros(B, H, W, D), torch.zeros(B, H, W, D)
    sliding.OPS.write(k_cache, v_cache, torch.arange(5), _tokens(range(5)), _tokens(range(5)))
    pos = torch.arange(5, 17)
    keys, values, mask = sliding.attention_inputs(k_cache, v_cache, pos, _tokens(range(5, 17)), _tokens(range(5, 17)))
    assert keys.shape == values.shape == (B, H, W + 12, D) and mask.shape == (12, W + 12)
    for i, q in enumerate(pos.tolist()):
        seen = sorted(int(x) for x in keys[0, 0, mask[i], 0].tolist())
        assert seen == list(range(max(0, q - W + 1), q + 1)), q


def test_valid_slots_are_what_hf_dynamic_sliding_window_layer_keeps():
    """Prefill 11 (> W), 6 decode steps, a 5-token chunk: valid(position) == HF's layer, slot for slot."""
    hf = DynamicSlidingWindowLayer(sliding_window=W)
    k_cache, v_cache = torch.zeros(B, H, W, D), torch.zeros(B, H, W, D)
    position = 0
    for t in (11, 1, 1, 1, 1, 1, 1, 5):
        k, v = torch.randn(B, H, t, D), torch.randn(B, H, t, D)
        hf.update(k, v)
        sliding.OPS.write(k_cache, v_cache, torch.arange(position, position + t), k, v)
        position += t
        vk, vv = sliding.OPS.valid(k_cache, v_cache, position, prefilled=False)
        assert vk.shape == hf.keys.shape == (B, H, W - 1, D)  # HF keeps window - 1 tokens
        assert torch.equal(vk, hf.keys) and torch.equal(vv, hf.values), position
    short = sliding.OPS.valid(k_cache, v_cache, 3, prefilled=False)[0]  # fewer tokens than the window
    assert short.shape[2] == 3 and torch.equal(short, k_cache[:, :, :3])
    assert sliding.OPS.valid(k_cache, v_cache, 0, prefilled=False)[0].shape[2] == 0


def test_rewind_within_the_window_and_past_it_one_token_else_snapshot_suggested():
    layer = _spec().layers[1]  # the ring
    w = layer.window
    # at P <= W nothing was overwritten; past it the ring holds P - W .. P - 1 while the query at P - n reads
    # back to P - n - W + 1, so only n = 1 is still held
    assert [sliding.OPS.max_rewind(layer, p) for p in (0, 3, w, w + 1, 5 * w)] == [0, 3, w, 1, 1]
    assert sliding.OPS.written_by_decode

    def step(tokens, input_pos, *state):
        return torch.zeros(tokens.shape[0], tokens.shape[1], 4)

    s = Session(_spec(), step, step)
    s.prefill([[1, 2, 3]])
    s.rewind(2)  # inside the window: any number
    assert s.position == 1
    s.prefill([list(range(w + 2))])  # past the window
    at = s.position
    with pytest.raises(UsageError, match=rf"rewind\(2\) at position {at}: cache layer 1 \(sliding of {w} slots\) "
                                         rf"no longer holds what position {at - 2} reads, so at most 1 token"
                                         r"\(s\) can be rewound here; take session.snapshot\(\)"):
        s.rewind(2)
    assert s.position == at  # refused: nothing changed
    s.rewind(1)
    s.rewind(s.position)  # back to the start needs nothing kept
    s.prefill([[1, 2, 3]])
    snap = s.snapshot()
    s.decode([[4]])
    s.restore(snap)
    assert s.position == 3
    assert sliding.OPS.hf_label(None, 0) == sliding.SLIDING
    # under kvtrace.jit: the stored tail is held once the cache holds past tokens, and every call rewrites it
    assert sliding.OPS.hf_held(sliding.SLIDING, True) and not sliding.OPS.hf_held(sliding.SLIDING, False)
    assert sliding.OPS.hf_written(sliding.SLIDING, False)
    assert sliding.OPS.hf_length(sliding.SLIDING) == kinds.TAIL
