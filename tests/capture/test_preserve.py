"""Tracing never mutates the caller (#12): the caller's model and cache are bit-for-bit what they were
after every capture — kvtrace.export's and kvtrace.jit's, successful or failed — for every family.

``fingerprint`` walks an object the way a capture could touch it: every module's ``__dict__`` (so
parameters, buffers, submodules, hooks, plain tensor attributes such as rotary ``long_inv_freq`` and
cached numbers such as ``max_seq_len_cached``), the config, the cache's layers. A tensor is recorded
by identity, type (a FakeTensor shows up as one), shape, dtype and a hash of its bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from transformers import DynamicCache

import kvtrace
from conftest import ARCHS, LONGROPE_ORIGINAL, image_features, tiny_mllama, tiny_model, tiny_phi3_longrope
from kvtrace._errors import CaptureError
from kvtrace.cache.hf import cache_kwarg_name
from kvtrace.capture.export import capture_programs
from kvtrace.capture.preserve import ModelSnapshot, preserved, traced_leftovers
from kvtrace.spec.tolerances import close, tolerance_for

FAMILIES = (*ARCHS, "phi3-longrope")
TOL = tolerance_for(torch.float32)


def make(family: str) -> torch.nn.Module:
    return tiny_phi3_longrope() if family == "phi3-longrope" else tiny_model(family)


# --- the fingerprint --------------------------------------------------------------------------
def _digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().reshape(-1)
    return hashlib.sha1(flat.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _is_traced(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or torch._is_functional_tensor(t)


def fingerprint(obj: Any, path: str = "", out: dict[str, Any] | None = None,
                seen: dict[int, str] | None = None, depth: int = 0) -> dict[str, Any]:
    """path -> a comparable record of everything reachable from ``obj`` (see the module docstring)."""
    out = {} if out is None else out
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        kind = type(obj).__name__
        data = "<traced>" if _is_traced(obj) else _digest(obj)
        out[path] = (kind, id(obj), tuple(obj.shape), str(obj.dtype), data)
        return out
    if obj is None or isinstance(obj, (bool, int, str, torch.dtype, torch.device)):
        out[path] = (type(obj).__name__, obj if not isinstance(obj, (torch.dtype, torch.device)) else str(obj))
        return out
    if isinstance(obj, float):
        out[path] = ("float", repr(obj))
        return out
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool, type)) or (
            callable(obj) and not isinstance(obj, torch.nn.Module)):
        out[path] = (type(obj).__name__, getattr(obj, "__qualname__", ""), id(obj))
        return out
    if id(obj) in seen:
        out[path] = ("alias of", seen[id(obj)])
        return out
    seen[id(obj)] = path
    if depth > 24:
        out[path] = ("deep", type(obj).__name__, id(obj))
    elif isinstance(obj, dict):
        out[path] = (type(obj).__name__, id(obj), tuple(map(str, obj)))
        for k, v in obj.items():
            fingerprint(v, f"{path}[{k!r}]", out, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):  # a tuple is immutable: its contents are its identity
        out[path] = (type(obj).__name__, id(obj) if isinstance(obj, list) else None, len(obj))
        for i, v in enumerate(obj):
            fingerprint(v, f"{path}[{i}]", out, seen, depth + 1)
    elif isinstance(obj, (set, frozenset)):
        out[path] = (type(obj).__name__, id(obj), tuple(sorted(map(repr, obj))))
    elif hasattr(obj, "__dict__"):
        out[path] = (type(obj).__qualname__, id(obj))
        for k, v in vars(obj).items():
            if isinstance(obj, torch.nn.Module) and k in ("_parameters", "_buffers", "_modules"):
                out[f"{path}.{k}"] = (type(v).__name__, id(v), tuple(v))  # named as state_dict names them:
                for name, x in v.items():
                    fingerprint(x, f"{path}.{name}", out, seen, depth + 1)
            else:
                fingerprint(v, f"{path}.{k}", out, seen, depth + 1)
    else:
        out[path] = (type(obj).__qualname__, repr(obj)[:80])
    return out


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for k in sorted(set(before) | set(after)):
        if before.get(k) != after.get(k):
            out.append(f"{k or '<root>'}: {before.get(k, '<absent>')} -> {after.get(k, '<absent>')}")
    return out


def assert_unchanged(before: dict[str, Any], obj: Any, what: str) -> None:
    diff = changes(before, fingerprint(obj))
    assert not diff, f"{what} changed in {len(diff)} place(s): " + "; ".join(diff[:6])


def test_fingerprint_sees_a_fake_attribute_a_replaced_buffer_a_cached_number_and_data():
    """The fingerprint has teeth: each kind of mutation a trace can leave is a difference."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = tiny_phi3_longrope()
    rot = model.model.rotary_emb
    before = fingerprint(model)
    with FakeTensorMode() as mode:
        rot.long_inv_freq = mode.from_tensor(rot.inv_freq)
    assert any("rotary_emb.long_inv_freq" in d and "FakeTensor" in d for d in changes(before, fingerprint(model)))
    del rot.long_inv_freq
    assert not changes(before, fingerprint(model))
    for mutate in (lambda r: r.register_buffer("inv_freq", r.inv_freq.clone(), persistent=False),
                   lambda r: setattr(r, "max_seq_len_cached", 99),
                   lambda r: setattr(r, "attention_scaling", 0.5),
                   lambda r: r.inv_freq.add_(1e-3)):
        model = tiny_phi3_longrope()
        before = fingerprint(model)
        mutate(model.model.rotary_emb)
        assert changes(before, fingerprint(model))
    model = tiny_phi3_longrope()
    before = fingerprint(model)
    model.model.layers[1].mlp.down_proj.weight.data[0, 0] += 1e-3
    diff = changes(before, fingerprint(model))
    assert diff and all("layers.1.mlp.down_proj.weight" in d for d in diff), diff  # one weight's bytes


