"""Backend "aoti" serving decode with prefill's program (``ProgramSpec.served_by``, ``aoti.shares_decode``): one
library compiled where the one-token decode is the same computation, two where it is not, and the artifacts of
either kind (and those kvtrace <= 0.4 wrote, two programs) load, run and refuse an inconsistent manifest."""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile

import pytest
import torch

import kvtrace
from conftest import tiny_model
from kvtrace._errors import ArtifactError, UsageError
from kvtrace.artifact.export import from_source
from kvtrace.backends import aoti, registry
from kvtrace.models.quant import GGUFLinear
from kvtrace.models.step import LIVE_PROGRAMS, SLOT_PROGRAMS
from kvtrace.spec.program import InputSpec, ProgramSpec
from kvtrace.spec.tolerances import close, tolerance_for

MAX_SEQ_LEN = 32
PROMPT = torch.tensor([[5, 17, 42, 8, 99, 3, 64]])
AOTI = registry.get("aoti")


@pytest.fixture(autouse=True)
def _intel(monkeypatch):
    """A CPU where decode's linears stay ATen's, as on Intel: on AMD an fp32 decode is compiled on its own with its
    one-row linears as reductions (``backends/one_row``, tests/backends/test_one_row.py), so nothing shares."""
    monkeypatch.setattr(aoti, "_cpu_vendor", lambda: "GenuineIntel")


def _decoder():
    return from_source(tiny_model("llama"), dtype="float32", max_seq_len=MAX_SEQ_LEN)[0]


def _models(path) -> set[str]:
    """The model names an artifact's AOTInductor package holds."""
    with zipfile.ZipFile(path) as outer, zipfile.ZipFile(io.BytesIO(outer.read(aoti.PACKAGE))) as pt2:
        return {n.split("/")[3] for n in pt2.namelist() if n.startswith("aoti/data/aotinductor/")}


# --- which decoders share (no compile) --------------------------------------------------------------
def test_a_plain_decoder_shares_and_its_decode_spec_says_so():
    decoder = _decoder()
    specs = AOTI.program_specs(LIVE_PROGRAMS, decoder)
    assert [(p.name, p.served_by) for p in specs] == [("prefill", None), ("decode", "prefill")]
    assert list(AOTI.compiled({p.name: p for p in specs})) == ["prefill"]
    packed = registry.get("aoti-packed").program_specs(LIVE_PROGRAMS, decoder)
    assert [(p.name, p.served_by) for p in packed] == [("prefill", None), ("decode", "prefill")]  # the step serves
    assert registry.get("exported").program_specs(LIVE_PROGRAMS, decoder) == LIVE_PROGRAMS


def test_decoders_whose_decode_differs_keep_their_own_decode_program(monkeypatch):
    decoder = _decoder()
    assert not aoti.shares_decode(SLOT_PROGRAMS, decoder)  # slot programs: unmeasured
    image = InputSpec("cross_attention_states", ("B", 6, 64), "float32")  # a vision decoder's prefill input
    vision = (ProgramSpec("prefill", inputs=(image,)), ProgramSpec("decode", single_token=True))
    assert not aoti.shares_decode(vision, decoder)  # prefill takes inputs decode does not
    assert not aoti.shares_decode((*LIVE_PROGRAMS, ProgramSpec("prefill_image", once=True)), decoder)
    q = torch.zeros(64, 2, 32, dtype=torch.uint8)  # [N, K / 32, 32]: one 4-bit value per weight
    d = torch.ones(64, 2, dtype=torch.float16)
    decoder.add_module("gguf", GGUFLinear("q4_1", q, d, d.clone(), None))  # computes differently at one token
    assert not aoti.shares_decode(LIVE_PROGRAMS, decoder)
    monkeypatch.setattr(aoti, "SHARED_DECODE", False)
    assert AOTI.program_specs(LIVE_PROGRAMS, _decoder()) == LIVE_PROGRAMS


