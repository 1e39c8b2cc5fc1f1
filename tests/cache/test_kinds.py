"""Cache kinds: each LayerKind's buffers, writes, valid slots, rewind rule and HF mapping (kvtrace.cache.kinds)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvtrace._errors import UnsupportedError, UsageError
from kvtrace.cache import cross, full, kinds, sliding
from kvtrace.cache import hf as hfc
from kvtrace.runtime.session import Session
from kvtrace.spec.cache import BufferSpec, CacheSpec, LayerKind, LayerSpec

B, H, D, S, N = 2, 3, 4, 8, 5


def _spec(extra_first: tuple[BufferSpec, ...] = ()) -> CacheSpec:
    """FULL, CROSS, FULL, CROSS layers (an Mllama-like cache) with the cross kind's shared state."""
    layers = tuple(LayerSpec(LayerKind.CROSS, H, D, N) if i % 2 else LayerSpec(LayerKind.FULL, H, D, S)
                   for i in range(4))
    return CacheSpec(layers=layers, batch_size=B, max_seq_len=S, dtype="float32", kv_init=0.5,
                     extra=(*extra_first, *cross.extra_buffers(B, N, "float32")))


def test_the_lookup_finds_each_kind_and_refuses_one_without_a_module(monkeypatch):
    assert kinds.ops(LayerKind.FULL) is full.OPS and kinds.ops("cross") is cross.OPS
    assert kinds.kind_of(LayerSpec(LayerKind.CROSS, H, D, N)) is cross.OPS
    assert kinds.ops(LayerKind.SLIDING) is sliding.OPS
    assert kinds.ops_for_label(full.SELF) is full.OPS
    assert kinds.ops_for_label(cross.CROSS_FILLED) is kinds.ops_for_label(cross.CROSS_EMPTY) is cross.OPS
    assert kinds.ops_for_label(sliding.SLIDING) is sliding.OPS
    monkeypatch.delitem(kinds._MODULES, LayerKind.SLIDING)  # a kind without a module (ops.__wrapped__: uncached)
    with pytest.raises(UnsupportedError, match="'sliding' has no implementation"):
        kinds.ops.__wrapped__(LayerKind.SLIDING)
    with pytest.raises(UnsupportedError, match="unknown cache layer state 'ring'"):
        kinds.ops_for_label("ring")


def test_the_spec_lists_each_layers_buffers_then_the_shared_state():
    spec = _spec()
    listed = spec.buffers()
    assert [b.name for b in listed[:4]] == ["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"]
    assert listed[2 * len(spec.layers):] == cross.extra_buffers(B, N, "float32")
    assert listed[0].shape == (B, H, S, D) and listed[2].shape == (B, H, N, D)  # [B, H_kv, S or N, D]
    assert {b.init for b in listed[:8]} == {0.5} and listed[-1] == BufferSpec("cross.active", (1,), "int64", 0)


def test_writes_land_where_each_kind_says():
    k_cache, v_cache = torch.zeros(B, H, S, D), torch.zeros(B, H, S, D)
    k, v = torch.ones(B, H, 2, D), 2 * torch.ones(B, H, 2, D)
    full.OPS.write(k_cache, v_cache, torch.tensor([3, 4]), k, v)  # slots 3 and 4 only
    assert k_cache[0, 0, :, 0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0] and v_cache[:, :, 3:5].eq(2).all()
    kc, vc = torch.zeros(B, H, N, D), torch.zeros(B, H, N, D)
    cross.OPS.write(kc, vc, torch.tensor([0]), torch.ones(B, H, N, D), 3 * torch.ones(B, H, N, D))  # all N slots
    assert kc.eq(1).all() and vc.eq(3).all()


def test_valid_slots_are_the_written_prefix_or_all_image_slots():
    k, v = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    vk, vv = full.OPS.valid(k, v, 3, prefilled=False)
    assert vk.shape == (B, H, 3, D) and torch.equal(vv, v[:, :, :3])
    assert full.OPS.valid(k, v, 0, prefilled=True)[0].shape[2] == 0
    ck, cv = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    assert cross.OPS.valid(ck, cv, 3, prefilled=False) is None  # no image prefill yet: holds nothing
    got = cross.OPS.valid(ck, cv, 3, prefilled=True)
    assert got[0] is ck and got[1] is cv


def test_rewind_and_decode_rules():
    layer = LayerSpec(LayerKind.FULL, H, D, S)
    assert full.OPS.max_rewind(layer, 5) == 5 and full.OPS.written_by_decode
    assert cross.OPS.max_rewind(layer, 5) == 5  # text positions do not index its slots
    assert not cross.OPS.written_by_decode  # only the image prefill writes it


def _noop(tokens, input_pos, *state):
    return torch.zeros(tokens.shape[0], tokens.shape[1], 4)


