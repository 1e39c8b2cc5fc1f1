"""Llama 3.2 Vision text decoder (MllamaForCausalLM): self- and cross-attention caches through
export (both backends), Session and verify, against eager HF.

Scenario of every verify here: prompt 0 with image features and a mask with holes (one text row
sees no image token), prompt 1 text only, prompt 2 with other image features and the default mask;
a reset between prompts; logits and every layer's cache (self K/V per position, cross K/V per image
token) compared after prefill and after each of 16 decode steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kvtrace
from conftest import IMAGE_TOKENS, MLLAMA_CROSS_LAYERS, TINY, image_features, tiny_mllama, tiny_model
from kvtrace._errors import UsageError
from kvtrace.spec.tolerances import close, tolerance_for
from kvtrace.tools.verify import EagerRunner, JitRunner, Prompt, SessionRunner, verify

MAX_SEQ_LEN = 48
P0 = [1, 5, 9, 17, 33, 64, 100]
P1 = [1, 7, 3]
STEPS = 16


def mask_with_holes(t: int) -> torch.Tensor:
    """[1, T, N] 0/1: token 1 sees only the first 3 image tokens, token 2 sees none."""
    m = torch.ones(1, t, IMAGE_TOKENS)
    m[0, 1, 3:] = 0
    m[0, 2] = 0
    return m


def scenario(dtype: torch.dtype = torch.float32) -> list[Prompt]:
    return [
        Prompt(P0, {"cross_attention_states": image_features(dtype=dtype),
                    "cross_attention_mask": mask_with_holes(len(P0))}),
        Prompt(P1),
        Prompt(P1, {"cross_attention_states": image_features(seed=2, dtype=dtype)}),
    ]


@pytest.fixture(scope="module")
def model():
    return tiny_mllama()


def _export(model, tmp_path_factory, backend: str):
    path = tmp_path_factory.mktemp("mllama") / f"{backend}.kvt"
    return kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=backend, image_tokens=IMAGE_TOKENS)


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    return _export(model, tmp_path_factory, "exported")


@pytest.fixture(scope="module", params=["exported", pytest.param("aoti", marks=pytest.mark.compile)])
def artifact(request, model, exported, tmp_path_factory):
    return request.param, exported if request.param == "exported" else _export(model, tmp_path_factory, "aoti")


def summary(report) -> str:
    return json.dumps(report.summary(), indent=1)


# --- the decoder and its spec --------------------------------------------------------------------
def test_cache_spec_declares_self_and_cross_layers(model, artifact):
    _, path = artifact
    art = kvtrace.load(path)
    spec = art.cache_spec
    kinds = [layer.kind.value for layer in spec.layers]
    assert kinds == ["full", "cross", "full", "cross"]
    assert [layer.max_len for layer in spec.layers] == [MAX_SEQ_LEN, IMAGE_TOKENS, MAX_SEQ_LEN, IMAGE_TOKENS]
    assert [(b.name, b.shape, b.init) for b in spec.extra] == [
        ("cross.mask", (1, IMAGE_TOKENS), 0.0), ("cross.active", (1,), 0)]
    progs = art.manifest.programs
    assert set(progs) == {"prefill", "decode", "prefill_image"}
    image = progs["prefill_image"]
    assert image.once and [i.name for i in image.inputs] == ["cross_attention_states", "cross_attention_mask"]
    assert image.inputs[0].shape == ("B", IMAGE_TOKENS, TINY["hidden_size"])
    assert image.inputs[1].shape == ("B", "T", IMAGE_TOKENS) and image.inputs[1].default == 1.0


def test_head_dim_comes_from_the_config_helper():
    """The cache's D is ``spec.config.head_dim`` (config.head_dim, else hidden / heads); transformers' Mllama
    cannot run a head_dim other than hidden / heads (its attention ignores it), so such configs are refused."""
    import transformers as tf

    from kvtrace._errors import UnsupportedError
    from kvtrace.models.mllama import mllama_cache_spec

    def spec(**kw):
        cfg = tf.MllamaTextConfig(**TINY, cross_attention_layers=[1], **kw)
        return mllama_cache_spec(cfg, max_seq_len=8, batch_size=1, dtype=torch.float32, image_tokens=IMAGE_TOKENS)

    split = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert {layer.head_dim for layer in spec().layers} == {split}
    assert {layer.head_dim for layer in spec(head_dim=split).layers} == {split}
    with pytest.raises(UnsupportedError, match=f"head_dim 8, but MllamaForCausalLM's attention uses .* = {split}"):
        spec(head_dim=8)


def test_image_features_change_the_logits(model):
    """Sanity of the scenario: dropping the image would be visible in the logits, not within tolerance."""
    ids = torch.tensor([P0])
    text = model(input_ids=ids).logits
    seen = model(input_ids=ids, cross_attention_states=image_features()).logits
    ok, diff, limit = close(seen, text, tolerance_for(torch.float32))
    assert not ok and diff > 100 * limit, (diff, limit)


# --- verify: logits and both caches, every step ---------------------------------------------------
def test_verify_exported_and_aoti_against_eager(model, artifact):
    backend, path = artifact
    report = verify(EagerRunner(model), [SessionRunner(kvtrace.load(path).session(), backend)], scenario(),
                    steps=STEPS)
    assert report.passed, summary(report)
    assert len(report.rows) == 3 * (STEPS + 1)
    assert all(r.token_agree for r in report.rows), summary(report)
    assert all(len(r.k_max_abs) == 4 for r in report.rows)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.compile)])
def test_verify_jit_against_eager(model, backend):
    """HF-style calls (DynamicCache with self + cross layers) through kvtrace.jit, same scenario."""
    runner = JitRunner(model, backend=backend)
    report = verify(EagerRunner(model), [runner], scenario(), steps=STEPS)
    assert report.passed, summary(report)
    # image prefill + decode, text-only prefill + decode; prompt 2 reuses the image programs
    assert runner.jm.stats.captures == 4 and runner.jm.stats.calls == 3 * (STEPS + 1)


def test_runner_caches_hold_cross_kv_only_with_an_image(model, artifact):
    _, path = artifact
    eager, cand = EagerRunner(model), SessionRunner(kvtrace.load(path).session(), "c")
    for runner in (eager, cand):
        runner.prefill(torch.tensor([P0]), cross_attention_states=image_features())
        runner.decode(torch.tensor([[3]]))
    for i, (e, c) in enumerate(zip(eager.cache(), cand.cache(), strict=True)):
        n = IMAGE_TOKENS if i in MLLAMA_CROSS_LAYERS else len(P0) + 1
        assert e[0].shape == c[0].shape == (1, 2, n, 16), i
    for runner in (eager, cand):
        runner.reset()
        runner.prefill(torch.tensor([P1]))
    for i, (e, c) in enumerate(zip(eager.cache(), cand.cache(), strict=True)):
        if i in MLLAMA_CROSS_LAYERS:
            assert e is None and c is None, i  # skipped, as eager skips it
        else:
            assert e[0].shape == c[0].shape == (1, 2, len(P1), 16)


class _Corrupting(SessionRunner):
    """Adds 1 to layer 3's cross K after prefill: a wrong cross-attention cache."""

    def prefill(self, tokens, **inputs):
        out = super().prefill(tokens, **inputs)
        if inputs:
            self.session.state[2 * 3].add_(1.0)
        return out


