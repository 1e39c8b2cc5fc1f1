"""CacheSpec: (de)serialisation, buffer order and shapes, allocation, invariants."""

from __future__ import annotations

import json

import pytest
import torch

from kvtrace._errors import ArtifactError, UsageError
from kvtrace.models.hf_generic import hf_cache_spec
from kvtrace.spec.cache import LAYOUT, BufferSpec, CacheSpec, LayerKind, LayerSpec
from kvtrace.spec.tolerances import close, tolerance_for


def _spec(**kw) -> CacheSpec:
    base = dict(
        layers=(LayerSpec(LayerKind.FULL, 2, 4, 16), LayerSpec(LayerKind.FULL, 3, 8, 16)),
        batch_size=2,
        max_seq_len=16,
        dtype="float32",
        kv_init=0.25,
        extra=(BufferSpec("bias", (1,), "float32", 7.0), BufferSpec("step", (), "int64", 3)),
    )
    return CacheSpec(**{**base, **kw})


def test_round_trip_through_json():
    spec = _spec()
    d = json.loads(spec.to_json())  # what the manifest stores: plain JSON
    assert d["layers"][0]["kind"] == "full"
    assert d["extra"][0] == {"name": "bias", "shape": [1], "dtype": "float32", "init": 7.0}
    back = CacheSpec.from_dict(d)
    assert back == spec
    assert back.buffers() == spec.buffers()
    assert isinstance(back.layers[0].kind, LayerKind)
    assert isinstance(back.extra[0].shape, tuple)


def test_round_trip_sliding_and_cross_layers():
    spec = _spec(
        layers=(
            LayerSpec(LayerKind.FULL, 2, 4, 16),
            LayerSpec(LayerKind.SLIDING, 2, 4, 8, window=8),
            LayerSpec(LayerKind.CROSS, 2, 4, 5),
        ),
        extra=(),
    )
    back = CacheSpec.from_dict(json.loads(spec.to_json()))
    assert back == spec
    assert [b.shape for b in back.buffers()] == [(2, 2, 16, 4)] * 2 + [(2, 2, 8, 4)] * 2 + [(2, 2, 5, 4)] * 2


def test_buffers_order_and_shapes():
    spec = _spec()
    bufs = spec.buffers()
    assert [b.name for b in bufs] == ["layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v", "bias", "step"]
    # [B, H_kv, S, D] per layer
    assert [b.shape for b in bufs] == [(2, 2, 16, 4), (2, 2, 16, 4), (2, 3, 16, 8), (2, 3, 16, 8), (1,), ()]
    assert [b.init for b in bufs] == [0.25] * 4 + [7.0, 3]
    assert spec.layout == LAYOUT == "[B, H_kv, S, D]"
    assert spec.nbytes() == 4 * (2 * 2 * 2 * 16 * 4 + 2 * 2 * 3 * 16 * 8 + 1) + 8


def test_allocate_holds_initial_values_and_reset_restores_them():
    spec = _spec()
    tol = tolerance_for(torch.float32)
    state = spec.allocate()
    assert [tuple(t.shape) for t in state] == [b.shape for b in spec.buffers()]
    assert [t.dtype for t in state] == [torch.float32] * 5 + [torch.int64]
    for b, t in zip(spec.buffers(), state, strict=True):
        ok, diff, _ = close(t.double(), torch.full(b.shape, float(b.init), dtype=torch.float64), tol)
        assert ok, (b.name, diff)
    # fresh tensors every call: no shared memory between two allocations
    other = spec.allocate()
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(state, other, strict=True))
    for t in state:
        t.fill_(-3)
    spec.reset_(state)
    for b, t in zip(spec.buffers(), state, strict=True):
        ok, diff, _ = close(t.double(), torch.full(b.shape, float(b.init), dtype=torch.float64), tol)
        assert ok, (b.name, diff)


