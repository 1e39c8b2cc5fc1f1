"""One-row linears as Inductor reductions (``backends/one_row``): which programs get them (backend ``aoti`` on AMD
CPUs, float32 / bfloat16, a decoder mostly of ``nn.Linear``: decode then compiled on its own), what the rewrite
changes in a graph (only linears over one static row) and that the compiled decode computes eager's numbers
without calling ATen's matmul."""

from __future__ import annotations

import re

import pytest
import torch

import kvtrace
from conftest import tiny_model
from helpers import package_libraries
from kvtrace.artifact.export import from_source
from kvtrace.backends import aoti, one_row, registry
from kvtrace.models.quant import Int8Linear, quantize_decoder, quantize_int8
from kvtrace.models.step import LIVE_PROGRAMS
from kvtrace.spec.quant import parse_quant

MAX_SEQ_LEN = 32


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 24)  # with a bias
        self.b = torch.nn.Linear(24, 8, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _linears(gm) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default))


@pytest.mark.parametrize("shape", [(1, 1, 16), (1, 16)])
def test_one_row_linears_become_reductions_with_the_same_numbers(shape):
    torch.manual_seed(0)
    model, x = _Two().eval(), torch.randn(*shape)
    gm = torch.export.export(model, (x,)).module()
    assert one_row.rewrite(gm) == 2 and _linears(gm) == 0
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.sum.dim_IntList in ops and torch.ops.aten.mm.default not in ops
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


def test_linears_over_several_or_symbolic_rows_keep_atens_matmul():
    model = _Two().eval()
    gm = torch.export.export(model, (torch.randn(1, 3, 16),)).module()  # three static rows
    assert one_row.rewrite(gm) == 0 and _linears(gm) == 2
    t = torch.export.Dim("T", min=1, max=32)
    gm = torch.export.export(model, (torch.randn(1, 3, 16),), dynamic_shapes=({1: t},)).module()  # prefill's T
    assert one_row.rewrite(gm) == 0 and _linears(gm) == 2


def test_a_reductions_input_row_is_computed_into_a_buffer_first():
    """The row is passed through ``as_strided`` to its own layout (the same values) before the reduction reads it:
    Inductor computes it into a buffer once instead of inlining its producer into every output's sum."""
    model = _Two().eval()
    gm = torch.export.export(model, (torch.randn(1, 1, 16),)).module()
    one_row.rewrite(gm)
    rows = [n.args[0] for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.unsqueeze.default)]
    assert len(rows) == 2 and all(r.target is torch.ops.aten.as_strided.default for r in rows)


class _Int8(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = Int8Linear(*quantize_int8(torch.randn(40, 64)), None)  # [N 40, K 64]

    def forward(self, x):
        return self.a(torch.relu(x) + 1)


def test_a_one_row_int8_matmul_becomes_a_reduction_with_the_kernels_numbers():
    """``aten._weight_int8pack_mm`` over one static row: a reduction over the int8 weight, float32 accumulation,
    the output rounded to bf16 as the kernel's; over three rows the kernel stays."""
    model, x = _Int8().eval(), torch.randn(1, 1, 64)
    gm = torch.export.export(model, (x,)).module()
    kernel = torch.ops.aten._weight_int8pack_mm.default
    assert one_row.rewrite(gm) == 1 and not gm.graph.find_nodes(op="call_function", target=kernel)
    got, want = gm(x), model(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3)  # one bf16 rounding of the same fp32 sum apart
    assert not torch.equal(got, torch.zeros_like(got))
    gm3 = torch.export.export(model, (torch.randn(1, 3, 64),)).module()
    assert one_row.rewrite(gm3) == 0 and len(gm3.graph.find_nodes(op="call_function", target=kernel)) == 1


@pytest.mark.compile
def test_compiled_int8_reduction_keeps_the_kernels_bf16_rounding():
    """Compiled as artifacts compile it (``exact_casts``: Inductor emulates the casts), the reduction's output is
    the kernel's bf16-rounded value (Inductor otherwise fuses both bf16 round trips away: float32 all through)."""
    assert aoti.export_options(False, torch.float32, exact_casts=True)["emulate_precision_casts"] is True
    model, x = _Int8().eval(), torch.randn(1, 1, 64)
    gm = torch.export.export(model, (x,)).module()
    assert one_row.rewrite(gm) == 1
    with torch.no_grad():
        got = torch.compile(gm, options={"emulate_precision_casts": True})(x)
    assert torch.equal(got, got.to(torch.bfloat16).float())  # rounded to bf16 as the kernel's output
    torch.testing.assert_close(got, model(x), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize(("dtype", "device", "vendor", "expected"), [
    (torch.float32, "cpu", "AuthenticAMD", True), (torch.bfloat16, "cpu", "AuthenticAMD", True),
    (torch.float32, "cpu", "GenuineIntel", False), (torch.float32, "cpu", "", False),
    (torch.float16, "cpu", "AuthenticAMD", False), (torch.float32, "cuda", "AuthenticAMD", False),
])
def test_reductions_are_wanted_where_atens_gemv_was_measured_slow(dtype, device, vendor, expected):
    assert one_row.wanted(dtype, device, vendor) is expected


def test_on_amd_aoti_compiles_decode_on_its_own_unless_its_weights_are_mostly_quantized(monkeypatch):
    decoder = from_source(tiny_model("llama"), dtype="float32", max_seq_len=MAX_SEQ_LEN)[0]
    assert one_row.weight_share(decoder, lambda m: type(m) is torch.nn.Linear) > 0.5
    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "AuthenticAMD")
    specs = registry.get("aoti").program_specs(LIVE_PROGRAMS, decoder)
    assert [(p.name, p.served_by) for p in specs] == [("prefill", None), ("decode", None)]
    packed = registry.get("aoti-packed").program_specs(LIVE_PROGRAMS, decoder)  # its GEMM templates: no reductions
    assert [(p.name, p.served_by) for p in packed] == [("prefill", None), ("decode", "prefill")]
    assert not registry.get("aoti-packed").one_row_reductions(torch.float32, {"cpu"})
    assert not registry.get("aoti").one_row_reductions(torch.float32, {"cuda"})
    int8 = from_source(tiny_model("llama"), dtype="float32", max_seq_len=MAX_SEQ_LEN)[0]
    quantize_decoder(int8, parse_quant("int8"))
    assert one_row.weight_share(int8, one_row.reducible) > 0.5  # int8 linears: rewritten too, decode on its own
    assert [p.served_by for p in registry.get("aoti").program_specs(LIVE_PROGRAMS, int8)] == [None, None]
    int4 = from_source(tiny_model("llama"), dtype="float32", max_seq_len=MAX_SEQ_LEN)[0]
    quantize_decoder(int4, parse_quant("int4"))  # int4 linears (ATen's kernel either way) and a small int8 head
    assert one_row.weight_share(int4, one_row.reducible) < aoti.OWN_DECODE_SHARE
    assert [p.served_by for p in registry.get("aoti").program_specs(LIVE_PROGRAMS, int4)] == [None, "prefill"]
    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "GenuineIntel")
    assert [p.served_by for p in registry.get("aoti").program_specs(LIVE_PROGRAMS, decoder)] == [None, "prefill"]