class _DropsImage(SessionRunner):
    """Ignores the image features: the text-only path."""

    def prefill(self, tokens, **inputs):
        return super().prefill(tokens)


def test_verify_catches_a_wrong_or_missing_cross_cache(model, exported):
    art = kvtrace.load(exported)
    report = verify(EagerRunner(model), [_Corrupting(art.session(), "corrupt"), _DropsImage(art.session(), "drops")],
                    scenario()[:1], steps=2)
    corrupt, drops = report.first_failure("corrupt"), report.first_failure("drops")
    assert corrupt is not None and corrupt.step == "prefill" and "layer 3 K max abs" in corrupt.failure
    assert drops is not None and "layer 1: eager holds K/V [1, 2, 6, 16], candidate holds nothing" in drops.failure


@pytest.mark.parametrize("backend", ["exported"])
def test_verify_bfloat16(backend, tmp_path):
    model = tiny_mllama(torch.bfloat16)
    path = kvtrace.export(model, tmp_path / "bf16.kvt", max_seq_len=MAX_SEQ_LEN, dtype="bfloat16",
                          backend=backend, image_tokens=IMAGE_TOKENS)
    report = verify(EagerRunner(model), [SessionRunner(kvtrace.load(path).session(), backend)],
                    scenario(torch.bfloat16), steps=8, dtype=torch.bfloat16)
    assert report.passed, summary(report)


def test_prefill_logits_last_for_both_prefill_programs(model, tmp_path):
    path = kvtrace.export(model, tmp_path / "last.kvt", max_seq_len=MAX_SEQ_LEN, image_tokens=IMAGE_TOKENS,
                          prefill_logits="last")
    art = kvtrace.load(path)
    assert {n: p.logits for n, p in art.manifest.programs.items()} == {
        "prefill": "last", "decode": "all", "prefill_image": "last"}
    s = art.session()
    assert s.prefill(torch.tensor([P0]), cross_attention_states=image_features()).shape[1] == 1
    report = verify(EagerRunner(model), [SessionRunner(art.session(), "last")], scenario(), steps=4)
    assert report.passed, summary(report)