# --- kvtrace.export -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_export_leaves_the_callers_model_unchanged(family, tmp_path):
    model = make(family)
    before = fingerprint(model)
    kvtrace.export(model, tmp_path / "m.kvt", max_seq_len=32, backend="exported")
    assert_unchanged(before, model, f"{family} model after export")


def _failing_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise RuntimeError("injected failure inside attention\n  File \"x.py\", line 1, in <frames>")


@pytest.mark.parametrize("family", FAMILIES)
def test_failed_export_leaves_the_callers_model_unchanged_and_says_why_in_one_line(family, tmp_path, monkeypatch):
    """The trace fails in the first attention layer, after the rotary embedding (and longrope's update) ran."""
    model = make(family)
    before = fingerprint(model)
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", _failing_sdpa)
        with pytest.raises(CaptureError) as err:
            kvtrace.export(model, tmp_path / "m.kvt", max_seq_len=32, backend="exported")
    msg = str(err.value)
    assert "\n" not in msg and "injected failure inside attention" in msg and "File" not in msg, msg
    assert isinstance(err.value.__cause__, RuntimeError)
    assert_unchanged(before, model, f"{family} model after a failed export")
    assert list(tmp_path.iterdir()) == []
    kvtrace.export(model, tmp_path / "m.kvt", max_seq_len=32)  # still usable: the next export succeeds
    assert_unchanged(before, model, f"{family} model after the export that followed")


def test_longrope_export_then_eager_matches_eager_of_an_untouched_model(tmp_path):
    """The seed case: the caller's Phi-3 (longrope) still runs eagerly, past the short/long switch, as before."""
    model, twin = tiny_phi3_longrope(), tiny_phi3_longrope()
    kvtrace.export(model, tmp_path / "m.kvt", max_seq_len=32)
    ids = torch.arange(3, 3 + LONGROPE_ORIGINAL + 4)[None] % 128  # [1, 20] crosses the original length
    with torch.no_grad():
        got, ref = model(input_ids=ids).logits, twin(input_ids=ids).logits
    assert close(got, ref, TOL)[0]
    assert type(model.model.rotary_emb.long_inv_freq) is torch.Tensor  # set by this eager call, for real


def test_capture_programs_of_the_vision_decoder_leaves_the_decoder_unchanged():
    from kvtrace.models.registry import make_decoder

    model = tiny_mllama()
    before_model = fingerprint(model)
    decoder = make_decoder(model, max_seq_len=16, image_tokens=6)
    before = fingerprint(decoder)
    eps = capture_programs(decoder)
    assert set(eps) >= {"prefill", "decode"}
    assert_unchanged(before, decoder, "MllamaDecoder after capture")
    assert_unchanged(before_model, model, "MllamaForCausalLM after capture")