@pytest.mark.compile
def test_an_amd_aoti_artifacts_decode_calls_no_matmul_and_verifies_against_eager(tmp_path, monkeypatch):
    from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "AuthenticAMD")
    model = tiny_model("llama")
    path = kvtrace.export(model, tmp_path / "amd.kvt", max_seq_len=MAX_SEQ_LEN, backend="aoti")
    art = kvtrace.load(path)
    assert art.manifest.programs["decode"].served_by is None
    calls = {name: set(re.findall(rb"aoti_torch_cpu_[a-z_]+", lib)) for name, lib in package_libraries(path).items()}
    assert b"aoti_torch_cpu_mm_out" in calls["prefill"]  # a symbolic T: ATen's GEMM
    assert not {c for c in calls["decode"] if b"mm" in c}, calls["decode"]  # every linear a reduction
    report = verify(EagerRunner(model), [SessionRunner(art.session(), "aoti")],
                    [[5, 17, 42, 8, 99, 3, 64], [7, 1]], steps=6)
    assert report.passed, [f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    assert len(report.rows) == 2 * 7


@pytest.mark.compile
def test_an_amd_aoti_int8_artifacts_decode_calls_no_int8_kernel_and_verifies_against_the_same_weights(
        tmp_path, monkeypatch):
    from kvtrace.tools.runners import EagerRunner, SessionRunner
    from kvtrace.tools.verify_kv import verify_by_cache

    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "AuthenticAMD")
    model = tiny_model("llama")
    path = kvtrace.export(model, tmp_path / "int8.kvt", max_seq_len=MAX_SEQ_LEN, backend="aoti", quant="int8")
    art = kvtrace.load(path)
    assert art.manifest.programs["decode"].served_by is None
    calls = {name: set(re.findall(rb"aoti_torch_cpu_[a-z0-9_]+", lib))
             for name, lib in package_libraries(path).items()}
    kernel = b"aoti_torch_cpu__weight_int8pack_mm"
    assert kernel in calls["prefill"] and kernel not in calls["decode"], calls["decode"]
    report = verify_by_cache(model, EagerRunner(model), [SessionRunner(art.session(), "int8")],
                             ([5, 17, 42, 8, 99, 3, 64], [7, 1]), steps=6)
    assert report.passed, [f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    assert {r.reference for r in report.rows} == {f"decoder-eager-{art.manifest.quant.key}"}


@pytest.mark.compile
def test_jit_on_amd_compiles_its_decode_linears_as_reductions_with_eagers_numbers(monkeypatch):
    from transformers import DynamicCache

    rewritten = []

    def counting(gm):
        rewritten.append(real(gm))
        return rewritten[-1]

    real = one_row.rewrite
    monkeypatch.setattr(one_row, "rewrite", counting)
    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "AuthenticAMD")
    model = tiny_model("llama")
    jm = kvtrace.jit(model)
    jc, ec = DynamicCache(), DynamicCache()
    ids, mask = torch.tensor([[5, 17, 42, 8, 99]]), torch.ones(1, 5, dtype=torch.long)
    with torch.inference_mode():
        for _ in range(6):
            j = jm(input_ids=ids, attention_mask=mask, past_key_values=jc, use_cache=True)
            e = model(input_ids=ids, attention_mask=mask, past_key_values=ec, use_cache=True)
            torch.testing.assert_close(j.logits, e.logits, rtol=1e-4, atol=1e-4)
            ids, mask = e.logits[:, -1:].argmax(-1), torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert jm.stats.captures == 2 and len(rewritten) == 2  # prefill (T symbolic: none) and decode (every one)
    assert sorted(rewritten) == [0, n_linear], (rewritten, n_linear)
