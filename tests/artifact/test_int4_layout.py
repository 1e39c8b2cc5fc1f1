"""int4 weights and the CPU capability torch dispatches (``artifact.archive._check_int4_layout``): torch packs an int4
weight in a layout chosen by the capability it dispatches (AVX-512: 64 outputs a block, AVX2: 32, others: pairs)
and its int4 matmul reads its own, so an int4 artifact exported under one and run under another computed with
scrambled weights, silently. The manifest records the layout and load refuses a mismatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_artifact import manifest_dict, rewrite

import kvtrace
from conftest import tiny_model
from kvtrace._errors import ArtifactError
from kvtrace.models.quant import int4pack_layout

PROMPT = [5, 17, 42, 8, 99, 3, 64]
# a capability below this machine's, whose int4 layout differs from its own (every x86 CPU torch runs on has
# AVX2 at least, so these tests run on every x86 CI machine; on a CPU dispatching "DEFAULT" there is none below)
LOWER = {"n64": ("avx2", "n32"), "n32": ("default", "pairs")}  # ATEN_CPU_CAPABILITY values

RUN = """
import json, sys, torch, kvtrace
from kvtrace.artifact import archive
from kvtrace.models.quant import int4pack_layout
if sys.argv[2] == "unchecked":  # the load check off: what such a run computed before it existed
    archive._check_int4_layout = lambda path, manifest: None
try:
    s = kvtrace.load(sys.argv[1]).session()
except kvtrace.ArtifactError as e:
    print(json.dumps({"layout": int4pack_layout(), "error": str(e)}))
else:
    print(json.dumps({"layout": int4pack_layout(), "logits": s.prefill(json.loads(sys.argv[3]))[0, -1].tolist()}))
"""


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    path = tmp_path_factory.mktemp("int4") / "q4.kvt"
    kvtrace.export(tiny_model("llama"), path, max_seq_len=16, backend="exported", quant="int4")
    return path


def _run(path, capability: str, unchecked: bool = False) -> dict:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    proc = subprocess.run([sys.executable, "-c", RUN, str(path), "unchecked" if unchecked else "checked",
                           json.dumps(PROMPT)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_manifest_records_the_layout_the_weights_were_packed_in(int4, tmp_path):
    art = kvtrace.load(int4)
    assert art.manifest.quant.int4_layout == int4pack_layout()
    assert manifest_dict(int4)["quant"]["int4_layout"] == int4pack_layout()
    other = next(x for x in ("n64", "n32", "pairs") if x != int4pack_layout())
    d = manifest_dict(int4)
    d["quant"]["int4_layout"] = other
    forged = rewrite(int4, tmp_path / "forged.kvt", {"manifest.json": json.dumps(d).encode()})
    with pytest.raises(ArtifactError, match=rf"packed in torch's CPU int4 layout '{other}'.*Re-export"):
        kvtrace.load(forged)
    del d["quant"]["int4_layout"]  # as kvtrace <= 0.4.2 wrote it: not recorded, not checked
    old = rewrite(int4, tmp_path / "old.kvt", {"manifest.json": json.dumps(d).encode()})
    assert kvtrace.load(old).manifest.quant.int4_layout is None
    d["quant"]["int4_layout"] = "n128"
    with pytest.raises(ArtifactError, match="int4_layout must be one of"):
        kvtrace.load(rewrite(int4, tmp_path / "bad.kvt", {"manifest.json": json.dumps(d).encode()}))


@pytest.mark.skipif(int4pack_layout() not in LOWER, reason="torch dispatches no capability below this CPU's: "
                    "no other int4 layout to run under (non-x86)")
def test_an_artifact_run_under_another_capability_is_refused_instead_of_computing_scrambled_weights(int4):
    capability, layout = LOWER[int4pack_layout()]
    with torch.inference_mode():
        here = kvtrace.load(int4).session().prefill([PROMPT])[0, -1]
    lowered = _run(int4, capability)
    assert lowered["layout"] == layout  # torch there packs and reads another layout
    assert "would compute with scrambled weights" in lowered["error"]
    scrambled = torch.tensor(_run(int4, capability, unchecked=True)["logits"])
    assert (scrambled - here).abs().max() > 1e-2  # what that run computed before the check: other numbers
