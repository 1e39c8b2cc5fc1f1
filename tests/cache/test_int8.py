"""int8 K/V (kvtrace.cache.int8) and the CacheSpec that declares it: quantization error within half a step,
scales written at the slots each kind says, buffers named, shaped and initialized from the spec, bytes <= 0.3x."""

from __future__ import annotations

import json

import pytest
import torch

from kvtrace._errors import UsageError
from kvtrace.cache import full, int8, sliding
from kvtrace.spec.cache import SCALE_DTYPE, CacheSpec, LayerKind, LayerSpec
from kvtrace.spec.tolerances import INT8_HALF_STEP


def _spec(kv_dtype: str | None = "int8", head_dim: int = 16, dtype: str = "float32", window: int | None = None,
          max_seq_len: int = 24) -> CacheSpec:
    layers = [LayerSpec(LayerKind.FULL, 2, head_dim, max_seq_len)]
    if window is not None:
        layers.append(LayerSpec(LayerKind.SLIDING, 2, head_dim, window, window=window))
    return CacheSpec(layers=tuple(layers), batch_size=1, max_seq_len=max_seq_len, dtype=dtype, kv_dtype=kv_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_within_half_a_step_of_each_row(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 40, 64, generator=g) * torch.logspace(-2, 2, 40)[:, None]).to(dtype)  # rows of any scale
    q, scale = int8.quantize(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.dtype == torch.float16 and scale.shape == (2, 3, 40, 1)
    assert int(q.abs().max()) == int8.QMAX  # each row's max maps to +-127; -128 is never used
    back = int8.dequantize(q, scale, dtype)
    assert back.dtype == dtype
    err = (back.float() - x.float()).abs().amax(-1)  # [2, 3, 40]
    row_max = x.float().abs().amax(-1)
    slack = 0 if dtype == torch.float32 else 2**-8  # bf16: the result's own rounding
    assert bool((err <= row_max * (INT8_HALF_STEP + slack) + 1e-12).all())
    assert float(err.max()) > 0  # lossy: the bound is not met by accident
    assert torch.equal(int8.stored(x), back)


def test_an_all_zero_row_stays_finite_and_zero():
    x = torch.zeros(1, 1, 2, 8)
    x[0, 0, 1] = torch.tensor([1e-9] * 8)  # below float16's range: the scale is floored at MIN_SCALE
    q, scale = int8.quantize(x)
    assert bool(torch.isfinite(scale).all()) and float(scale.min()) == int8.MIN_SCALE
    assert int(q.abs().max()) == 0 and float(int8.dequantize(q, scale, torch.float32).abs().max()) == 0.0


def test_full_write_stores_values_and_scales_at_input_pos():
    spec = _spec()
    kv = spec.layer_state(spec.allocate(), 0)
    k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    pos = torch.tensor([4, 5, 6])
    int8.write(full.OPS, kv.k, kv.v, kv.scales, pos, k, v)
    (qk, sk), (qv, sv) = int8.quantize(k), int8.quantize(v)
    assert torch.equal(kv.k[:, :, 4:7], qk) and torch.equal(kv.k_scale[:, :, 4:7], sk)
    assert torch.equal(kv.v[:, :, 4:7], qv) and torch.equal(kv.v_scale[:, :, 4:7], sv)
    rest = torch.cat([kv.k_scale[:, :, :4], kv.k_scale[:, :, 7:]], dim=2)
    assert float(rest.abs().max()) == 0.0  # untouched slots keep the declared initial scale
    got = int8.valid(full.OPS, kv.k, kv.v, kv.scales, 7, False, torch.float32)
    assert torch.equal(got[0][:, :, 4:], int8.stored(k)) and torch.equal(got[1][:, :, 4:], int8.stored(v))
    keys, _ = int8.read(kv.k, kv.v, kv.scales, torch.float32, torch.arange(7))
    assert keys.shape == (1, 2, 7, 16) and torch.equal(keys[:, :, 4:], int8.stored(k))


def test_sliding_write_stores_scales_in_the_ring_slots_last_window_wins():
    w = 4
    spec = _spec(window=w)
    kv = spec.layer_state(spec.allocate(), 1)
    assert kv.k.shape == (1, 2, w, 16) and kv.k_scale.shape == (1, 2, w, 1)
    k = torch.randn(1, 2, 6, 16) * torch.arange(1, 7)[:, None]  # a prefill of 6 > W: positions 0..5
    int8.write(sliding.OPS, kv.k, kv.v, kv.scales, torch.arange(6), k, k)
    qk, sk = int8.quantize(k)
    for p in (2, 3, 4, 5):  # the last W positions, each in slot p % W, with its own scale
        assert torch.equal(kv.k[:, :, p % w], qk[:, :, p]) and torch.equal(kv.k_scale[:, :, p % w], sk[:, :, p])
    got_k, _ = int8.valid(sliding.OPS, kv.k, kv.v, kv.scales, 6, False, torch.float32)
    assert torch.equal(got_k, int8.stored(k)[:, :, 3:])  # the last W - 1 positions, in order


def test_int8_buffers_are_declared_by_the_spec():
    spec = _spec(window=8)
    names = [(b.name, b.shape, b.dtype, b.init) for b in spec.buffers()]
    assert names == [
        ("layers.0.k", (1, 2, 24, 16), "int8", 0), ("layers.0.v", (1, 2, 24, 16), "int8", 0),
        ("layers.0.k_scale", (1, 2, 24, 1), SCALE_DTYPE, 0.0), ("layers.0.v_scale", (1, 2, 24, 1), SCALE_DTYPE, 0.0),
        ("layers.1.k", (1, 2, 8, 16), "int8", 0), ("layers.1.v", (1, 2, 8, 16), "int8", 0),
        ("layers.1.k_scale", (1, 2, 8, 1), SCALE_DTYPE, 0.0), ("layers.1.v_scale", (1, 2, 8, 1), SCALE_DTYPE, 0.0),
    ]
    state = spec.allocate()
    assert [t.dtype for t in state[:4]] == [torch.int8, torch.int8, torch.float16, torch.float16]
    kv = spec.layer_state(state, 1)
    assert kv.k is state[4] and kv.v_scale is state[7] and kv.scales == (state[6], state[7])
    plain = _spec(None, window=8)
    assert plain.per_layer == 2 and plain.layer_state(plain.allocate(), 1).scales is None
    assert "int8 K/V" in spec.describe() and "int8" not in plain.describe()


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_int8_cache_bytes_are_under_0_3x_fp32(head_dim):
    got = _spec("int8", head_dim).nbytes() / _spec(None, head_dim).nbytes()
    assert got == (head_dim + 2) / (4 * head_dim)  # D int8 values and one float16 scale per token and head
    assert got <= 0.3  # head_dim 16: 0.28125; 64 (SmolLM2): 0.2578


def test_manifest_field_is_optional_and_round_trips():
    plain = _spec(None)
    assert "kv_dtype" not in plain.to_dict()  # a cache in its model's dtype serializes as before
    assert CacheSpec.from_dict(json.loads(plain.to_json())) == plain
    q = _spec("int8", window=8)
    d = json.loads(q.to_json())
    assert d["kv_dtype"] == "int8" and CacheSpec.from_dict(d) == q


@pytest.mark.parametrize("kw, match", [(dict(kv_dtype="int4"), "kv_dtype must be"),
                                       (dict(kv_dtype="int8", kv_init=0.5), "starts at 0")])
def test_bad_kv_dtype_is_refused(kw, match):
    with pytest.raises(UsageError, match=match):
        CacheSpec(layers=(LayerSpec(LayerKind.FULL, 2, 16, 8),), batch_size=1, max_seq_len=8, dtype="float32", **kw)
