"""Backend "aoti-packed" and its decode program (``aoti_packed.own_decode``): prefill's T-symbolic step program serves
decode, and says so (decode ``served_by="prefill"``), but for a decoder whose weights are mostly int8 linears (their
GEMM templates specialize for one row: ``one_row_template``), which gets its own one-token program; manifests
of kvtrace <= 0.4.2 (decode unmarked, one signed program) still load as the one-program layout they are. The
compiled quantized artifacts themselves are checked in tests/models/test_quant.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_model
from kvtrace._errors import ArtifactError
from kvtrace.artifact.export import from_source
from kvtrace.backends import registry
from kvtrace.backends.aoti_packed import DECODE, MODEL, own_decode
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