def test_layer_kind_given_as_string_is_normalised_and_checked():
    layer = LayerSpec("full", 2, 4, 16)
    assert layer.kind is LayerKind.FULL
    with pytest.raises(UsageError, match="max_len=8"):
        CacheSpec(layers=(LayerSpec("full", 2, 4, 8),), batch_size=1, max_seq_len=16, dtype="float32")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(batch_size=0), "batch_size >= 1"),
        (dict(max_seq_len=0, layers=()), "max_seq_len >= 1"),
        (dict(layers=(LayerSpec(LayerKind.FULL, 2, 4, 12),)), "max_seq_len=16.*max_len=12"),
        (dict(layers=(LayerSpec(LayerKind.SLIDING, 2, 4, 8, window=4),)), "window 4 != max_len 8"),
        (dict(extra=(BufferSpec("layers.0.k", (1,), "float32"),)), "unique"),
        (dict(dtype="float33"), "dtype"),
        (dict(kv_init=float("nan")), "finite"),
        (dict(layout="[B, S, H, D]"), "layout"),
    ],
)
def test_invariant_violations_raise_usage_error(kwargs, match):
    with pytest.raises(UsageError, match=match):
        _spec(**kwargs)


@pytest.mark.parametrize(
    ("ctor", "match"),
    [
        (lambda: LayerSpec(LayerKind.FULL, 0, 4, 16), "n_kv_heads"),
        (lambda: LayerSpec("diagonal", 2, 4, 16), "unknown layer kind"),
        (lambda: BufferSpec("b", (-1,), "float32"), "shape"),
        (lambda: BufferSpec("b", (1,), "float32", init="7"), "plain number"),
        (lambda: BufferSpec("", (1,), "float32"), "name"),
    ],
)
def test_part_invariants_raise_usage_error(ctor, match):
    with pytest.raises(UsageError, match=match):
        ctor()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("layers"),
        lambda d: d["layers"][0].update(kind="diagonal"),
        lambda d: d["layers"][0].pop("head_dim"),
        lambda d: d["layers"][0].update(max_len=3),  # invariant violated inside the manifest
        lambda d: d.update(batch_size="one"),
        lambda d: d.update(unknown_field=1),
        lambda d: d["extra"][0].update(shape=None),
        lambda d: d.update(layers="full"),
        lambda d: d.update(dtype="tensor"),
    ],
)
def test_malformed_dict_raises_artifact_error(mutate):
    d = json.loads(_spec().to_json())
    mutate(d)
    with pytest.raises(ArtifactError, match="re-export"):
        CacheSpec.from_dict(d)


@pytest.mark.parametrize("bad", [None, [], "spec", 3])
def test_non_dict_raises_artifact_error(bad):
    with pytest.raises(ArtifactError):
        CacheSpec.from_dict(bad)


def test_hf_cache_spec_matches_the_config():
    from conftest import tiny_model

    cfg = tiny_model("llama").config
    spec = hf_cache_spec(cfg, max_seq_len=32, batch_size=1, dtype=torch.float32)
    assert len(spec.layers) == cfg.num_hidden_layers
    assert spec.buffers()[0].shape == (1, cfg.num_key_value_heads, 32, cfg.hidden_size // cfg.num_attention_heads)
    assert spec.dtype == "float32" and spec.kv_init == 0.0 and spec.extra == ()
    with pytest.raises(UsageError, match=r"600.*512"):
        hf_cache_spec(cfg, max_seq_len=600, batch_size=1, dtype=torch.float32)


def test_hf_cache_spec_declares_a_window_shorter_than_the_cache_as_a_ring():
    from conftest import tiny_model

    cfg = tiny_model("mistral").config
    cfg.sliding_window = 16
    spec = hf_cache_spec(cfg, max_seq_len=32, batch_size=1, dtype=torch.float32)
    assert [(x.kind, x.max_len, x.window) for x in spec.layers] == [(LayerKind.SLIDING, 16, 16)] * 2
    assert spec.buffers()[0].shape[2] == 16 and spec.max_seq_len == 32  # window slots; positions still bounded
    same = hf_cache_spec(cfg, max_seq_len=16, batch_size=1, dtype=torch.float32)  # the window covers everything
    assert same.max_seq_len == 16 and {x.kind for x in same.layers} == {LayerKind.FULL}
    hybrid = tiny_model("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1).config
    spec = hf_cache_spec(hybrid, max_seq_len=32, batch_size=1, dtype=torch.float32)
    assert [(x.kind, x.max_len) for x in spec.layers] == [(LayerKind.FULL, 32), (LayerKind.SLIDING, 8)]