def test_session_rewind_asks_the_kind(monkeypatch):
    spec = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, 8),), batch_size=1, max_seq_len=8, dtype="float32")
    s = Session(spec, _noop, _noop)
    s.prefill([[1, 2, 3]])
    s.rewind(1)
    assert s.position == 2
    monkeypatch.setattr(full.FullOps, "max_rewind", lambda self, layer, position: 0)  # a kind keeping nothing
    with pytest.raises(UsageError, match=r"rewind\(1\) at position 2: cache layer 0 \(full\).*at most 0 "
                                         r"token\(s\).*snapshot\(\).*restore\(\)"):
        s.rewind(1)
    assert s.position == 2
    s.rewind(0)
    s.rewind(2)  # back to the start needs nothing kept
    assert s.position == 0


def test_shared_cross_state_is_found_by_name_not_position():
    spec = _spec(extra_first=(BufferSpec("step", (), "int64", 0),))
    state = spec.allocate()
    mask, active = cross.shared_state(spec, state)
    assert mask.shape == (B, N) and mask is state[-2] and active is state[-1]
    text = CacheSpec(layers=(LayerSpec(LayerKind.FULL, H, D, S),), batch_size=B, max_seq_len=S, dtype="float32")
    with pytest.raises(UsageError, match=r"cross\.mask and cross\.active"):
        cross.shared_state(text, text.allocate())


def _hf_cache() -> DynamicCache:
    """Layers 0, 2: self with P = 3; layers 1, 3: cross holding N = 5 image tokens."""
    cache = DynamicCache()
    for i, n in ((0, 3), (1, N), (2, 3), (3, N)):
        cache.update(torch.randn(B, H, n, D), torch.randn(B, H, n, D), i)
    return cache


def test_hf_layers_map_to_their_kinds_and_back():
    empty = hfc.layer_pattern(DynamicCache(), 4, cross=(1, 3))  # layers not even created yet
    assert empty == (full.SELF, cross.CROSS_EMPTY, full.SELF, cross.CROSS_EMPTY)
    assert [hfc.length_of(s) for s in empty] == [hfc.PAST, None, hfc.PAST, None]
    assert hfc.held_layers(hfc.CacheKind.DYNAMIC_FRESH, empty) == ()
    cache = _hf_cache()
    pattern = hfc.layer_pattern(cache, 4, cross=(1, 3))
    assert pattern == (full.SELF, cross.CROSS_FILLED) * 2
    assert [hfc.length_of(s) for s in pattern] == [hfc.PAST, hfc.IMAGE] * 2
    assert hfc.classify(cache, (1, 3)) is hfc.CacheKind.DYNAMIC
    held = hfc.held_layers(hfc.CacheKind.DYNAMIC, pattern)
    assert held == (0, 1, 2, 3)
    assert hfc.held_layers(hfc.CacheKind.DYNAMIC_FRESH, pattern) == (1, 3)  # image K/V only: no past yet
    assert hfc.written_layers(hfc.CacheKind.DYNAMIC, pattern, image=False) == (0, 2)  # cross layers only read
    assert hfc.written_layers(hfc.CacheKind.DYNAMIC, pattern, image=True) == (0, 1, 2, 3)
    assert hfc.held_layers(hfc.CacheKind.STATIC, pattern) == () == hfc.written_layers(hfc.CacheKind.NONE, pattern, True)

    state = hfc.dynamic_state(cache, held)  # [k0, v0, ..., k3, v3]: the cache's own tensors
    rebuilt = hfc.build_dynamic(state, 4, held)
    assert hfc.layer_pattern(rebuilt, 4, cross=(1, 3)) == pattern
    assert all(a is b for a, b in zip(hfc.dynamic_state(rebuilt, held), state, strict=True))

    grown = {i: (torch.randn(B, H, 4, D), torch.randn(B, H, 4, D)) for i in (0, 2)}  # P + T = 3 + 1
    hfc.write_back_dynamic(cache, grown)
    assert cache.layers[0].keys is grown[0][0] and cache.layers[2].values is grown[2][1]
    assert cache.layers[1].keys is state[2]  # the read-only cross layer is left as it was
    assert hfc.layer_pattern(cache, 4, cross=(1, 3)) == pattern


def test_cross_layers_of_an_hf_cache_hold_images_all_together():
    cache = _hf_cache()
    cache.layers[3].keys = cache.layers[3].values = torch.zeros(B, H, 0, D)  # emptied: HF's test says no image
    with pytest.raises(UsageError, match=r"layers \[1\] hold image tokens but \[3\] do not"):
        hfc.classify(cache, (1, 3))


def test_cache_kind_properties():
    K = hfc.CacheKind
    assert [k.stateful for k in K] == [False, True, True, True]
    assert [k.dynamic for k in K] == [False, True, True, False]
    assert [(k.fresh, k.filled, k.static) for k in K] == [
        (False, False, False), (True, False, False), (False, True, False), (False, False, True)]