# --- kvtrace.jit ----------------------------------------------------------------------------------
def _step_both(jm: Any, model: torch.nn.Module, jc: Any, ec: Any, ids: torch.Tensor, **kw: Any) -> torch.Tensor:
    kwarg = cache_kwarg_name(model)
    with torch.no_grad():
        got = jm(input_ids=ids, **{kwarg: jc}, use_cache=True, **kw).logits
        ref = model(input_ids=ids, **{kwarg: ec}, use_cache=True, **kw).logits
    ok, diff, limit = close(got, ref, TOL)
    assert ok, f"jit logits differ from eager by {diff:.3g} > {limit:.3g}"
    for layer_j, layer_e in zip(jc.layers, ec.layers, strict=True):
        assert close(layer_j.keys, layer_e.keys, TOL)[0] and close(layer_j.values, layer_e.values, TOL)[0]
    return ref


@pytest.mark.parametrize("family", FAMILIES)
def test_jit_captures_leave_the_callers_model_unchanged(family):
    """Both programs (fresh cache, filled cache) are captured on a model that eager never ran before."""
    model = make(family)
    jm = kvtrace.jit(model, backend="eager")
    jc = DynamicCache(config=model.config)
    before = fingerprint(model)
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    prompt = jm(input_ids=ids, past_key_values=jc, use_cache=True).logits
    assert_unchanged(before, model, f"{family} model after jit's first capture")
    jm(input_ids=prompt[:, -1:].argmax(-1), past_key_values=jc, use_cache=True)
    assert jm.stats.captures == 2
    assert_unchanged(before, model, f"{family} model after jit's second capture")
    # and against eager on its own cache, from a fresh one (the eager calls mutate HF's rope state for real)
    jc, ec = DynamicCache(config=model.config), DynamicCache(config=model.config)
    ref = _step_both(jm, model, jc, ec, ids)
    for _ in range(LONGROPE_ORIGINAL + 2):  # past the longrope switch
        ref = _step_both(jm, model, jc, ec, ref[:, -1:].argmax(-1))
    assert jm.stats.captures == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_failed_jit_capture_leaves_the_callers_model_and_cache_unchanged(family, monkeypatch):
    model = make(family)
    jm = kvtrace.jit(model, backend="eager")
    cache = DynamicCache(config=model.config)
    before_model, before_cache = fingerprint(model), fingerprint(cache)
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", _failing_sdpa)
        with pytest.raises(CaptureError, match="injected failure"):
            jm(input_ids=torch.tensor([[5, 17, 42]]), past_key_values=cache, use_cache=True)
    assert_unchanged(before_model, model, f"{family} model after a failed jit capture")
    assert_unchanged(before_cache, cache, f"{family} cache after a failed jit capture")
    assert jm.stats.captures == 0


def test_failed_jit_capture_on_a_filled_cache_of_the_vision_decoder(monkeypatch):
    model = tiny_mllama()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), cross_attention_states=image_features(),
              past_key_values=cache, use_cache=True)
    jm = kvtrace.jit(model, backend="eager")
    before_model, before_cache = fingerprint(model), fingerprint(cache)
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "scaled_dot_product_attention", _failing_sdpa)
        with pytest.raises(CaptureError, match="injected failure"):
            jm(input_ids=torch.tensor([[9]]), past_key_values=cache, use_cache=True)
    assert_unchanged(before_model, model, "MllamaForCausalLM after a failed jit capture")
    assert_unchanged(before_cache, cache, "Mllama cache after a failed jit capture")
    out = jm(input_ids=torch.tensor([[9]]), past_key_values=cache, use_cache=True)  # then it captures fine
    assert out.past_key_values is cache and cache.get_seq_length() == 4
    assert_unchanged(before_model, model, "MllamaForCausalLM after a jit capture")


