"""Sliding-window decoders end to end: exported with ring caches of window slots, verified against HF eager
(logits and every layer's valid slots, vs transformers' DynamicSlidingWindowLayer) far beyond the window;
planted ring faults fail verify."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvtrace
from conftest import tiny_model
from helpers import assert_exact_beyond_window, verify_bf16_export
from kvtrace.cache import sliding
from kvtrace.spec.cache import LayerKind
from kvtrace.spec.tolerances import tolerance_for
from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

WINDOW, MAX_SEQ_LEN, STEPS = 8, 48, 30
# Two prompts longer than the window (verify resets between them), each then decoded 30 steps: positions
# up to 41 and 47, more than twice the window; the second prefill alone wraps the ring twice.
PROMPTS = ([5, 17, 42, 8, 99, 3, 64, 7, 1, 2, 9], [3, 11, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18])
TOL = tolerance_for(torch.float32)
# arch -> (config overrides, layer kinds): Mistral slides on every layer, Qwen2 on layers >= max_window_layers
MODELS = {
    "mistral": (dict(sliding_window=WINDOW), [LayerKind.SLIDING, LayerKind.SLIDING]),
    "qwen2": (dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
              [LayerKind.FULL, LayerKind.SLIDING]),
}


def _export(arch: str, path: Any, backend: str = "exported") -> tuple[torch.nn.Module, Any]:
    model = tiny_model(arch, **MODELS[arch][0])
    kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=backend)
    return model, kvtrace.load(path)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[tuple[str, str], tuple[torch.nn.Module, Any]] = {}

    def get(arch: str, backend: str = "exported") -> tuple[torch.nn.Module, Any]:
        if (arch, backend) not in cache:
            cache[arch, backend] = _export(arch, tmp_path_factory.mktemp(f"{arch}-{backend}") / "m.kvt", backend)
        return cache[arch, backend]

    return get


def _assert_exact_beyond_the_window(arch: str, model: torch.nn.Module, art: Any, name: str) -> None:
    assert_exact_beyond_window(model, art, name, PROMPTS, STEPS, WINDOW, MODELS[arch][1])


@pytest.mark.parametrize("arch", list(MODELS))
def test_exported_rings_match_eager_beyond_twice_the_window(arch, built):
    model, art = built(arch)
    spec = art.cache_spec
    kinds = MODELS[arch][1]
    assert [x.kind for x in spec.layers] == kinds and spec.max_seq_len == MAX_SEQ_LEN
    slots = [WINDOW if k is LayerKind.SLIDING else MAX_SEQ_LEN for k in kinds]
    assert [b.shape[2] for b in spec.buffers()] == [s for s in slots for _ in "kv"]  # from the CacheSpec
    for name, signature in art.manifest.signatures.items():  # ... and from each program's signature
        assert [i["shape"][2] for i in signature[-2 * len(kinds):]] == [s for s in slots for _ in "kv"], name
    _assert_exact_beyond_the_window(arch, model, art, "exported")


@pytest.mark.parametrize("arch", list(MODELS))
def test_bf16_rings_pass_with_the_fp32_reference(arch, tmp_path):
    low = tiny_model(arch, torch.bfloat16, **MODELS[arch][0])
    verify_bf16_export(low, tmp_path / "m.kvt", PROMPTS, STEPS, MAX_SEQ_LEN)


@pytest.mark.compile
def test_aoti_rings_match_eager_beyond_twice_the_window(built):
    model, art = built("mistral", "aoti")
    _assert_exact_beyond_the_window("mistral", model, art, "aoti")


def _never_wraps(self, k_cache, v_cache, input_pos, k, v):
    """Planted fault: the ring written at pos (clamped into the buffer) instead of pos % window."""
    slots = input_pos.clamp(max=k_cache.shape[2] - 1)
    k_cache.index_copy_(2, slots, k)
    v_cache.index_copy_(2, slots, v)


def _one_key_too_many(query_pos, key_pos, window):
    """Planted fault: the window off by one (W + 1 keys visible: a slot about to be overwritten)."""
    q, k = query_pos[:, None], key_pos[None, :]
    return (k >= 0) & (k <= q) & (k >= q - window)


@pytest.mark.parametrize("fault", ["never-wraps", "window-off-by-one"])
def test_planted_ring_faults_fail_verify(fault, tmp_path, monkeypatch, built):
    if fault == "never-wraps":
        monkeypatch.setattr(sliding.SlidingOps, "write", _never_wraps)
    else:
        monkeypatch.setattr(sliding, "visible", _one_key_too_many)
    model, art = _export("mistral", tmp_path / "bad.kvt")
    monkeypatch.undo()
    good = built("mistral")[1]
    report = verify(EagerRunner(model), [SessionRunner(good.session(), "exported"),
                                         SessionRunner(art.session(), fault)], PROMPTS, steps=STEPS)
    assert report.first_failure("exported") is None
    fail = report.first_failure(fault)
    assert fail is not None and (fail.prompt, fail.step) == (0, "prefill")  # the 11-token prefill already wraps
    if fault == "never-wraps":  # the logits of the prefill are right; its cache is not
        assert fail.failure.startswith("layer 0 K max abs"), fail.failure
    else:
        assert "logits max abs" in fail.failure and fail.k_max_abs[0] == 0.0, fail.failure  # layer 0 K: no attention


def _eager_last(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """HF's logits for the last token of ``ids``, run from scratch (no cache): [1, V]."""
    return model(torch.tensor([ids])).logits[:, -1]


def test_rewind_on_rings_equals_eager_on_the_truncated_sequence(built):
    model, art = built("mistral")
    s = art.session()
    seq = [5, 17, 42, 8, 99]  # inside the window: any rewind is defined
    s.prefill([seq])
    s.rewind(3)
    seq = seq[:2]
    for t in (7, 1, 2, 9, 4, 6, 3, 11, 12, 13, 14):  # past the window: one token at a time
        got = s.decode([[t]])[:, -1]
        seq.append(t)
        torch.testing.assert_close(got, _eager_last(model, seq), atol=1e-4, rtol=1e-4)
        s.rewind(1)  # ... and back one token, then the next try
        seq.pop()
        alt = (t * 7 + 3) % 128
        torch.testing.assert_close(s.decode([[alt]])[:, -1], _eager_last(model, [*seq, alt]),
                                   atol=1e-4, rtol=1e-4)
        seq.append(alt)
    assert s.position == len(seq) > WINDOW
    with pytest.raises(kvtrace.UsageError, match=r"at most 1 token"):
        s.rewind(2)


def test_the_rewind_limit_is_tight_past_it_the_ring_would_be_wrong(built, monkeypatch):
    """With the check bypassed, rewinding 2 past the window reads an overwritten slot: eager disagrees."""
    model, art = built("mistral")
    s = art.session()
    seq = list(range(1, 2 * WINDOW))
    s.prefill([seq])
    monkeypatch.setattr(sliding.SlidingOps, "max_rewind", lambda self, layer, position: position)
    s.rewind(2)
    got = s.decode([[3]])[:, -1]
    assert (got - _eager_last(model, [*seq[:-2], 3])).abs().max() > 1e-3  # 10x the fp32 tolerance
