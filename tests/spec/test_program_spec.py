"""ProgramSpec / InputSpec: declared program signatures, their invariants and the inputs file reader."""

from __future__ import annotations

import pytest
import torch

from kvtrace._errors import UsageError
from kvtrace.spec.program import DEFAULT_PROGRAMS, InputSpec, ProgramSpec, program_specs, read_inputs_file


def test_input_spec_invariants_and_concrete_shape():
    i = InputSpec("cross_attention_mask", ("B", "T", 6), "float32", default=1.0, binary=True)
    assert i.concrete(2, 5) == (2, 5, 6)
    assert i.describe() == "cross_attention_mask[B, T, 6] float32"
    assert i.torch_dtype is torch.float32
    for bad, msg in [(dict(name="tokens"), "other than tokens/input_pos"), (dict(name="not a name"), "identifier"),
                     (dict(shape=("B", 0)), "ints >= 1 or one of"), (dict(shape=("N",)), "ints >= 1 or one of"),
                     (dict(dtype="float33"), "torch dtype")]:
        with pytest.raises(UsageError, match=msg):
            InputSpec(**{"name": "x", "shape": ("B",), "dtype": "float32", **bad})


def test_program_spec_signature_and_checks():
    assert [p.signature() for p in DEFAULT_PROGRAMS] == [
        "(tokens[B,T] int64, input_pos[T] int64, *cache) -> logits[B,T,V]",
        "(tokens[B,1] int64, input_pos[1] int64, *cache) -> logits[B,1,V]",
    ]
    x = InputSpec("x", ("B", 3), "float32")
    with pytest.raises(UsageError, match="unique"):
        ProgramSpec("p", inputs=(x, x))
    assert program_specs(torch.nn.Linear(1, 1)) == DEFAULT_PROGRAMS

    class OnlyPrefill(torch.nn.Module):
        programs = (ProgramSpec("prefill"),)

    with pytest.raises(UsageError, match="including 'prefill' and 'decode'"):
        program_specs(OnlyPrefill())

    class MixedKeys(torch.nn.Module):
        programs = (ProgramSpec("prefill", key_pos=True), ProgramSpec("decode", single_token=True))

    with pytest.raises(UsageError, match="must agree on key_pos; got prefill True, decode False"):
        program_specs(MixedKeys())
    with pytest.raises(UsageError, match="logits must be one of"):
        ProgramSpec("p", logits="first")
    assert "key_pos[L] int64" in ProgramSpec("p", key_pos=True, logits="last").signature()
    assert ProgramSpec("p", key_pos=True, logits="last").signature().endswith("-> logits[B,1,V]")


def test_read_inputs_file(tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "x.safetensors"
    save_file({"cross_attention_states": torch.ones(1, 2, 3)}, good)
    assert read_inputs_file(good)["cross_attention_states"].shape == (1, 2, 3)
    with pytest.raises(UsageError, match="does not exist"):
        read_inputs_file(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match=r"not a readable \.safetensors file"):
        read_inputs_file(junk)


def test_a_manifest_from_a_newer_kvtrace_says_so():
    from kvtrace._errors import ArtifactError

    d = {**ProgramSpec("prefill").to_dict(), "speculative_heads": 4}
    with pytest.raises(ArtifactError, match=r"field\(s\) \['speculative_heads'\].*written by a newer kvtrace"):
        ProgramSpec.from_dict("prefill", d)
    assert ProgramSpec.from_dict("prefill", ProgramSpec("prefill", key_pos=True).to_dict()).key_pos