# --- the mechanism itself ---------------------------------------------------------------------------
class Stateful(torch.nn.Module):
    """Does to itself, while traced, everything HF rope code (and worse) does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0), persistent=False)
        self.table = torch.ones(4)  # a plain tensor attribute: lifted as a constant, written for real
        self.cached_len = 8
        self.scaling = 1.0
        self.history: list[Any] = []
        self.nested: dict[str, list[Any]] = {"seen": []}
        self.fail = False
        self.stash_deep = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.long_freq = self.freq * 2  # a new attribute: a FakeTensor
        self.register_buffer("freq", self.freq + 1, persistent=False)  # a replaced buffer
        self.table.add_(1)  # in place on a real plain tensor
        self.cached_len = x.shape[0] + 100
        self.scaling = 0.5
        self.history.append(x)
        self.extra = torch.nn.Linear(4, 4)  # a new submodule
        if self.stash_deep:
            self.nested["seen"].append(x)  # two levels down: restored by identity only
        if self.fail:
            raise RuntimeError("mid-trace failure")
        return self.lin(x) * self.table + self.freq + self.long_freq * self.scaling


@pytest.mark.parametrize("fail", [False, True])
def test_preserved_restores_everything_a_trace_did(fail):
    mod = Stateful()
    mod.fail = fail
    before = fingerprint(mod)
    x = torch.randn(3, 4)
    want = mod.lin(x) * 2 + 1 + torch.arange(4.0) + torch.arange(4.0) * 2 * 0.5  # what the forward computes
    if fail:
        with pytest.raises(RuntimeError, match="mid-trace failure"), preserved(mod):
            torch.export.export(mod, (x,), strict=False)
    else:
        with preserved(mod):
            ep = torch.export.export(mod, (x,), strict=False)
    assert_unchanged(before, mod, "the module")
    assert not hasattr(mod, "long_freq") and not hasattr(mod, "extra")
    assert torch.equal(mod.table, torch.ones(4)) and mod.cached_len == 8 and mod.history == []
    if not fail:  # the program still does what the forward did (running it writes the buffers it shares)
        assert torch.allclose(ep.module()(x), want, atol=1e-6)


def test_without_preserved_a_trace_leaves_its_marks():
    """What the mechanism undoes is real: torch.export alone leaves a FakeTensor and changed state behind."""
    mod = Stateful()
    before = fingerprint(mod)
    torch.export.export(mod, (torch.zeros(3, 4),), strict=False)
    diff = changes(before, fingerprint(mod))
    assert any(".long_freq" in d and "FakeTensor" in d for d in diff), diff
    assert any(".table" in d for d in diff) and any(".history" in d for d in diff), diff
    assert traced_leftovers(mod)


def test_a_traced_value_that_cannot_be_put_back_is_refused():
    mod = Stateful()
    mod.stash_deep = True
    with pytest.raises(CaptureError) as err, preserved(mod, what="the toy model"):
        torch.export.export(mod, (torch.zeros(3, 4),), strict=False)
    msg = str(err.value)
    assert "\n" not in msg and "the toy model" in msg and "nested['seen'][0] is a FakeTensor" in msg, msg


def test_a_model_already_holding_a_fake_is_refused_before_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = tiny_phi3_longrope()
    with FakeTensorMode() as mode:  # what an earlier, unguarded torch.export leaves (the seed report)
        model.model.rotary_emb.long_inv_freq = mode.from_tensor(model.model.rotary_emb.inv_freq)
    traced = []
    with pytest.raises(CaptureError, match=r"model\.rotary_emb\.long_inv_freq is a FakeTensor.*Reload the model"):
        with preserved(model):
            traced.append(1)
    assert traced == []


def test_inference_tensors_and_shared_modules_are_restored():
    shared = torch.nn.Linear(2, 2)
    root = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    with torch.inference_mode():
        root.table = torch.ones(2)
    snap = ModelSnapshot(root)
    with torch.inference_mode():
        root.table.add_(1)
    shared.cached = 3
    root.append(torch.nn.Tanh())
    assert snap.restore() == []
    assert torch.equal(root.table, torch.ones(2)) and not hasattr(shared, "cached") and len(root) == 3


def test_snapshot_costs_no_copy_of_the_weights():
    model = tiny_model("phi3")
    snap = ModelSnapshot(model)
    copied = sum(t.numel() for s in snap._states for t, _ in s.copies.values())
    assert copied == 0  # tiny phi3 has no plain tensor attribute before its first forward
