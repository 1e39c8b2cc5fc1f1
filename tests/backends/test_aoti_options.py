"""What AOTInductor compiles artifacts with (``backends/aoti.inductor_options``): a packed CPU program gets
Inductor's CPU GEMM templates in bf16/fp16 everywhere and in fp32 on AMD CPUs, where they beat MKL's fp32
matmuls (measured in the function's docstring); on Intel fp32 freezes, its weights prepacked for oneDNN only
in a program over several cache rows; a packed program over quantized weights is frozen over the templates
on every CPU. And packed programs really freeze (compiled under no_grad), dropping each original weight the
templates prepacked (buffers included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtrace.backends import aoti


@pytest.mark.parametrize(("vendor", "dtype", "templates"), [
    ("AuthenticAMD", torch.float32, True), ("GenuineIntel", torch.float32, False), ("", torch.float32, False),
    ("GenuineIntel", torch.bfloat16, True), ("AuthenticAMD", torch.bfloat16, True),
])
def test_packed_cpu_programs_get_gemm_templates_where_they_win(vendor, dtype, templates, monkeypatch):
    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: vendor)
    opts = aoti.inductor_options(packed=True, dtype=dtype, rows=True)
    assert opts["freezing"] is True and opts["aot_inductor.package_constants_in_so"] is True
    assert opts.get("max_autotune", False) is templates and ("CPP" in opts.get("max_autotune_gemm_backends", "")) is templates
    assert "max_autotune" not in aoti.inductor_options(packed=False, dtype=dtype)  # weights outside: no templates
    assert "max_autotune" not in aoti.inductor_options(packed=True, dtype=dtype, device_type="cuda")


@pytest.mark.parametrize(("vendor", "dtype", "rows", "frozen"), [
    ("GenuineIntel", torch.float32, False, False), ("GenuineIntel", torch.float32, True, True),
    ("AuthenticAMD", torch.float32, False, True), ("GenuineIntel", torch.bfloat16, False, True),
])
def test_intel_fp32_freezes_only_programs_over_several_rows(vendor, dtype, rows, frozen, monkeypatch):
    """One-row fp32 on Intel: MKL over the embedded weights beats oneDNN's prepacked ones (45 vs 38.5 tokens/s);
    over several rows the prepacked ones win (an 8-row step 35 vs 51 ms)."""
    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: vendor)
    opts = aoti.inductor_options(packed=True, dtype=dtype, rows=rows)
    assert opts["freezing"] is frozen and opts["aot_inductor.package_constants_in_so"] is True
    assert "cpp.weight_prepack" not in opts  # read once per process by Inductor: never set per program
    assert "freezing" not in aoti.inductor_options(packed=False, dtype=dtype, rows=rows)


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD", ""])
@pytest.mark.parametrize("rows", [False, True])
def test_packed_programs_over_quantized_weights_are_frozen_over_the_templates_on_every_cpu(vendor, rows, monkeypatch):
    """int8 on an Intel AMX machine: decode 93.3 vs 74.6 tokens/s unfrozen, prefill 19 vs 71 ms (stop 35)."""
    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: vendor)
    opts = aoti.inductor_options(packed=True, dtype=torch.float32, rows=rows, quantized=True)
    assert opts["freezing"] is True and opts["max_autotune"] is True
    assert opts["max_autotune_gemm_backends"] == "CPP"  # templates only: autotuning by timing is at the mercy of load
    assert "max_autotune" not in aoti.inductor_options(packed=False, dtype=torch.float32, quantized=True)
    assert "max_autotune" not in aoti.inductor_options(packed=True, dtype=torch.float32, device_type="cuda",
                                                       quantized=True)


class _Q8(torch.nn.Module):
    """One int8 weight-only linear in a submodule (a buffer with a dotted name, as in kvtrace's quantized decoders)."""

    def __init__(self) -> None:
        super().__init__()
        from kvtrace.models import quant as q

        torch.manual_seed(0)
        self.inner = torch.nn.Module()
        self.inner.lin = q.Int8Linear(*q.quantize_int8(torch.randn(64, 64)), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.lin(x)


def test_woq_program_finds_torchs_weight_only_matmuls():
    x = torch.randn(1, 4, 64)
    assert aoti.woq_program(torch.export.export(_Q8().eval(), (x,)))
    assert not aoti.woq_program(torch.export.export(_Lin().eval(), (torch.randn(1, 3, 16),)))


@pytest.mark.compile
def test_a_frozen_template_program_keeps_no_original_beside_its_prepacked_weight(tmp_path, monkeypatch):
    """The templates drop a prepacked weight's original only when a get_attr targets the constant by its own name;
    a buffer's dotted target never did (SmolLM2 int8: 274 MB of library for 128 MB of weights). With
    ``_flatten_constant_names`` the int8 weight is compiled in once, prepacked; the answer is eager's to within a
    bf16 rounding (both compute in bf16; the template rounds its fp32 sums differently)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "GenuineIntel")
    model = _Q8().eval()
    x = torch.randn(1, 4, 64)
    ep = torch.export.export(model, (x,))
    # The template only: under "CPP,ATEN" autotuning picks by timing, and at this tiny size ATen's matmul can win
    # (it did on CI), keeping the original as it must; what is tested is the template's pruning.
    opts = {**aoti.export_options(True, torch.float32, quantized=True), "aot_inductor.output_path": str(tmp_path / "m.so"),
            "max_autotune_gemm_backends": "CPP"}
    counters.clear()
    so = aoti._aot_compile(ep, opts)
    assert counters["inductor"]["select_algorithm_weight_prune"] == 1
    assert [n.target for n in ep.graph.nodes if n.op == "get_attr"] == []  # the caller's program is untouched
    assert "inner.lin.weight" in ep.state_dict
    so = Path(so if isinstance(so, str) else next(f for f in so if f.endswith(".so")))  # a path, or the files
    lib = so.read_bytes()
    assert b"inner_lin_weight" not in lib and b"inner_lin_scale" in lib
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(so), 1)
    torch.testing.assert_close(runner.run([x])[0], model(x), rtol=8e-3, atol=1e-3)


class _Lin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize(("shape", "dynamic", "rows"), [((1, 3, 16), False, False), ((2, 3, 16), False, True),
                                                        ((2, 3, 16), True, True)])
def test_a_program_runs_over_rows_unless_its_tokens_have_a_static_batch_of_one(shape, dynamic, rows):
    ds = ({0: torch.export.Dim("R", max=8)},) if dynamic else None
    ep = torch.export.export(_Lin().eval(), (torch.randn(*shape),), dynamic_shapes=ds)
    assert aoti._rows(ep) is rows


def test_a_packed_program_is_frozen_even_when_the_caller_has_grad_mode_on(tmp_path, monkeypatch):
    """Inductor freezes only under no_grad; kvtrace's exports ran with grad mode on, and ``freezing`` silently
    did nothing (no folded or prepacked weights; SmolLM2 bf16 decode 55.2 vs 85.3 tokens/s frozen)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "GenuineIntel")
    ep = torch.export.export(_Lin().eval(), (torch.randn(2, 3, 16),))
    opts = {**aoti.export_options(True, torch.float32, rows=True), "aot_inductor.output_path": str(tmp_path / "m.so")}
    counters.clear()
    with torch.enable_grad():
        aoti._aot_compile(ep, opts)
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 1


def test_cpu_vendor_is_read_from_the_machine():
    assert isinstance(aoti._cpu_vendor(), str)


def _library_calls(path) -> dict[str, set[str]]:
    """Model name -> the ATen kernels its compiled library calls (``aoti_torch_cpu_<op>``), of a packed artifact."""
    import re

    from helpers import package_libraries

    return {name: {m.decode() for m in re.findall(rb"aoti_torch_cpu_[a-z_]+", lib)}
            for name, lib in package_libraries(path).items()}


@pytest.mark.compile
def test_a_slots_program_compiled_after_a_batch_one_program_in_one_process_is_prepacked(tmp_path, monkeypatch):
    """The bench builds the batch-1 artifact, then the slots one, in one process: the second must still get
    oneDNN's prepacked matmuls (it came out unpacked while the first compile turned cpp.weight_prepack off). On
    Intel fp32 the slots package also holds the program compiled as for one row, which serves calls of <= 2 token
    rows with the same numbers."""
    import kvtrace
    from conftest import tiny_model
    from kvtrace.backends.aoti_packed import ONE_ROW, ByRows

    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "GenuineIntel")
    model = tiny_model("llama")
    one = kvtrace.export(model, tmp_path / "one.kvt", max_seq_len=32, backend="aoti-packed")
    many = kvtrace.export(model, tmp_path / "many.kvt", max_seq_len=32, backend="aoti-packed", slots=3)
    assert _library_calls(one) == {"step": {"aoti_torch_cpu_mm_out", "aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu"}}
    calls = _library_calls(many)
    assert set(calls) == {"step", ONE_ROW}
    assert "aoti_torch_cpu__linear_pointwise" in calls["step"] and "aoti_torch_cpu_mm_out" not in calls["step"]
    assert "aoti_torch_cpu_mm_out" in calls[ONE_ROW] and "aoti_torch_cpu__linear_pointwise" not in calls[ONE_ROW]

    art = kvtrace.load(many)
    program = art._programs["decode"]
    assert isinstance(program, ByRows) and art._programs["prefill"] is program
    spec = art.manifest.programs["prefill"]
    for rows in ([0], [0, 2], [0, 1, 2]):  # one, one (R x T = 2), many
        state = art.cache_spec.allocate(torch.device("cpu"))
        r = len(rows)
        tokens = torch.tensor([[5, 6, 7]] * r)[:, :1 if r > 1 else 2].contiguous()  # [R, T]
        t = tokens.shape[1]
        pos = torch.arange(t).expand(r, t).contiguous()
        args = (tokens, pos, *((torch.arange(t),) if spec.key_pos else ()), torch.tensor(rows))
        got = program(*args, *state)
        state2 = art.cache_spec.allocate(torch.device("cpu"))
        other = program.many if tokens.numel() <= 2 else program.one
        torch.testing.assert_close(got, other(*args, *state2), rtol=1e-4, atol=1e-4)
