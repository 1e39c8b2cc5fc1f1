"""Backend "aoti-packed" and its decode program (``aoti_packed.own_decode``): prefill's T-symbolic step program serves
decode, and says so (decode ``served_by="prefill"``), but for a decoder whose weights are mostly int8 linears (their
GEMM templates specialize for one row: ``one_row_template``), which gets its own one-token program; manifests
of kvtrace <= 0.4.2 (decode unmarked, one signed program) still load as the one-program layout they are. The
compiled quantized artifacts themselves are checked in tests/models/test_quant.py. A slots artifact of such a
decoder gets a decode captured for one row beside its step program (``one_row_decode``, ``DECODE_ONE``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_model
from kvtrace._errors import ArtifactError
from kvtrace.artifact.export import from_source
from kvtrace.backends import registry
from kvtrace.backends.aoti_packed import DECODE, MODEL, one_row_decode, own_decode
from kvtrace.models.quant import Int8Linear, quantize_int8
from kvtrace.models.step import LIVE_PROGRAMS, SLOT_PROGRAMS
from kvtrace.spec.manifest import Manifest

PACKED = registry.get("aoti-packed")


def _decoder(quant: str | None = None) -> torch.nn.Module:
    return from_source(tiny_model("llama"), dtype="float32", max_seq_len=16, quant=quant)[0]


def _names(programs) -> dict[str, str | None]:
    return {p.name: p.served_by for p in programs}


def test_the_step_program_serves_decode_and_the_decode_spec_says_so():
    specs = PACKED.program_specs(LIVE_PROGRAMS, _decoder())
    assert _names(specs) == {"prefill": None, "decode": "prefill"}
    assert list(PACKED.compiled({p.name: p for p in specs})) == [MODEL]


def test_a_decoder_mostly_of_int8_linears_gets_its_own_decode_program():
    decoder = _decoder("int8")
    assert own_decode(LIVE_PROGRAMS, decoder)
    specs = PACKED.program_specs(LIVE_PROGRAMS, decoder)
    assert _names(specs) == {"prefill": None, "decode": None}
    by_name = {p.name: p for p in specs}
    assert PACKED.compiled(by_name) == {MODEL: by_name["prefill"], DECODE: by_name["decode"]}
    # a slots decoder (R rows a step) keeps one program: unmeasured there
    assert not own_decode(SLOT_PROGRAMS, decoder)
    assert _names(PACKED.program_specs(SLOT_PROGRAMS, decoder))["decode"] == "prefill"


def test_int4_decoders_get_their_own_decode_and_a_few_int8_modules_keep_one_program():
    """int4 / 8da4w linears are captured for Inductor's int4 template (``template_ops``), which specializes for one
    row too; one int8 linear in a float decoder is a minority of its bytes."""
    assert own_decode(LIVE_PROGRAMS, _decoder("int4"))
    assert own_decode(LIVE_PROGRAMS, _decoder("8da4w"))
    decoder = _decoder()
    decoder.add_module("int8", Int8Linear(*quantize_int8(torch.randn(8, 32)), None))
    assert not own_decode(LIVE_PROGRAMS, decoder)
    big = _decoder()
    total = sum(t.numel() * t.element_size() for t in big.state_dict().values())
    big.add_module("int8", Int8Linear(*quantize_int8(torch.randn(total // 32 + 1, 32)), None))  # now the majority
    assert own_decode(LIVE_PROGRAMS, big)


def test_an_older_manifest_without_a_decode_signature_is_the_one_program_layout():
    """kvtrace <= 0.4.2 marked no served_by and signed the step program only: decode runs on it."""
    unmarked = {p.name: p for p in LIVE_PROGRAMS}
    assert list(PACKED.compiled(unmarked, signed={MODEL})) == [MODEL]
    assert list(PACKED.compiled(unmarked, signed={MODEL, DECODE})) == [MODEL, DECODE]
    marked = {p.name: p for p in PACKED.program_specs(LIVE_PROGRAMS, _decoder())}
    assert list(PACKED.compiled(marked, signed={MODEL, DECODE})) == [MODEL]  # a forged extra signature: refused
    # by the reader, whose signature check compares the signed names with these


def test_a_decode_served_by_anything_but_prefill_is_refused(tmp_path):
    spec = _decoder().cache_spec
    programs = {p.name: p for p in LIVE_PROGRAMS}
    manifest = Manifest(backend="aoti-packed", cache_spec=spec, vocab_size=128, programs=programs)
    PACKED.check_manifest(tmp_path, manifest)
    for bad in ({"decode": dataclasses.replace(programs["decode"], served_by="prefill_image")},
                {"prefill": dataclasses.replace(programs["prefill"], key_pos=not programs["prefill"].key_pos)}):
        with pytest.raises(ArtifactError, match="re-export it"):
            PACKED.check_manifest(tmp_path, dataclasses.replace(manifest, programs={**programs, **bad}))


def test_a_slots_decoder_mostly_of_int8_or_int4_linears_gets_a_one_row_decode():
    assert one_row_decode(SLOT_PROGRAMS, _decoder("int8")) and one_row_decode(SLOT_PROGRAMS, _decoder("int4"))
    assert not one_row_decode(SLOT_PROGRAMS, _decoder())  # float weights: the step program's GEMM serves one row
    assert not one_row_decode(LIVE_PROGRAMS, _decoder("int8"))  # batch-1 programs: own_decode's program instead


@pytest.mark.compile
def test_a_single_slots_decode_step_runs_on_the_one_row_program_and_answers_as_solo_runs(tmp_path):
    """int8 weights, 3 slots: the package holds DECODE_ONE (R = 1, T = 1 static) beside the step program; a decode
    of one row runs on it, of more rows on the step program, with the same numbers; one request at a time and
    several together answer as solo runs of the batch-1 artifact (exported: the reference)."""
    from tests.runtime.test_slots import _prompts, run_staggered

    import kvtrace
    from helpers import package_libraries
    from kvtrace.backends.aoti_packed import DECODE_ONE, ByRows
    from kvtrace.runtime.generate import generate
    from kvtrace.runtime.slots import SlotRequest

    model = tiny_model("llama")
    kvtrace.export(model, tmp_path / "solo.kvt", max_seq_len=48, quant="int8", prefill_logits="last")
    kvtrace.export(model, tmp_path / "slots.kvt", max_seq_len=48, quant="int8", prefill_logits="last", slots=3,
                   backend="aoti-packed")
    solo, art = kvtrace.load(tmp_path / "solo.kvt"), kvtrace.load(tmp_path / "slots.kvt")
    decode = art._programs["decode"]
    assert isinstance(decode, ByRows) and decode.most == 1 and art._programs["prefill"] is decode
    assert set(art.manifest.signatures) == {MODEL}, "the variant is signed by the step program it stands in for"
    assert set(package_libraries(tmp_path / "slots.kvt")) == {MODEL, DECODE_ONE}
    for rows in ([1], [0, 2]):  # decode: tokens [R, 1], input_pos [R, 1], key_pos [L], slots [R]
        r = len(rows)
        args = (torch.full((r, 1), 5), torch.zeros(r, 1, dtype=torch.int64), torch.arange(1), torch.tensor(rows))
        got = decode(*args, *art.cache_spec.allocate())
        other = decode.many if r == 1 else decode.one
        if r == 1:
            torch.testing.assert_close(got, other(*args, *art.cache_spec.allocate()), rtol=1e-3, atol=1e-3)
        else:
            with pytest.raises(RuntimeError):  # the one-row program takes exactly one row
                other(*args, *art.cache_spec.allocate())
    prompts, maxes = _prompts((5, 11, 3, 9), seed=2), [12, 6, 10, 8]
    ref = [generate(solo.session(), p, max_new_tokens=n).tokens for p, n in zip(prompts, maxes, strict=True)]
    engine = art.slot_engine()
    for p, n, want in zip(prompts, maxes, ref, strict=True):  # one at a time: every step on DECODE_ONE
        assert run_staggered(engine, [SlotRequest(p, max_tokens=n)])[0] == want
    out = run_staggered(art.slot_engine(), [SlotRequest(p, max_tokens=n) for p, n in zip(prompts, maxes, strict=True)])
    assert [out[i] for i in range(len(prompts))] == ref