# --- Session: cross state, reset, snapshot ---------------------------------------------------------
def test_image_prefill_fills_cross_state_and_reset_clears_it(artifact):
    _, path = artifact
    s = kvtrace.load(path).session()
    spec = s.spec
    mask = mask_with_holes(len(P0))
    s.prefill(torch.tensor([P0]), cross_attention_states=image_features(), cross_attention_mask=mask.bool())
    state = dict(zip([b.name for b in spec.buffers()], s.state, strict=True))
    assert s.filled == {"prefill_image"}
    assert int(state["cross.active"]) == 1
    assert torch.equal(state["cross.mask"], mask[:, -1])
    assert all(state[f"layers.{i}.k"].abs().sum() > 0 for i in MLLAMA_CROSS_LAYERS)
    snap = s.snapshot()
    with pytest.raises(UsageError, match=r"already ran prefill_image.*reset"):
        s.prefill(torch.tensor([P1]), cross_attention_states=image_features())
    s.prefill(torch.tensor([[4, 5]]))  # more text about the same image is fine
    s.reset()
    assert s.position == 0 and s.filled == frozenset()
    assert all(torch.equal(t, b.allocate()) for t, b in zip(s.state, spec.buffers(), strict=True))
    s.restore(snap)
    assert s.filled == {"prefill_image"} and s.position == len(P0)
    assert int(s.state[-1]) == 1


def test_bad_image_inputs_raise_clear_errors(artifact):
    _, path = artifact
    s = kvtrace.load(path).session()
    ids = torch.tensor([P1])
    cases = [
        (dict(cross_attention_states=torch.zeros(1, 5, 64)), r"shape \[1, 5, 64\]; this artifact expects \[1, 6, 64\]"),
        (dict(cross_attention_states=torch.zeros(1, 6, 32)), r"expects \[1, 6, 64\]"),
        (dict(cross_attention_states=torch.zeros(1, 6, 64, dtype=torch.float64)),
         r"is float64; this artifact was exported for float32. Convert it with .to\(torch.float32\)"),
        (dict(cross_attention_states=torch.full((1, 6, 64), float("nan"))), "NaN or infinite"),
        (dict(cross_attention_states=image_features(), cross_attention_mask=torch.full((1, 3, 6), 0.5)),
         "must hold 0/1 values"),
        (dict(cross_attention_states=image_features(), cross_attention_mask=torch.ones(1, 4, 6)),
         r"cross_attention_mask has shape \[1, 4, 6\]; this artifact expects \[1, 3, 6\]"),
        (dict(cross_attention_mask=torch.ones(1, 3, 6)), r"accepts prefill_image: cross_attention_states"),
        (dict(pixel_values=torch.zeros(1, 3, 8, 8)), r"got input\(s\) \['pixel_values'\]"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(UsageError, match=msg):
            s.prefill(ids, **kwargs)
        assert s.position == 0 and s.filled == frozenset()  # nothing ran
    assert all(not t.any() for t in s.state)


def test_image_features_given_to_a_text_only_artifact(tmp_path):
    path = kvtrace.export(tiny_model("llama"), tmp_path / "text.kvt", max_seq_len=16)
    s = kvtrace.load(path).session()
    with pytest.raises(UsageError, match="exported from a text-only model"):
        s.prefill(torch.tensor([P1]), cross_attention_states=image_features())
    with pytest.raises(UsageError, match="image_tokens applies to vision decoders"):
        kvtrace.export(tiny_model("llama"), tmp_path / "x.kvt", max_seq_len=16, image_tokens=6)


LOAD_SCRIPT = r"""
import json, sys
import torch
import kvtrace
s = kvtrace.load(sys.argv[1]).session()
x = torch.tensor(json.loads(sys.argv[2]))
first = s.prefill(torch.tensor([[1, 5, 9]]), cross_attention_states=x)
nxt = s.decode(torch.tensor([[4]]))
leaked = sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))
print(json.dumps({"leaked": leaked, "logits": torch.cat([first[:, -1:], nxt], 1).tolist()}))
"""


def test_fresh_process_without_transformers(artifact):
    _, path = artifact
    x = image_features()
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(path), json.dumps(x.tolist())],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["leaked"] == []
    s = kvtrace.load(path).session()
    ref = torch.cat([s.prefill(torch.tensor([[1, 5, 9]]), cross_attention_states=x)[:, -1:],
                     s.decode(torch.tensor([[4]]))], 1)
    assert torch.allclose(torch.tensor(out["logits"]), ref, atol=1e-5)
