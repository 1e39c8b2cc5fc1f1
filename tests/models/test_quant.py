"""Quantized weights (kvtrace.models.quant, spec.quant): the quantizers and kernel layouts, GGUF blocks kept as
stored (from tiny GGUFs written with the gguf package), export + verify against the same quantized weights eager
for each scheme x backend, planted faults (a wrong group size, a dropped zero point) failing verify, the manifest
record and the refusals."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kvtrace
from conftest import tiny_model
from helpers import package_libraries, write_gguf
from kvtrace._errors import ArtifactError, UnsupportedError, UsageError
from kvtrace.models import quant as q
from kvtrace.models.registry import make_decoder
from kvtrace.spec.quant import QuantSpec, parse_quant
from kvtrace.tools.runners import EagerRunner, SessionRunner
from kvtrace.tools.verify_kv import verify_by_cache

PROMPTS = ([5, 17, 42, 8, 99, 3, 64, 7], [3, 11, 2, 4, 5, 6, 7])
GGUF_PROMPTS = ([1, 3, 4, 5, 3, 7], [1, 6, 5])  # write_gguf's vocabulary has 8 tokens
STEPS, MAX_SEQ_LEN = 12, 32
SCHEMES = ("int8", "int4", "8da4w")


# --- quantizers and layouts --------------------------------------------------------------------------
def test_int4_kernel_computes_the_dequantized_weight():
    """aten._weight_int4pack_mm_for_cpu over pack_int4's layout is (q - 8) * scale + zero, group by group."""
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    for g in (32, 64, 128):
        qv, scale, zero = q.quantize_int4(w, g)
        assert qv.dtype == torch.uint8 and int(qv.max()) <= 15 and scale.shape == (48, 128 // g)
        deq = q.dequantize_int4(qv, scale, zero)
        assert float((deq - w).abs().max()) <= float(scale.float().max()) * 0.51 + 1e-2  # half a step (+ bf16 zero)
        packed, sz = q.pack_int4(qv, scale, zero)
        eye = torch.eye(128, dtype=torch.bfloat16)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, g, sz).t().float()  # [48, 128] bf16 weights
        assert torch.equal(got, deq.to(torch.bfloat16).float()), g


def test_int8_rows_and_symmetric_int4():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    qv, scale = q.quantize_int8(w)
    assert qv.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (16,)
    assert float((qv.float() * scale.float()[:, None] - w).abs().max()) <= float(scale.float().max()) / 2 + 1e-6
    q4, _, z4 = q.quantize_int4(w, 32, symmetric=True)
    assert float(z4.abs().max()) == 0 and int(q4.min()) >= 0 and int(q4.max()) <= 15