def test_served_by_is_checked_in_the_spec_and_against_the_manifest(tmp_path):
    with pytest.raises(UsageError, match="served_by names another program"):
        ProgramSpec("decode", single_token=True, served_by="decode")
    with pytest.raises(UsageError, match="served_by names another program"):
        ProgramSpec("prefill", served_by="decode")  # only a one-token program is served by another
    with pytest.raises(ArtifactError, match="malformed"):
        ProgramSpec.from_dict("decode", {"single_token": True, "served_by": "decode"})
    shared = ProgramSpec("decode", single_token=True, served_by="prefill")
    assert ProgramSpec.from_dict("decode", json.loads(json.dumps(shared.to_dict()))) == shared
    assert "served_by" not in ProgramSpec("decode", single_token=True).to_dict()  # reads as kvtrace 0.4 wrote it

    path = kvtrace.export(tiny_model("llama"), tmp_path / "e.kvt", max_seq_len=MAX_SEQ_LEN, backend="exported")
    manifest = kvtrace.load(path).manifest
    pre, dec = manifest.programs["prefill"], manifest.programs["decode"]
    bad = {
        "a missing program": {"decode": dataclasses.replace(dec, served_by="step")},
        "one taking other inputs": {"prefill": dataclasses.replace(pre, key_pos=not pre.key_pos),
                                    "decode": dataclasses.replace(dec, served_by="prefill")},
        "a one-token program": {"prefill": dataclasses.replace(pre, single_token=True),
                                "decode": dataclasses.replace(dec, served_by="prefill")},
    }
    for what, programs in bad.items():
        forged = dataclasses.replace(manifest, programs={**manifest.programs, **programs})
        with pytest.raises(ArtifactError, match=r"is served by .* re-export it"):
            AOTI.check_manifest(path, forged)
        assert what  # each case above must fail


# --- compiled artifacts -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(model, {"shared" | "separate" | "exported": artifact}): the same tiny Llama, decode served by prefill's
    program, decode compiled on its own (as kvtrace <= 0.4 did), and the exported programs."""
    model = tiny_model("llama")
    tmp = tmp_path_factory.mktemp("aoti-shared")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aoti, "_cpu_vendor", lambda: "GenuineIntel")  # as ``_intel``, which is per test
        out = {"shared": kvtrace.export(model, tmp / "shared.kvt", max_seq_len=MAX_SEQ_LEN, backend="aoti"),
               "exported": kvtrace.export(model, tmp / "e.kvt", max_seq_len=MAX_SEQ_LEN, backend="exported")}
        mp.setattr(aoti, "SHARED_DECODE", False)
        out["separate"] = kvtrace.export(model, tmp / "separate.kvt", max_seq_len=MAX_SEQ_LEN, backend="aoti")
    return model, out


@pytest.mark.compile
def test_one_library_serves_prefill_and_decode(artifacts):
    _, paths = artifacts
    shared, separate = kvtrace.load(paths["shared"]), kvtrace.load(paths["separate"])
    assert shared.manifest.programs["decode"].served_by == "prefill"
    assert set(shared.manifest.signatures) == _models(paths["shared"]) == {"prefill"}
    assert separate.manifest.programs["decode"].served_by is None
    assert set(separate.manifest.signatures) == _models(paths["separate"]) == {"prefill", "decode"}
    assert paths["shared"].stat().st_size < paths["separate"].stat().st_size


@pytest.mark.compile
def test_shared_and_separate_decode_match_the_exported_programs_step_by_step(artifacts):
    _, paths = artifacts
    sessions = {k: kvtrace.load(p).session() for k, p in paths.items()}
    tol = tolerance_for(torch.float32)
    with torch.inference_mode():
        logits = {k: s.prefill(PROMPT) for k, s in sessions.items()}
        for step in range(12):
            ref = logits["exported"]
            for k in ("shared", "separate"):
                assert close(logits[k], ref, tol), (k, step, (logits[k] - ref).abs().max())
                for a, b in zip(sessions[k].state, sessions["exported"].state, strict=True):
                    assert close(a, b, tol), (k, step)
                assert sessions[k].position == sessions["exported"].position == PROMPT.shape[1] + step
            token = ref[:, -1:].argmax(-1)
            logits = {k: s.decode(token) for k, s in sessions.items()}
        sessions["shared"].reset()  # the shared program's state is the Session's: reset clears it
        assert all(not t.any() for t in sessions["shared"].state)
        again = sessions["shared"].prefill(PROMPT)
        sessions["exported"].reset()
        assert close(again, sessions["exported"].prefill(PROMPT), tol)
