"""kvtrace verify: passes on correct paths; on planted faults it fails and names the prompt, step and layer."""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pytest
import torch
from rich.console import Console

import kvtrace
from conftest import tiny_model
from helpers import cache_kwarg_only_model
from kvtrace.cache.hf import kv_geometry
from kvtrace.spec.cache import BufferSpec, CacheSpec, LayerKind, LayerSpec
from kvtrace.spec.tolerances import tolerance_for
from kvtrace.tools.verify import EagerRunner, JitRunner, SessionRunner, StepRow, VerifyReport, render, verify

MAX_SEQ_LEN = 48
PROMPTS = ([5, 17, 42, 8, 99, 3, 64], [3, 11, 2])  # two prompts of different lengths; verify resets between them
STEPS = 4
TOL = tolerance_for(torch.float32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(model, loaded artifact) per (arch, backend), exported once per module."""
    cache: dict[tuple[str, str, int], tuple[torch.nn.Module, Any]] = {}

    def get(arch: str = "llama", backend: str = "exported", seed: int = 0):
        key = (arch, backend, seed)
        if key not in cache:
            model = tiny_model(arch, seed=seed)
            path = tmp_path_factory.mktemp(f"{arch}-{backend}-{seed}") / "m.kvt"
            kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=backend)
            cache[key] = (model, kvtrace.load(path))
        return cache[key]

    return get


def render_text(report: VerifyReport) -> str:
    console = Console(record=True, width=220, color_system=None)
    console.print(render(report))
    return console.export_text()


def strict_json(text: str) -> Any:
    def refuse(c: str) -> None:
        raise ValueError(f"non-standard JSON constant {c}")

    return json.loads(text, parse_constant=refuse)


def assert_passes(report: VerifyReport, names: list[str], n_layers: int) -> None:
    """Everything a passing report must hold, beyond report.passed."""
    failures = [f"{r.candidate} p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    assert report.passed, "\n".join(failures)
    assert report.candidates() == names
    assert len(report.rows) == len(names) * len(PROMPTS) * (1 + STEPS)
    expected = {(c, p, s) for c in names for p in range(len(PROMPTS)) for s in ["prefill", *map(str, range(1, STEPS + 1))]}
    assert {(r.candidate, r.prompt, r.step) for r in report.rows} == expected
    for r in report.rows:
        where = f"{r.candidate} p{r.prompt}/{r.step}"
        assert len(r.k_max_abs) == len(r.v_max_abs) == n_layers, where
        assert all(math.isfinite(e) and e <= 1e-3 for e in (*r.k_max_abs, *r.v_max_abs)), where
        assert math.isfinite(r.logits_max_abs) and r.cache_len_ok and r.token_agree and r.top1_agree == 1.0, where
        assert r.failure == "", where
        plen = len(PROMPTS[r.prompt])
        assert r.position == plen + (0 if r.step == "prefill" else int(r.step)), where
    for name in names:
        assert report.first_failure(name) is None
    doc = strict_json(report.to_json())
    assert doc["passed"] is True and doc["result"] == "PASS"
    assert doc["tolerance"]["rule"] == str(TOL)
    assert len(doc["rows"]) == len(report.rows)
    assert {(r["candidate"], r["prompt"], r["step"]) for r in doc["rows"]} == expected
    assert all(len(r["k_max_abs"]) == len(r["v_max_abs"]) == n_layers for r in doc["rows"])
    assert [s["candidate"] for s in doc["summary"]] == names
    assert all(s["result"] == "PASS" and s["steps"] == len(PROMPTS) * (1 + STEPS) for s in doc["summary"])


# --- 1. correct paths pass ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_jit_eager_and_exported_pass(arch, built):
    model, art = built(arch)
    report = verify(EagerRunner(model), [JitRunner(model, backend="eager"), SessionRunner(art.session(), "exported")],
                    PROMPTS, steps=STEPS)
    assert_passes(report, ["jit-eager", "exported"], kv_geometry(model.config)[0])
    text = render_text(report)
    assert "PASS" in text and "FAIL" not in text
    assert str(TOL) in text


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_jit_inductor_and_aoti_pass(arch, built):
    model, art = built(arch, "aoti")
    report = verify(EagerRunner(model), [JitRunner(model, backend="inductor"), SessionRunner(art.session(), "aoti")],
                    PROMPTS, steps=STEPS)
    assert_passes(report, ["jit", "aoti"], kv_geometry(model.config)[0])


# --- 2. planted faults fail, naming prompt, step and layer ----------------------------------------
def shifted_session(art):
    """A session whose programs write (and read) the cache at position + 1: an off-by-one in input_pos."""
    s = art.session()
    prefill, decode = s._prefill, s._decode
    s._prefill = lambda tokens, input_pos, *state: prefill(tokens, input_pos + 1, *state)
    s._decode = lambda tokens, input_pos, *state: decode(tokens, input_pos + 1, *state)
    return s


def test_cache_written_at_position_plus_one_fails_at_first_step_naming_the_layer(built):
    model, art = built("llama")
    report = verify(EagerRunner(model), [SessionRunner(art.session(), "exported"),
                                         SessionRunner(shifted_session(art), "shifted")], PROMPTS, steps=STEPS)
    assert not report.passed
    assert report.first_failure("exported") is None
    fail = report.first_failure("shifted")
    assert (fail.prompt, fail.step) == (0, "prefill")
    # slot 0 was never written (it holds the declared initial value); eager wrote token 0 there
    assert re.match(r"layer 0 K max abs \S+ > \S+ \(first bad position 0, worst \d+\)", fail.failure), fail.failure
    assert fail.k_max_abs[0] > TOL.limit(1.0)
    assert all(not r.passed for r in report.rows if r.candidate == "shifted")  # every later step too
    summary = {s["candidate"]: s for s in report.summary()}
    assert summary["shifted"]["result"] == "FAIL" and summary["exported"]["result"] == "PASS"
    assert summary["shifted"]["first_failure"].startswith("prompt 0 step prefill: layer 0 K")
    text = render_text(report)
    assert "FAIL" in text and "PASS" in text and "prompt 0 step prefill: layer 0 K" in text and str(TOL) in text
    assert strict_json(report.to_json())["passed"] is False


class SessionWithoutReset(SessionRunner):
    def reset(self) -> None:  # forgets to reset: the next prompt lands after the previous one
        pass


class JitKeepingItsCache(JitRunner):
    def reset(self) -> None:  # resets the attention mask but keeps the old DynamicCache
        self._mask = None
        if not hasattr(self, "_cache"):
            super().reset()


@pytest.mark.parametrize("broken", ["session", "jit"])
def test_cache_not_reset_between_prompts_fails_at_prompt_1_prefill(broken, built):
    model, art = built("llama")
    cand = (SessionWithoutReset(art.session(), "no-reset") if broken == "session"
            else JitKeepingItsCache(model, backend="eager", name="no-reset"))
    report = verify(EagerRunner(model), [cand], PROMPTS, steps=STEPS)
    assert all(r.passed for r in report.rows if r.prompt == 0), "prompt 0 runs on a fresh cache and must pass"
    fail = report.first_failure("no-reset")
    assert (fail.prompt, fail.step) == (1, "prefill"), fail
    if broken == "session":  # the second prompt was written after the first: the cache is too long
        assert re.match(r"layer 0 cache shape \[1, 2, 14, 16\] != eager \[1, 2, 3, 16\]", fail.failure), fail.failure
        assert not fail.cache_len_ok
    else:  # kvtrace.jit refuses a mask that does not cover the stale cache; verify records it, does not crash
        assert fail.failure.startswith("raised UsageError: attention_mask covers 3 positions"), fail.failure
        later = [r for r in report.rows if r.prompt == 1 and r.step != "prefill"]
        assert later and all(r.failure.startswith("skipped: raised UsageError") for r in later)
    assert len(report.rows) == len(PROMPTS) * (1 + STEPS)
    strict_json(report.to_json())  # infinite errors are written as null


def test_a_state_not_holding_its_declared_initial_values_fails_the_first_prefill(built):
    """What a runtime without kvtrace's reset starts from is checked too (the seed's bug: an exporter that
    dropped a cache's initial values); reset() restores them, so the next prompt passes."""
    model, art = built("llama")
    s = art.session()
    s.state[0][0, 1, 2, 3] = 3.0  # as if the program had started from other memory than declared
    report = verify(EagerRunner(model), [SessionRunner(s, "lost")], PROMPTS, steps=1)
    fail = report.first_failure("lost")
    assert (fail.prompt, fail.step) == (0, "prefill")
    assert fail.failure == ("cache buffer layers.0.k holds 3 at [0, 1, 2, 3] where the CacheSpec declares 0 "
                            "everywhere (its initial value was lost, or reset() did not restore it)")
    assert [r.passed for r in report.rows] == [False, True, True, True]  # logits and K/V themselves are right


# a Decoder whose cache has a non-zero declared initial value that the forward reads
TOY_VOCAB, TOY_DIM, TOY_LAYERS, TOY_LEN, TOY_SCALE = 32, 8, 2, 24, 7.0


class ToyDecoder(torch.nn.Module):
    """Two attention layers over a declared cache plus an extra `scale` buffer (init 7.0) that scales K."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(TOY_VOCAB, TOY_DIM)
        self.wk = torch.nn.ModuleList(torch.nn.Linear(TOY_DIM, TOY_DIM, bias=False) for _ in range(TOY_LAYERS))
        self.wv = torch.nn.ModuleList(torch.nn.Linear(TOY_DIM, TOY_DIM, bias=False) for _ in range(TOY_LAYERS))
        self.head = torch.nn.Linear(TOY_DIM, TOY_VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.requires_grad_(False)
        self.cache_spec = CacheSpec(
            layers=(LayerSpec(LayerKind.FULL, 1, TOY_DIM, TOY_LEN),) * TOY_LAYERS,
            batch_size=1, max_seq_len=TOY_LEN, dtype="float32",
            extra=(BufferSpec("scale", (1,), "float32", TOY_SCALE),),
        )

    def kv(self, i: int, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.wk[i](x) * scale, torch.tanh(self.wv[i](x))  # [B, T, D] each

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        att = (x.unsqueeze(1) @ k.transpose(-1, -2)) * 0.25  # [B, 1, T, S]
        att = att.masked_fill(~visible, float("-inf")).softmax(-1)
        return x + (att @ v).squeeze(1)

    def forward(self, tokens, input_pos, k0, v0, k1, v1, scale):
        x = self.emb(tokens)  # [B, T, D]
        visible = torch.arange(k0.shape[2]) <= input_pos.unsqueeze(1)  # [T, S]: slot s visible from position p if s <= p
        for i, (kc, vc) in enumerate(((k0, v0), (k1, v1))):
            k, v = self.kv(i, x, scale)
            kc.index_copy_(2, input_pos, k.unsqueeze(1))  # [B, 1, S, D]
            vc.index_copy_(2, input_pos, v.unsqueeze(1))
            x = self.attend(x, kc, vc, visible)
        return self.head(x)


class ToyEagerRunner:
    """The toy computed eagerly with growing tensors (no state buffers, no positions): the reference."""

    name = "toy-eager"

    def __init__(self, toy: ToyDecoder):
        self.toy = toy
        self.scale = torch.tensor([TOY_SCALE])  # the declared initial value
        self.reset()

    def reset(self) -> None:
        self.k: list[torch.Tensor] = [torch.zeros(1, 1, 0, TOY_DIM) for _ in range(TOY_LAYERS)]
        self.v: list[torch.Tensor] = [torch.zeros(1, 1, 0, TOY_DIM) for _ in range(TOY_LAYERS)]

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        past, t = self.k[0].shape[2], tokens.shape[1]
        visible = torch.arange(past + t) <= (past + torch.arange(t)).unsqueeze(1)  # [T, P + T]
        x = self.toy.emb(tokens)
        for i in range(TOY_LAYERS):
            k, v = self.toy.kv(i, x, self.scale)
            self.k[i] = torch.cat([self.k[i], k.unsqueeze(1)], dim=2)
            self.v[i] = torch.cat([self.v[i], v.unsqueeze(1)], dim=2)
            x = self.toy.attend(x, self.k[i], self.v[i], visible)
        return self.toy.head(x)

    prefill = decode = _step

    def cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.k, self.v, strict=True))


class ZeroInitSpec:
    """A CacheSpec that silently allocates and resets every buffer to 0 instead of its declared value."""

    def __init__(self, spec: CacheSpec):
        self._spec = spec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)

    def allocate(self, device="cpu"):
        return [torch.zeros(b.shape, dtype=b.torch_dtype, device=device) for b in self._spec.buffers()]

    def reset_(self, state):
        for t in state:
            t.zero_()


TOY_PROMPTS = ([1, 2, 3, 4], [5, 6])


def test_zeroed_initial_value_fails_at_prompt_0_prefill(tmp_path, monkeypatch):
    toy = ToyDecoder()
    art = kvtrace.load(kvtrace.export(toy, tmp_path / "toy.kvt"))
    zeroed = art.session()
    monkeypatch.setattr(zeroed, "spec", ZeroInitSpec(zeroed.spec))  # verify's reset() now fills zeros
    report = verify(ToyEagerRunner(toy), [SessionRunner(art.session(), "declared-init"),
                                          SessionRunner(zeroed, "zero-init")], TOY_PROMPTS, steps=3)
    assert report.first_failure("declared-init") is None, report.first_failure("declared-init")
    assert all(len(r.k_max_abs) == TOY_LAYERS for r in report.rows)
    fail = report.first_failure("zero-init")
    assert (fail.prompt, fail.step) == (0, "prefill")
    assert fail.failure.startswith("layer 0 K max abs"), fail.failure
    assert float(zeroed.state[-1]) == 0.0  # the fault really was in place


@pytest.mark.parametrize("fault", ["final-norm", "other-seed"])
def test_artifact_with_other_weights_fails_at_prefill(fault, built):
    model, art = built("llama")
    if fault == "final-norm":  # one weight after the last layer: only the logits can differ
        reference = copy.deepcopy(model)
        with torch.no_grad():
            reference.model.norm.weight[0] += 0.5
        cand = SessionRunner(art.session(), "exported")
    else:  # an artifact exported from another model: everything differs, from layer 0 on
        reference = model
        cand = SessionRunner(built("llama", seed=1)[1].session(), "exported")
    report = verify(EagerRunner(reference), [cand], PROMPTS, steps=STEPS)
    fail = report.first_failure("exported")
    assert (fail.prompt, fail.step) == (0, "prefill")
    assert "logits max abs" in fail.failure
    if fault == "final-norm":
        assert fail.failure.startswith("logits max abs"), fail.failure
        assert max((*fail.k_max_abs, *fail.v_max_abs)) <= 1e-3  # the cache is still right
    else:
        assert fail.failure.startswith("layer 0 K max abs"), fail.failure
        assert "(+3 more layer K/V)" in fail.failure, fail.failure  # both layers, K and V


class NanInCache(EagerRunner):
    """Eager, except that layer 1's V holds a NaN from decode step 2 on."""

    steps = 0

    def decode(self, token):
        self.steps += 1
        return super().decode(token)

    def cache(self):
        out = super().cache()
        if self.steps >= 2:
            k, v = out[1]
            v = v.clone()
            v[0, 0, -1, 0] = float("nan")
            out[1] = (k, v)
        return out


class RaisesAtStep2(EagerRunner):
    calls = 0

    def decode(self, token):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("boom")
        return super().decode(token)


def test_nan_in_the_cache_fails_and_an_exception_is_recorded_not_raised(llama):
    report = verify(EagerRunner(llama), [NanInCache(llama, "nan"), RaisesAtStep2(llama, "raises")],
                    PROMPTS, steps=STEPS)
    nan = report.first_failure("nan")
    assert (nan.prompt, nan.step) == (0, "2")
    assert re.match(r"layer 1 V max abs nan > \S+ \(first bad position 8, worst 8\)", nan.failure), nan.failure
    raised = report.first_failure("raises")
    assert (raised.prompt, raised.step, raised.failure) == (0, "2", "raised RuntimeError: boom")
    rows = [r for r in report.rows if r.candidate == "raises"]
    assert [r.passed for r in rows if r.prompt == 0] == [True, True, False, False, False]
    assert all(r.failure == "skipped: raised RuntimeError: boom at step 2" for r in rows[3:5])
    assert all(r.passed for r in rows if r.prompt == 1)  # reset() gave it a fresh start
    assert len(report.rows) == 2 * len(PROMPTS) * (1 + STEPS)
    doc = strict_json(report.to_json())
    assert doc["rows"][5]["logits_max_abs"] is None  # "raises" at p0/2 (rows alternate nan, raises)


def test_render_and_summary_name_result_and_tolerance():
    ok = StepRow("a", 0, "prefill", 3, 0.0, 0.0, 1.0, True, (0.0,), (0.0,), True, True)
    bad = StepRow("b", 1, "2", 6, 1.0, 0.5, 0.0, False, (2.0,), (0.0,), True, False, "layer 0 K max abs 2 > 0.0001")
    report = VerifyReport(tolerance={"atol": "0.0001", "rtol": "0.0001", "rule": str(TOL)}, dtype="float32",
                          rows=[ok, bad])
    summary = {s["candidate"]: s for s in report.summary()}
    assert (summary["a"]["result"], summary["b"]["result"]) == ("PASS", "FAIL")
    assert summary["a"]["tolerance"] == summary["b"]["tolerance"] == str(TOL)
    assert summary["b"]["first_failure"] == "prompt 1 step 2: layer 0 K max abs 2 > 0.0001"
    text = render_text(report)
    assert str(TOL) in text and "float32" in text
    assert "PASS" in text and "FAIL prompt 1 step 2: layer 0 K max abs 2 > 0.0001" in text
    assert "1/2 candidate(s)" in text and "failed: b" in text


# --- reduced precision: the fp32 reference route --------------------------------------------------------

class Offset(EagerRunner):
    """Eager, with ``delta`` added to every logit and to layer 0's K: a run that is off by a known amount."""

    def __init__(self, model, name, delta: float, cast: torch.dtype | None = None):
        self.delta, self.cast = delta, cast
        super().__init__(model, name)

    def _step(self, tokens, cross=None):
        out = super()._step(tokens, cross)
        return (out.to(self.cast) if self.cast else out) + self.delta

    def cache(self):
        out = []
        for i, kv in enumerate(super().cache()):
            k, v = (t.to(self.cast) if self.cast else t for t in kv)
            out.append((k + self.delta if i == 0 else k, v))
        return out


@pytest.fixture(scope="module")
def bf16_pair():
    """(the tiny llama in bf16, the same weights upcast to fp32)."""
    low = tiny_model("llama").to(torch.bfloat16)
    return low, copy.deepcopy(low).float()


def test_bf16_candidate_closer_to_fp32_than_eager_passes_only_with_the_fp32_reference(bf16_pair):
    low, high = bf16_pair
    bf16 = torch.bfloat16
    # eager bf16 made sloppy by 0.5 (logits and layer 0 K), far past the bf16 tolerance of its ~1e0 values;
    # "accurate" is the fp32 run rounded to bf16: the best a bf16 program can do
    ref = lambda: Offset(low, "eager", 0.5)  # noqa: E731
    accurate, worse = Offset(high, "accurate", 0.0, cast=bf16), Offset(low, "worse", 2.0)
    with_fp32 = verify(ref(), [accurate, worse], PROMPTS, steps=STEPS, dtype=bf16, fp32=EagerRunner(high, "fp32"))
    alone = verify(ref(), [Offset(high, "accurate", 0.0, cast=bf16)], PROMPTS, steps=STEPS, dtype=bf16)

    assert not alone.passed  # 0.5 from the reference: the fixed bf16 tolerance alone fails it
    assert alone.first_failure("accurate").failure.startswith("layer 0 K max abs 0.")
    rows = [r for r in with_fp32.rows if r.candidate == "accurate"]
    assert all(r.passed for r in rows), [r.failure for r in rows if not r.passed]
    assert all(r.logits_max_abs >= 0.45 for r in rows)  # it did miss eager by the planted amount
    assert all(r.logits_vs_fp32 < 0.05 and r.eager_logits_vs_fp32 >= 0.45 for r in rows)
    fail = with_fp32.first_failure("worse")  # 2.0 from fp32 where eager is 0.5 away: still fails, saying both
    assert (fail.prompt, fail.step) == (0, "prefill")
    m = re.match(r"layer 0 K max abs ([\d.]+) > [\d.]+, vs fp32 ([\d.]+) > [\d.]+ \(eager's own ([\d.]+) \+ tolerance\)",
                 fail.failure)
    assert m, fail.failure
    assert [round(float(x), 1) for x in m.groups()] == [1.5, 2.0, 0.5]  # bf16 rounds k + offset near 2 by < 0.02
    assert re.search(r"; logits max abs 1\.\d+ > [\d.]+, vs fp32 [12]\.\d+ > ", fail.failure), fail.failure
    summary = {s["candidate"]: s for s in with_fp32.summary()}
    assert summary["accurate"]["result"] == "PASS" and summary["worse"]["result"] == "FAIL"
    assert summary["accurate"]["eager_logits_vs_fp32"] >= 0.45
    assert with_fp32.tolerance["fp32_reference"] == "true" and "no further from fp32" in with_fp32.tolerance["rule"]
    text = render_text(with_fp32)
    assert "logits vs fp32 (cand / eager)" in text and "no further from fp32" in text
    assert strict_json(with_fp32.to_json())["summary"][0]["logits_vs_fp32"] < 0.05


def test_a_nan_fails_both_routes(bf16_pair):
    low, high = bf16_pair
    report = verify(EagerRunner(low), [Offset(low, "nan", float("nan"))], PROMPTS[:1], steps=1,
                    dtype=torch.bfloat16, fp32=EagerRunner(high, "fp32"))
    fail = report.first_failure("nan")
    assert fail is not None and (fail.prompt, fail.step) == (0, "prefill")
    assert "vs fp32 nan" in fail.failure


def test_fp32_reference_is_refused_for_a_float32_run(llama):
    with pytest.raises(kvtrace.UsageError, match="only applies to reduced-precision runs"):
        verify(EagerRunner(llama), [], PROMPTS, steps=1, fp32=EagerRunner(llama, "fp32"))


def test_eager_runner_passes_the_cache_by_the_models_own_kwarg():
    """transformers 5 takes the cache as ``cache=`` (``past_key_values=`` is deprecated, and removed in 5.40):
    the runners call the model the way its forward spells it, and the cache fills."""
    model = cache_kwarg_only_model()
    ref = EagerRunner(model)
    report = verify(ref, [JitRunner(model, backend="eager")], [[5, 17, 42]], steps=2)
    assert report.passed, [r.failure for r in report.rows]
    assert [k.shape[2] for k, _ in ref.cache()] == [5, 5]  # 3 prompt tokens + 2 decoded, in every layer