def test_gguf_linear_decode_and_prefill_paths_agree_with_the_dequantized_weight():
    torch.manual_seed(0)
    n, k = 24, 96
    d = (torch.rand(n, k // 32) * 0.01).half()
    m = (torch.randn(n, k // 32) * 0.01).half()
    x1, x5 = torch.randn(1, 1, k), torch.randn(1, 5, k)
    for fmt, qv, mm in (("q4_1", torch.randint(0, 16, (n, k // 32, 32), dtype=torch.uint8), m),
                        ("q4_0", torch.randint(0, 16, (n, k // 32, 32), dtype=torch.uint8), None),
                        ("q8_0", torch.randint(-128, 128, (n, k // 32, 32), dtype=torch.int8), None)):
        lin = q.GGUFLinear(fmt, qv, d, mm, None)
        w = lin.dequantized()
        off = 8 if fmt == "q4_0" else 0
        expect = (qv.float() - off) * d.float()[..., None] + (0 if mm is None else mm.float()[..., None])
        assert torch.equal(w, expect.reshape(n, k))
        torch.testing.assert_close(lin(x1), F.linear(x1, w), rtol=1e-5, atol=1e-6)  # the one-row (decode) path
        x3 = torch.randn(3, 1, k)  # a slots decode: 3 rows of one token, each through the one-row path
        assert torch.equal(lin(x3), torch.cat([lin(x3[i : i + 1]) for i in range(3)]))
        torch.testing.assert_close(lin(x3), F.linear(x3, w), rtol=1e-5, atol=1e-6)
        assert torch.equal(lin(x5), x5 @ w.t())  # prefill: the dequantized weight itself
        assert lin.q.shape[0] == 1 and lin.q.shape[-1] == 32  # 24 rows padded to one tile of 32 outputs
        tokens = torch.tensor([[0, 23, 7], [31 % n, 5, 0]])
        assert torch.equal(q.GGUFEmbedding(lin, torch.float32)(tokens), w[tokens])  # the tied table's rows


# --- GGUF blocks --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def q41_gguf(tmp_path_factory) -> Path:
    """Blocks Q4_1 (the default model's type), the tied embedding Q8_0, one down projection Q4_0, one F16."""
    return write_gguf(tmp_path_factory.mktemp("gguf") / "q41.gguf", qtype="Q4_1", embd_qtype="Q8_0",
                      qtypes={"blk.1.ffn_down.weight": "Q4_0", "blk.1.attn_output.weight": "F16"})


def test_gguf_blocks_are_found_for_fused_and_permuted_decoder_weights(q41_gguf):
    """Every kept decoder weight gets the GGUF's own blocks (q/k rows permuted back by transformers and fused with
    v, gate fused with up), and they dequantize to the converted weight bit for bit; an F16 tensor is reported."""
    from kvtrace.sources.gguf_blocks import GGUFBlocks
    from kvtrace.sources.load import load_model

    lm = load_model(q41_gguf)
    decoder = make_decoder(lm.model, max_seq_len=16)
    spec = q.quantize_decoder(decoder, parse_quant("gguf"), gguf=GGUFBlocks(q41_gguf))
    assert spec.tensors == {
        "layers.0.wqkv": "q4_1", "layers.0.wo": "q4_1", "layers.0.w13": "q4_1", "layers.0.w2": "q4_1",
        "layers.1.wqkv": "q4_1", "layers.1.w13": "q4_1", "layers.1.w2": "q4_0",
        "tok_embeddings": "q8_0", "output": "tied:tok_embeddings"}
    assert list(spec.dequantized) == ["layers.1.wo"] and "F16" in spec.dequantized["layers.1.wo"]
    plain = make_decoder(lm.model, max_seq_len=16)
    assert torch.equal(decoder.layers[0].wqkv.dequantized(), plain.layers[0].wqkv.weight)
    assert torch.equal(decoder.layers[1].w2.dequantized(), plain.layers[1].w2.weight)
    assert decoder.tok_embeddings.q.data_ptr() == decoder.output.q.data_ptr()  # the tied head: stored once
    tokens = torch.tensor([[1, 3, 5, 7]])
    assert torch.equal(decoder.tok_embeddings(tokens), plain.tok_embeddings(tokens))


def test_gguf_quant_needs_a_gguf_source(tmp_path):
    with pytest.raises(UnsupportedError, match="not loaded from a GGUF"):
        kvtrace.export(tiny_model("llama"), tmp_path / "m.kvt", max_seq_len=16, quant="gguf")
    assert not (tmp_path / "m.kvt").exists()


# --- export + verify against the same quantized weights -------------------------------------------------
def _export(source: Any, path: Path, quant: str, backend: str = "exported", **kw: Any) -> Any:
    kvtrace.export(source, path, max_seq_len=MAX_SEQ_LEN, backend=backend, quant=quant, prefill_logits="last", **kw)
    return kvtrace.load(path)


def _verify(model: torch.nn.Module, *cands: tuple[str, Any], prompts: Any = PROMPTS) -> Any:
    runners = [SessionRunner(art.session(), name) for name, art in cands]
    return verify_by_cache(model, EagerRunner(model), runners, prompts, steps=STEPS)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def exported(llama, tmp_path_factory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("quant")
    return {s: _export(llama, d / f"{s}.kvt", s) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_exported_quantized_artifact_verifies_against_the_same_quantized_weights(scheme, llama, exported):
    art = exported[scheme]
    report = _verify(llama, (scheme, art))
    assert report.passed, [f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    assert {r.reference for r in report.rows} == {f"decoder-eager-{art.manifest.quant.key}"}  # from the manifest
    assert "quant_rule" in report.tolerance
    (s,) = report.summary()
    assert s["tokens_agree"] == s["steps"] and s["logits_max_abs"] <= 0.05
    # vs the unquantized model: measured, not judged, and not zero (the weights did change)
    (u,) = report.vs_fp32.unjudged()
    assert u["logits_max_abs"] > 1e-4


@pytest.mark.parametrize("scheme", SCHEMES)
def test_manifest_records_every_quantized_module_and_no_float_copy_is_stored(scheme, llama, exported):
    art = exported[scheme]
    qs = art.manifest.quant
    assert qs.scheme == scheme and qs.head and qs.group_size == (None if scheme == "int8" else 32)
    linears = {f"layers.{i}.{n}" for i in range(2) for n in ("wqkv", "wo", "w13", "w2")}
    fmt = {"int8": "int8", "int4": "int4", "8da4w": "int4-sym"}[scheme]
    assert not llama.config.tie_word_embeddings  # the head is its own int8 matrix
    assert qs.tensors == {**dict.fromkeys(linears, fmt), "tok_embeddings": "int8", "output": "int8"}
    w = art.manifest.weights
    assert not any(meta["dtype"] == "float32" and name.endswith(".weight") and "norm" not in name
                   for name, meta in w.items()), w
    assert w["tok_embeddings.weight"]["dtype"] == w["output.weight"]["dtype"] == "int8"
    assert QuantSpec.from_dict(qs.to_dict()) == qs


def test_a_tied_head_shares_the_embeddings_int8_table(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    art = _export(model, tmp_path / "tied.kvt", "int4")
    assert art.manifest.quant.tensors["output"] == "tied:tok_embeddings"
    stored, aliases = art.manifest.weights, art.manifest.weight_aliases
    assert aliases == {"tok_embeddings.weight": "output.weight", "tok_embeddings.scale": "output.scale"}  # stored once
    assert stored["output.weight"]["dtype"] == "int8" and "tok_embeddings.weight" not in stored
    assert _verify(model, ("tied", art)).passed


def test_quantized_artifacts_are_smaller(llama, exported, tmp_path):
    plain = _export(llama, tmp_path / "plain.kvt", "none")
    size = {s: exported[s].path.stat().st_size for s in SCHEMES}
    assert plain.manifest.quant is None
    weights = {s: sum(_nbytes(m) for m in exported[s].manifest.weights.values()) for s in SCHEMES}
    fp32 = sum(_nbytes(m) for m in plain.manifest.weights.values())
    # the tiny model's weights are tiny next to its RoPE tables and norms: check the quantized tensors' share
    assert weights["int4"] < weights["int8"] < fp32 and size["int4"] < size["int8"] < plain.path.stat().st_size


def _nbytes(meta: dict) -> int:
    n = 1
    for d in meta["shape"]:
        n *= d
    return n * torch.empty(0, dtype=getattr(torch, meta["dtype"])).element_size()


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_gguf_native_export_verifies_exactly_against_the_dequantized_gguf(kind, tmp_path):
    """GGUF blocks kept as stored: verified in float32 against eager over the dequantized GGUF weights."""
    from kvtrace.sources.load import load_model

    path = write_gguf(tmp_path / f"{kind}.gguf", qtype=kind, embd_qtype=kind)
    art = _export(str(path), tmp_path / "g.kvt", "gguf")
    qs = art.manifest.quant
    assert set(qs.tensors.values()) == {kind.lower(), "tied:tok_embeddings"} and not qs.dequantized
    assert {m["dtype"] for n, m in art.manifest.weights.items() if n.endswith((".q", ".d", ".m"))} <= {
        "uint8", "int8", "float16"}
    model = load_model(path).model
    report = _verify(model, ("gguf", art), prompts=GGUF_PROMPTS)
    assert report.passed, [r.failure for r in report.rows if not r.passed]
    assert report.tolerance["atol"] == "0.0001"  # the float32 tolerance: same numbers, float32 arithmetic
    (s,) = report.summary()
    assert s["reference"] == "decoder-eager-gguf" and s["logits_max_abs"] < 1e-4 and s["tokens_agree"] == s["steps"]
    assert not report.floors and s["noise_floor"] is None  # float32 blocks, no rounding step: no noise floor


def test_a_gguf_native_slots_artifact_answers_as_solo_runs(q41_gguf, tmp_path):
    """kvtrace serve over GGUF blocks: a slots decode runs every row through the one-token path (x [R, 1, K]),
    float32 as a solo run's, so each request's greedy answer is the solo one, requests joining mid-stream."""
    from tests.runtime.test_slots import run_staggered

    from kvtrace.runtime.generate import generate
    from kvtrace.runtime.slots import SlotRequest

    solo = _export(str(q41_gguf), tmp_path / "solo.kvt", "gguf")
    art = _export(str(q41_gguf), tmp_path / "slots.kvt", "gguf", slots=3)
    assert art.manifest.quant.scheme == "gguf" and art.manifest.programs["decode"].slots
    prompts = ([1, 3, 4, 5, 3, 7], [1, 6, 5], [2, 2, 7, 1, 3, 3, 4, 6, 5], [4])
    maxes = (10, 14, 6, 12)
    out = run_staggered(art.slot_engine(), [SlotRequest(p, max_tokens=n) for p, n in zip(prompts, maxes, strict=True)],
                        join_every=1)
    for i, (p, n) in enumerate(zip(prompts, maxes, strict=True)):
        assert out[i] == generate(solo.session(), p, max_new_tokens=n).tokens, f"request {i}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_gguf_native_export_verifies_exactly_for_the_other_gguf_families(arch, tmp_path):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms, head_dim 128) and Phi-3 (fused q/k/v and gate/up) GGUFs keep their
    blocks too, with the same numbers as eager over the dequantized weights (``--quant auto`` picks them)."""
    from kvtrace.sources.load import load_model

    path = write_gguf(tmp_path / f"{arch}.gguf", arch, qtype="Q4_1", embd_qtype="Q8_0")
    art = _export(str(path), tmp_path / "g.kvt", "gguf")
    qs = art.manifest.quant
    assert set(qs.tensors.values()) == {"q4_1", "q8_0", "tied:tok_embeddings"} and not qs.dequantized
    model = load_model(path).model
    report = _verify(model, ("gguf", art), prompts=GGUF_PROMPTS)
    assert report.passed, [r.failure for r in report.rows if not r.passed]
    (s,) = report.summary()
    assert s["logits_max_abs"] < 1e-4 and s["tokens_agree"] == s["steps"]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_gguf_native_aoti_artifacts_of_the_other_families_verify(arch, tmp_path):
    from kvtrace.sources.load import load_model

    path = write_gguf(tmp_path / f"{arch}.gguf", arch, qtype="Q4_1")
    art = _export(str(path), tmp_path / "g.kvt", "gguf", "aoti")
    report = _verify(load_model(path).model, ("aoti", art), prompts=GGUF_PROMPTS)
    assert report.passed, [f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    (s,) = report.summary()
    assert s["tokens_agree"] == s["steps"]


# --- planted faults -----------------------------------------------------------------------------------
def test_planted_wrong_group_size_fails_verify(llama, exported, tmp_path, monkeypatch):
    """The artifact quantizes and packs groups of 64 while recording 32: verify (reference rebuilt from the
    manifest) fails."""
    real = q.quantize_int4
    monkeypatch.setattr(q, "quantize_int4", lambda w, g, symmetric=False: real(w, 64, symmetric))
    real_init = q.Int4Linear.__init__
    monkeypatch.setattr(q.Int4Linear, "__init__", lambda self, w, sz, g, b, act_int8=False:
                        real_init(self, w, sz, 64, b, act_int8))
    bad = _export(llama, tmp_path / "g64.kvt", "int4")
    monkeypatch.undo()
    assert bad.manifest.quant.group_size == 32
    report = _verify(llama, ("int4", exported["int4"]), ("wrong-group", bad))
    assert report.first_failure("int4") is None
    fail = report.first_failure("wrong-group")
    assert fail is not None and (fail.prompt, fail.step) == (0, "prefill"), fail
    assert report.floors["wrong-group"] is not None  # failed with the reference's noise floor in force


def test_planted_dropped_zero_point_fails_verify(llama, exported, tmp_path, monkeypatch):
    real = q.pack_int4
    monkeypatch.setattr(q, "pack_int4", lambda qv, s, z: real(qv, s, torch.zeros_like(z)))
    bad = _export(llama, tmp_path / "nozero.kvt", "int4")
    monkeypatch.undo()
    report = _verify(llama, ("no-zero", bad))
    fail = report.first_failure("no-zero")
    assert fail is not None and (fail.prompt, fail.step) == (0, "prefill") and "layer 0" in fail.failure, fail
    assert report.floors["no-zero"] is not None


def test_planted_dropped_gguf_min_fails_verify(tmp_path, monkeypatch):
    from kvtrace.sources.load import load_model

    path = write_gguf(tmp_path / "q41.gguf", qtype="Q4_1")
    real = q.GGUFLinear.__init__
    monkeypatch.setattr(q.GGUFLinear, "__init__", lambda self, fmt, qv, d, m, b: real(self, fmt, qv, d, None, b))
    bad = _export(str(path), tmp_path / "nomin.kvt", "gguf")
    monkeypatch.undo()
    report = _verify(load_model(path).model, ("no-min", bad), prompts=GGUF_PROMPTS)
    assert report.first_failure("no-min") is not None
    assert "no-min" not in report.floors  # GGUF blocks: the float32 tolerance, no noise floor


# --- refusals and the record -------------------------------------------------------------------------
def test_refusals(tmp_path):
    with pytest.raises(UsageError, match="quant must be one of"):
        parse_quant("int3")
    with pytest.raises(UsageError, match="group_size must be one of"):
        parse_quant("int4", group_size=48)
    with pytest.raises(UsageError, match="per output channel"):
        parse_quant("int8", group_size=32)
    with pytest.raises(UnsupportedError, match="does not take quantized weights"):
        kvtrace.export(tiny_model("gpt_neox"), tmp_path / "n.kvt", max_seq_len=16, quant="int8")
    with pytest.raises(UnsupportedError, match="computed by CPU kernels only"):  # refused before any GPU is looked for
        kvtrace.export(tiny_model("llama"), tmp_path / "c.kvt", max_seq_len=16, quant="int4", device="cuda")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("scheme", ["int4", "8da4w"])
def test_a_group_size_that_would_leave_layers_in_float32_is_refused_naming_the_ones_that_fit(scheme):
    """SmolLM2 (dim 576) at group size 128 quantized 30 of 120 linears and kept 90 in float32 without a word: a
    347 MiB "8da4w" artifact. Refused, before any capture, where another group size divides every layer."""
    decoder = make_decoder(tiny_model("llama"), max_seq_len=16)  # in_features 64 (hidden) and 128 (mlp)
    with pytest.raises(UsageError, match=r"group_size 128 would leave 6 of 8 linear layers in float32: their "
                                         r"in_features \(64 in layers.0.\w+\).*divide every layer: \[32, 64\]"):
        q.quantize_decoder(decoder, parse_quant(scheme, group_size=128))


def test_layers_no_group_size_fits_stay_float32_and_are_recorded():
    """in_features 80 (the MLP's) fits no offered group size: those layers stay float32, recorded with why."""
    decoder = make_decoder(tiny_model("llama", intermediate_size=80), max_seq_len=16)
    done = q.quantize_decoder(decoder, parse_quant("int4"))
    assert set(done.dequantized) == {"layers.0.w2", "layers.1.w2"}
    assert all("not a multiple of group_size 32" in why for why in done.dequantized.values())
    assert type(decoder.layers[0].w2) is nn.Linear and done.tensors["layers.0.wqkv"] == "int4"


def test_quant_spec_from_a_forged_manifest_is_an_artifact_error():
    with pytest.raises(ArtifactError, match="manifest quant"):
        QuantSpec.from_dict({"scheme": "int4"})
    with pytest.raises(ArtifactError, match="group_size"):
        QuantSpec.from_dict({"scheme": "int4", "group_size": 7, "head": True, "tensors": {}, "dequantized": {}})


def test_a_backends_own_activations_are_recorded_checked_and_keyed():
    spec = QuantSpec("8da4w", 32, act="int8-asym")
    assert spec.activations == "int8-asym" and spec.key == "8da4w-g32-int8-asym" != parse_quant("8da4w").key
    assert QuantSpec.from_dict(spec.to_dict()) == spec
    assert "act" not in parse_quant("8da4w").to_dict()  # other manifests read and write as before
    for scheme, act in (("int4", "int8-asym"), ("8da4w", "int8-dynamic"), ("8da4w", "fp8")):
        with pytest.raises(UsageError, match="not a combination"):
            QuantSpec(scheme, 32, act=act)
    with pytest.raises(ArtifactError, match="manifest quant"):
        QuantSpec.from_dict({**spec.to_dict(), "act": 8})


def test_8da4w_for_xnnpack_computes_its_reference_exactly():
    """``DynQuantLinear`` (the executorch backend's 8da4w) and verify's reference, eager: the same numbers."""
    torch.manual_seed(0)
    spec = QuantSpec("8da4w", 32, act="int8-asym")
    dec, ref = (make_decoder(tiny_model("llama"), max_seq_len=16) for _ in range(2))
    got = q.quantize_decoder(dec, spec)
    q.quantize_decoder(ref, got, reference=True)
    assert got.act == "int8-asym" and got.int4_layout is None  # XNNPACK packs the weights itself
    assert {type(m).__name__ for m in dec.modules()} >= {"DynQuantLinear", "Int8Embedding"}
    tokens, pos = torch.tensor([[5, 17, 42, 8]]), torch.arange(4)
    a = dec(tokens, pos, *dec.cache_spec.allocate())
    b = ref(tokens, pos, *ref.cache_spec.allocate())
    assert torch.equal(a, b)
    lin = next(m for m in dec.modules() if isinstance(m, q.DynQuantLinear) and m.group_size == 32)
    assert lin.weight.dtype == torch.int8 and -8 <= int(lin.weight.min()) and int(lin.weight.max()) <= 7
    x = torch.randn(3, lin.weight.shape[1]) * 4 + 1
    rows = q.dynamic_int8_rows(x)  # each row on 255 steps of its own range (widened to hold 0)
    step = (x.amax(1).clamp(min=0) - x.amin(1).clamp(max=0)) / 255
    assert bool(((rows - x).abs() <= step[:, None] / 2 + 1e-6).all())


def test_artifact_cache_keys_on_the_quantization():
    from kvtrace.artifact.store import artifact_key

    keys = {artifact_key("d", backend="aoti", max_seq_len=64, dtype="float32", batch_size=1,
                         quant=None if s == "none" else parse_quant(s).key) for s in ("none", *SCHEMES, "gguf")}
    assert len(keys) == 5
    assert parse_quant("int4", 64).key != parse_quant("int4").key != parse_quant("int4", head=False).key


def test_head_can_stay_in_float(llama, tmp_path):
    art = _export(llama, tmp_path / "nohead.kvt", "int4", quant_head=False)
    assert "tok_embeddings" not in art.manifest.quant.tensors
    assert art.manifest.weights["tok_embeddings.weight"]["dtype"] == "float32"
    assert _verify(llama, ("int4-nohead", art)).passed


def test_template_ops_capture_int4_linears_with_the_op_inductor_s_template_lowers_and_restore_them():
    """aoti-packed captures Int4Linear with aten._weight_int4pack_mm_for_cpu (Inductor's int4 GEMM template lowers
    it; the weights are frozen in the library); every other capture keeps the quantized op (group size a buffer)."""
    torch.manual_seed(0)
    qv, scale, zero = q.quantize_int4(torch.randn(64, 128), 32)
    mod = nn.Sequential(q.Int4Linear(*q.pack_int4(qv, scale, zero), 32, None)).eval()
    x = torch.randn(3, 128)

    def ops() -> set[str]:
        ep = torch.export.export(mod, (x,))
        return {str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "int4" in str(n.target)}

    plain = mod(x)
    assert ops() == {"quantized.int4mm_packed_weight_cpu.default"}
    with q.template_ops(mod):
        assert ops() == {"aten._weight_int4pack_mm_for_cpu.default"}
        assert torch.equal(mod(x), plain)  # the same kernel underneath
    assert ops() == {"quantized.int4mm_packed_weight_cpu.default"} and "template_op" not in mod[0].__dict__
    with pytest.raises(RuntimeError), q.template_ops(mod):
        raise RuntimeError("capture failed")
    assert mod[0].template_op is False


# --- compiled backends ----------------------------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("backend", ["aoti", "aoti-packed"])
@pytest.mark.parametrize("scheme", [*SCHEMES, "gguf"])
def test_compiled_quantized_artifacts_verify(scheme, backend, llama, q41_gguf, tmp_path):
    from kvtrace.sources.load import load_model

    if scheme == "gguf" and backend == "aoti-packed":
        with pytest.raises(UnsupportedError, match="fold the GGUF blocks into float32"):
            _export(str(q41_gguf), tmp_path / "c.kvt", scheme, backend)
        return

    source, model = (str(q41_gguf), load_model(q41_gguf).model) if scheme == "gguf" else (llama, llama)
    art = _export(source, tmp_path / "c.kvt", scheme, backend)
    assert art.manifest.quant.scheme == scheme
    if backend == "aoti-packed":  # decode on its own one-token program (templates specialized for one row)
        own = scheme in ("int8", "int4", "8da4w")
        assert art.manifest.programs["decode"].served_by == (None if own else "prefill")
        assert set(package_libraries(tmp_path / "c.kvt")) == set(art.manifest.signatures) == (
            {"step", "decode"} if own else {"step"})
        if own:
            assert art.manifest.signatures["decode"][0]["shape"] == [1, 1]  # tokens [B, 1]
    report = _verify(model, (backend, art), prompts=GGUF_PROMPTS if scheme == "gguf" else PROMPTS)
    assert report.passed, [f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    (s,) = report.summary()
    assert s["tokens_agree"] == s["steps"]


def test_export_says_which_weights_stay_float(tmp_path):
    said = []

    def progress(what):
        said.append(what)
        return contextlib.nullcontext()

    kvtrace.export(tiny_model("llama", intermediate_size=80), tmp_path / "m.kvt", max_seq_len=16, backend="exported",
                   quant="int4", progress=progress)
    [line] = [w for w in said if "kept in" in w]
    assert "kept in float32: layers.0.w2 (in_features 80 is not a multiple of group_size 32) and 1 more" in line
