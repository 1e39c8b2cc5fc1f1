"""The noise-floor route of verify (tools.noise, tools.verify_kv.noise_floor, spec.tolerances.judge): the
perturbations compute the same product; the route's arithmetic; scripted runners whose distances are set by
hand (within twice the floor passes, beyond fails, a layer whose floor is 0 keeps the plain tolerance); on a
tiny int8-cache Llama and a tiny 8da4w Llama, rounding flips that fail the fixed tolerance pass on the floor
while the planted faults (a stale scale, a wrong group size) still fail with the floor in force."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.overrides import TorchFunctionMode

import kvtrace
from conftest import tiny_model
from kvtrace.cache import int8
from kvtrace.models import quant as q
from kvtrace.models.registry import make_decoder
from kvtrace.spec.tolerances import NOISE_MULTIPLE, Tolerance, judge, kv_tolerance
from kvtrace.tools import noise
from kvtrace.tools.noise import Float64Linear, PerturbedRunner, SplitKLinear
from kvtrace.tools.runners import DecoderRunner, EagerRunner, SessionRunner
from kvtrace.tools.verify import NoiseFloor, StepRow, render, verify
from kvtrace.tools.verify_kv import noise_floor, verify_by_cache


# --- the perturbations ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [Float64Linear, SplitKLinear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturbations_compute_the_same_product_in_another_order(mode, dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 96, dtype=dtype), torch.randn(40, 96, dtype=dtype), torch.randn(40, dtype=dtype)
    exact = F.linear(x.double(), w.double(), b.double())
    for bias in (None, b):
        with mode():
            got = F.linear(x, w, bias)
            also = torch.nn.functional.linear(x, w, bias=bias)  # keyword bias, the module path
        want = exact if bias is not None else F.linear(x.double(), w.double())
        assert got.dtype == dtype and got.shape == (3, 5, 40) and torch.equal(got, also)
        step = 2e-6 if dtype == torch.float32 else 2e-2  # a few roundings of the dtype, relative to |y|
        assert float((got.double() - want).abs().max()) <= step * float(want.abs().max())
    with mode():
        assert torch.equal(torch.relu(x), torch.relu(x))  # everything else is left alone


def test_float64_linear_differs_from_the_float32_sum_somewhere():
    """The point of a perturbation: the same product, rounded differently (else it measures nothing)."""
    torch.manual_seed(0)
    x, w = torch.randn(64, 576), torch.randn(192, 576)
    with Float64Linear():
        a = F.linear(x, w)
    with SplitKLinear():
        b = F.linear(x, w)
    ref = F.linear(x, w)
    assert not torch.equal(a, ref) and not torch.equal(b, ref)


# --- the route itself -------------------------------------------------------------------------------------
def test_judge_noise_floor_route():
    tol = Tolerance(atol=1e-4, rtol=0.0)
    b = torch.zeros(4)
    assert judge(b + 5e-5, b, tol, floor=1.0).route == "tolerance"
    j = judge(b + 0.5, b, tol, floor=0.3)  # 0.5 <= 1e-4 + 2 x 0.3
    assert j.passed and j.route == "noise floor" and j.floor_limit == pytest.approx(1e-4 + NOISE_MULTIPLE * 0.3)
    j = judge(b + 0.7, b, tol, floor=0.3)
    assert not j.passed and j.route == "" and "2 x noise floor 0.3" in j.describe("logits")
    assert j.loosest_limit == j.floor_limit
    assert not judge(b + 0.5, b, tol).passed  # no floor: the tolerance alone
    assert not judge(b + 0.5, b, tol, floor=math.inf).passed  # a floor that is not a number is not used
    assert not judge(b + math.nan, b, tol, floor=1.0).passed
    assert not judge(b + 0.5, b, tol, floor=0.0).passed  # floor 0: the plain tolerance


class Scripted:
    """A runner whose outputs are set by hand: logits and two layers' K/V at every step, the reference's plus
    ``offset`` (logits), ``kv0`` / ``kv1`` (layer 0 / layer 1 K)."""

    def __init__(self, name: str, offset: float = 0.0, kv0: float = 0.0, kv1: float = 0.0):
        self.name, self.offset, self.kv0, self.kv1 = name, offset, kv0, kv1
        self.reset()

    def reset(self) -> None:
        self.pos = 0

    def _out(self, t: int) -> torch.Tensor:
        self.pos += t
        logits = torch.zeros(1, t, 8)
        logits[..., 0] = 10.0  # token 0 everywhere, margin 10
        logits[..., 1] = torch.arange(self.pos - t, self.pos, dtype=torch.float32) / 10
        return logits + self.offset

    def prefill(self, tokens: torch.Tensor, **inputs: Any) -> torch.Tensor:
        return self._out(tokens.shape[1])

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        return self._out(1)

    def cache(self) -> list[Any]:
        k = torch.ones(1, 2, self.pos, 4)
        return [(k + self.kv0, k.clone()), (k + self.kv1, k.clone())]


def test_scripted_candidates_within_twice_the_floor_pass_beyond_fail():
    prompts, steps = ([1, 2, 3], [4, 5]), 3
    ref = Scripted("ref")
    floor = noise_floor_of(ref, [Scripted("n1", 0.10, kv1=0.05), Scripted("n2", -0.2, kv1=0.02)], prompts, steps)
    assert (floor.logits, floor.k, floor.v) == (pytest.approx(0.2), (0.0, pytest.approx(0.05)), (0.0, 0.0))
    cands = [Scripted("same", 0.0), Scripted("noisy", 0.35, kv1=0.09), Scripted("too-far", 0.45),
             Scripted("layer0", 0.0, kv0=0.01), Scripted("layer1", 0.0, kv1=0.12)]
    report = verify(ref, cands, prompts, steps=steps, floor=floor)
    s = {x["candidate"]: x for x in report.summary()}
    assert s["same"]["passed"] and s["same"]["judged_by"] == {"tolerance": 8}
    assert s["noisy"]["passed"] and s["noisy"]["judged_by"] == {"noise floor": 8}  # 0.35 <= 2 x 0.2 + tolerance
    assert all(r.rule == "noise floor" for r in report.rows if r.candidate == "noisy")
    assert not s["too-far"]["passed"] and "logits max abs 0.45" in s["too-far"]["first_failure"]
    assert "2 x noise floor 0.2" in s["too-far"]["first_failure"]
    # layer 0's floor is 0: its plain tolerance, however large the floor elsewhere
    assert not s["layer0"]["passed"] and "layer 0 K max abs 0.01" in s["layer0"]["first_failure"]
    assert not s["layer1"]["passed"] and "layer 1 K max abs 0.12" in s["layer1"]["first_failure"]
    assert all(x["noise_floor"]["logits"] == pytest.approx(0.2) for x in s.values())
    assert "noise_rule" in report.tolerance and "2 x the reference's own noise floor" in report.tolerance["noise_rule"]
    doc = json.loads(report.to_json())
    assert doc["noise_floors"]["noisy"]["k"] == [0.0, pytest.approx(0.05)]
    assert doc["summary"][1]["judged_by"] == {"noise floor": 8}
    assert {r["rule"] for r in doc["rows"] if r["candidate"] == "noisy"} == {"noise floor"}
    console = Console(record=True, width=260, color_system=None)
    console.print(render(report))
    text = console.export_text()
    assert "noise floor: logits / K/V (tokens)" in text and "0.2 / 0.05 (8/8)" in text
    assert "PASS (noise floor: 8/8 steps)" in text


def test_without_a_floor_the_rows_say_tolerance_and_nothing_changes():
    ref = Scripted("ref")
    report = verify(ref, [Scripted("noisy", 0.35)], ([1, 2],), steps=1)
    assert not report.passed and not report.floors and "noise_rule" not in report.tolerance
    (s,) = report.summary()
    assert s["noise_floor"] is None and s["judged_by"] == {}
    assert "noise_floors" not in json.loads(report.to_json())


def test_a_floor_from_a_failed_perturbed_run_is_none():
    rows = [StepRow("n", 0, "prefill", 3, math.inf, math.inf, 0.0, False, (math.inf,), (math.inf,), False, False, "x")]
    assert NoiseFloor.from_rows(rows, ["float64-linear"]) is None


def noise_floor_of(ref: Any, runs: list[Any], prompts: Any, steps: int) -> NoiseFloor:
    floor = NoiseFloor.from_rows(verify(ref, runs, prompts, steps=steps).rows, [r.name for r in runs])
    assert floor is not None
    return floor


# --- tiny models: rounding flips pass on the floor, planted faults still fail ------------------------------
def round_jitter(seed: int, delta: float) -> type[TorchFunctionMode]:
    """A perturbation at the rounding steps themselves: each ``torch.round`` input moved by +-delta (in units of
    the step: the int8 cache's and 8da4w's ``round(x / scale)``), a fixed random sign per element. Real ulp noise
    flips too few roundings on 2-layer random models to leave the fixed tolerance (measured: a 4-8 layer,
    hidden-256 tiny Llama's float64 / split-k floor is 1e-5..2e-4 on the logits, inside it), so the test makes
    the same kind of noise larger: only values within delta of a tie flip, each by one step."""

    class RoundJitter(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is not torch.round:
                return func(*args, **(kwargs or {}))
            x = args[0]
            gen = torch.Generator().manual_seed(seed * 1000 + x.numel())
            sign = torch.randint(0, 2, x.shape, generator=gen).to(x.dtype) * 2 - 1
            return torch.round(x + delta * sign)

    return RoundJitter


INT8_PROMPTS = ([5, 17, 42, 8, 99, 3, 64, 7], [3, 11, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18])
STEPS, MAX_SEQ_LEN = 20, 48


@pytest.fixture
def jittered(monkeypatch):
    """Candidates built with round jitter 3; the floor then measured with round jitters 1 and 2 (another sample
    of the same noise: ``PERTURBATIONS`` lists only those when verify runs)."""
    modes = {f"round-jitter-{i}": round_jitter(i, 0.1) for i in (1, 2, 3)}

    def candidate(decoder: torch.nn.Module) -> PerturbedRunner:
        monkeypatch.setattr(noise, "PERTURBATIONS", modes)
        runner = PerturbedRunner(DecoderRunner(decoder, "decoder"), "round-jitter-3")
        monkeypatch.setattr(noise, "PERTURBATIONS", {k: m for k, m in modes.items() if k != "round-jitter-3"})
        return runner

    return candidate


def test_int8_cache_rounding_flips_pass_on_the_floor_and_a_stale_scale_still_fails(jittered, monkeypatch, tmp_path):
    model = tiny_model("llama")

    def cand() -> PerturbedRunner:
        return jittered(make_decoder(model, max_seq_len=MAX_SEQ_LEN, kv_dtype="int8"))

    fixed = verify_by_cache(model, EagerRunner(model), [cand()], INT8_PROMPTS, steps=STEPS, floor=False)
    assert not fixed.passed, "the flips must leave the fixed tolerance, else this test tests nothing"
    (s,) = fixed.summary()
    assert s["kv_max_abs"] > 0 and s["noise_floor"] is None and "noise_rule" not in fixed.tolerance

    # the planted int8 fault (scales never written) next to it, judged with the floor in force
    real = int8.write
    monkeypatch.setattr(int8, "write", _skips_the_scales)
    kvtrace.export(model, tmp_path / "bad.kvt", max_seq_len=MAX_SEQ_LEN, kv_dtype="int8", prefill_logits="last",
                   backend="exported")
    monkeypatch.setattr(int8, "write", real)
    bad = SessionRunner(kvtrace.load(tmp_path / "bad.kvt").session(), "stale-scales")
    good = cand()
    report = verify_by_cache(model, EagerRunner(model), [good, bad], INT8_PROMPTS, steps=STEPS)
    s = {x["candidate"]: x for x in report.summary()}
    floor = report.floors[good.name]
    assert floor is not None and floor.kv > 0 and floor.logits > 0  # the reference flips under the jitter too
    assert floor.perturbations == ("round-jitter-1", "round-jitter-2") and report.floors["stale-scales"] == floor
    assert s[good.name]["passed"] and "noise floor" in s[good.name]["judged_by"], s[good.name]["first_failure"]
    fail = report.first_failure("stale-scales")
    assert fail is not None and (fail.prompt, fail.step) == (0, "prefill") and "layer 0 K" in fail.failure, fail


def test_the_real_perturbations_on_a_tiny_model_give_an_ulp_sized_floor():
    """float64 and split-k sums over one shared decoder (two more Sessions, no second copy of the weights): on a
    2-layer random model they move the logits by float32 rounding only and flip at most an int8 step."""
    model = tiny_model("llama")
    ref = DecoderRunner(make_decoder(model, max_seq_len=MAX_SEQ_LEN, kv_dtype="int8"))
    floor = noise_floor(ref, INT8_PROMPTS, steps=4, kv_dtype="int8")
    assert floor is not None and floor.perturbations == ("float64-linear", "split-k-linear")
    assert floor.logits < 1e-5 and floor.tokens_agree == floor.steps == 2 * 5
    one_step = kv_tolerance(torch.float32, "int8").rtol * 50  # |K|, |V| of this model stay below 50
    assert len(floor.k) == 2 and floor.kv <= one_step


def test_a_floor_for_last_position_candidates_is_taken_over_the_same_logits(monkeypatch):
    """Artifacts that return only the prefill's last position are compared there: the floor of their logits is
    measured there too (over all positions it could only be larger)."""
    monkeypatch.setattr(noise, "PERTURBATIONS", {"round-jitter-1": round_jitter(1, 0.1)})
    ref = DecoderRunner(make_decoder(tiny_model("llama"), max_seq_len=MAX_SEQ_LEN, kv_dtype="int8"))
    every = noise_floor(ref, INT8_PROMPTS, steps=2, kv_dtype="int8")
    last = noise_floor(ref, INT8_PROMPTS, steps=2, kv_dtype="int8", prefill_logits="last")
    assert every is not None and last is not None and 0 < last.logits <= every.logits
    assert (last.k, last.v) == (every.k, every.v)  # the cache is compared alike


def _skips_the_scales(kind, k_cache, v_cache, scales, input_pos, k, v):
    """Planted fault: the values are written, the scales are not."""
    (qk, _), (qv, _) = int8.quantize(k), int8.quantize(v)
    kind.write(k_cache, v_cache, input_pos, qk, qv)


def test_8da4w_floor_in_force_a_wrong_group_size_still_fails(jittered, monkeypatch, tmp_path):
    """8da4w rounds every activation row to int8: with the floor measured (jittered roundings), a candidate
    that flips other roundings passes and an artifact packing groups of 64 while recording 32 fails."""
    model = tiny_model("llama")
    decoder = make_decoder(model, max_seq_len=MAX_SEQ_LEN)
    spec = q.quantize_decoder(decoder, q.QuantSpec("8da4w", 32), reference=True)
    good = jittered(decoder)
    good.session.quant = spec  # what an artifact's Session carries: verify picks the reference from it
    real = q.quantize_int4
    monkeypatch.setattr(q, "quantize_int4", lambda w, g, symmetric=False: real(w, 64, symmetric))
    real_init = q.Int4Linear.__init__
    monkeypatch.setattr(q.Int4Linear, "__init__", lambda self, w, sz, g, b, act_int8=False:
                        real_init(self, w, sz, 64, b, act_int8))
    kvtrace.export(model, tmp_path / "g64.kvt", max_seq_len=MAX_SEQ_LEN, quant="8da4w", prefill_logits="last",
                   backend="exported")
    monkeypatch.setattr(q, "quantize_int4", real)
    monkeypatch.setattr(q.Int4Linear, "__init__", real_init)
    bad = kvtrace.load(tmp_path / "g64.kvt")
    assert bad.manifest.quant.group_size == 32
    report = verify_by_cache(model, EagerRunner(model), [good, SessionRunner(bad.session(), "wrong-group")],
                             INT8_PROMPTS, steps=STEPS)
    s = {x["candidate"]: x for x in report.summary()}
    floor = report.floors["wrong-group"]
    assert floor is not None and floor.logits > 0 and floor.kv > 0
    assert s[good.name]["passed"], s[good.name]["first_failure"]
    assert s[good.name]["reference"] == s["wrong-group"]["reference"] == "decoder-eager-8da4w-g32"
    fail = report.first_failure("wrong-group")
    assert fail is not None and (fail.prompt, fail.step) == (0, "prefill") and "layer 0" in fail.failure, fail
