"""The artifact file: manifest contents, loading without transformers or pickle, corrupt and foreign files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import kvtrace
from conftest import tiny_model
from kvtrace._artifact import FORMAT, VERSION, Manifest, write_artifact
from kvtrace._decoder import hf_cache_spec
from kvtrace._errors import ArtifactError, UsageError
from kvtrace._llama import LIVE_PROGRAMS
from kvtrace._program_spec import DEFAULT_PROGRAMS, ProgramSpec
from kvtrace._tolerances import close, tolerance_for

MAX_SEQ_LEN = 24
PROMPT = [[5, 17, 42, 8, 99, 3, 64]]
TOL = tolerance_for(torch.float32)
EXPECTED_ENTRIES = {
    "exported": {"manifest.json", "weights.safetensors", "programs/prefill.json", "programs/decode.json"},
    "aoti": {"manifest.json", "weights.safetensors", "programs/aoti.pt2"},
}


@pytest.fixture(scope="module", params=["exported", pytest.param("aoti", marks=pytest.mark.compile)])
def built(request, tmp_path_factory):
    model = tiny_model("llama", eos_token_id=[2, 7])
    path = tmp_path_factory.mktemp(f"artifact-{request.param}") / "tiny.kvt"
    kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=request.param)
    return request.param, model, path


def rewrite(src: Path, dst: Path, replace: dict[str, bytes | None]) -> Path:
    """Copy a zip, replacing (bytes) or dropping (None) some entries."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename in replace:
                if replace[info.filename] is not None:
                    zout.writestr(info.filename, replace[info.filename])
            else:
                zout.writestr(info, zin.read(info.filename))
    return dst


def manifest_dict(path: Path) -> dict:
    with zipfile.ZipFile(path) as zf:
        return json.loads(zf.read("manifest.json"))


def with_manifest(src: Path, dst: Path, **changes) -> Path:
    d = {**manifest_dict(src), **changes}
    return rewrite(src, dst, {"manifest.json": json.dumps(d).encode()})


# --- 8. manifest contents ---------------------------------------------------------------------
def test_manifest_contents(built):
    backend, model, path = built
    raw = manifest_dict(path)
    assert raw["format"] == FORMAT == "kvtrace.artifact"
    assert raw["version"] == VERSION == 1
    art = kvtrace.load(path)
    m = art.manifest
    assert m.backend == backend
    assert m.torch_version == raw["torch_version"] == torch.__version__
    assert m.kvtrace_version == kvtrace.__version__
    expected_spec = hf_cache_spec(model.config, max_seq_len=MAX_SEQ_LEN, batch_size=1, dtype=torch.float32)
    assert m.cache_spec == art.cache_spec == expected_spec
    assert raw["cache_spec"] == expected_spec.to_dict()
    assert raw["cache_spec"]["layout"] == "[B, H_kv, S, D]"
    assert m.max_seq_len == raw["cache_spec"]["max_seq_len"] == MAX_SEQ_LEN
    assert m.programs == {p.name: p for p in LIVE_PROGRAMS}  # a Llama: attention over the live cache prefix
    assert "key_pos[L] int64" in raw["programs"]["decode"]["signature"] and raw["programs"]["decode"]["key_pos"]
    assert set(raw["programs"]) == {"prefill", "decode"}
    assert "tokens[B,T]" in raw["programs"]["prefill"]["signature"] and "input_pos[T]" in m.programs["prefill"].signature()
    assert "tokens[B,1]" in raw["programs"]["decode"]["signature"] and "logits[B,1,V]" in m.programs["decode"].signature()
    assert raw["programs"]["decode"]["single_token"] and raw["programs"]["prefill"]["inputs"] == []
    assert m.eos_ids == (2, 7) and raw["eos_ids"] == [2, 7]
    assert m.bos_id == 1
    assert m.vocab_size == model.config.vocab_size == 128
    assert m.model_type == "llama" and m.model_name == "LlamaForCausalLM"
    assert m.weight_aliases == {}
    assert m.export_seconds > 0
    assert art.tokenizer() is None and art.tokenizer_json is None  # an HF model object carries none
    assert Manifest.from_json(m.to_json()) == m
    with zipfile.ZipFile(path) as zf:
        infos = {i.filename: i for i in zf.infolist()}
    assert set(infos) == EXPECTED_ENTRIES[backend]
    assert infos["weights.safetensors"].compress_type == zipfile.ZIP_STORED
    assert all(i.compress_type == zipfile.ZIP_DEFLATED for n, i in infos.items() if n.startswith("programs/"))
    assert backend in repr(art) and "max_seq_len 24" in repr(art)


# --- 4. loading needs neither transformers nor pickle ------------------------------------------
LOAD_SCRIPT = r"""
import json, pickle, sys
import torch

def refuse(*args, **kwargs):
    raise AssertionError("loading an artifact must not unpickle anything")

torch.load = torch.serialization.load = refuse
pickle.load = pickle.loads = refuse
try:
    pickle.loads(pickle.dumps(1))
except AssertionError:
    pass
else:
    raise SystemExit("the pickle guard is not installed")

import kvtrace
art = kvtrace.load(sys.argv[1])
logits = art.session().prefill(torch.tensor(json.loads(sys.argv[2])))
leaked = sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))
print(json.dumps({"leaked": leaked, "logits": logits.tolist()}))
"""


def test_load_in_a_fresh_process_without_transformers_or_pickle(built):
    _, _, path = built
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(path), json.dumps(PROMPT)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["leaked"] == [], f"loading imported {out['leaked'][:5]}"
    ref = kvtrace.load(path).session().prefill(torch.tensor(PROMPT))
    ok, diff, limit = close(torch.tensor(out["logits"]), ref, TOL)
    assert ok, (diff, limit)


# --- 5. corrupt, truncated and foreign files ---------------------------------------------------
def test_truncated_file_raises_artifact_error(built, tmp_path):
    data = built[2].read_bytes()
    bad = tmp_path / "half.kvt"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=f"{bad}.*corrupt or truncated"):
        kvtrace.load(bad)


def test_random_bytes_raise_artifact_error(tmp_path):
    bad = tmp_path / "noise.kvt"
    bad.write_bytes(torch.randint(0, 256, (200_000,), generator=torch.Generator().manual_seed(1),
                                  dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(ArtifactError, match="corrupt or truncated"):
        kvtrace.load(bad)


def test_a_flipped_weight_byte_raises_artifact_error(built, tmp_path):
    path = built[2]
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("weights.safetensors")
    data = bytearray(path.read_bytes())
    name_len = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0xFF
    bad = tmp_path / "flipped.kvt"
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="corrupt"):
        kvtrace.load(bad)


def test_unknown_manifest_version_raises_artifact_error(built, tmp_path):
    bad = with_manifest(built[2], tmp_path / "v99.kvt", version=99)
    with pytest.raises(ArtifactError, match=r"version 99 .*reads version 1"):
        kvtrace.load(bad)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(format="something.else"), "not a kvtrace artifact"),
        (dict(backend="tflite"), "unknown backend 'tflite'"),
        (dict(cache_spec={"layers": "full"}), "cache spec in manifest is malformed"),
        (dict(cache_spec=None), "no cache_spec"),
        (dict(surprise=1), "manifest fields do not match version 1"),
        (dict(eos_ids=["two"]), "manifest fields do not match"),
    ],
)
def test_bad_manifest_fields_raise_artifact_error(built, tmp_path, change, match):
    bad = with_manifest(built[2], tmp_path / "bad.kvt", **change)
    with pytest.raises(ArtifactError, match=match):
        kvtrace.load(bad)


@pytest.mark.parametrize(
    ("blob", "match"),
    [(b"\xff\xfe not utf-8", "not UTF-8"), (b"{not json", "not valid JSON"), (b"[1, 2]", "JSON list")],
)
def test_unreadable_manifest_raises_artifact_error(built, tmp_path, blob, match):
    bad = rewrite(built[2], tmp_path / "bad.kvt", {"manifest.json": blob})
    with pytest.raises(ArtifactError, match=match):
        kvtrace.load(bad)


def test_missing_entries_raise_artifact_error(built, tmp_path):
    backend, _, path = built
    no_manifest = rewrite(path, tmp_path / "nomanifest.kvt", {"manifest.json": None})
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        kvtrace.load(no_manifest)
    program = "programs/decode.json" if backend == "exported" else "programs/aoti.pt2"
    no_program = rewrite(path, tmp_path / "noprogram.kvt", {program: None})
    with pytest.raises(ArtifactError, match=re.escape(f"lacks ['{program}']")):
        kvtrace.load(no_program)
    no_weights = rewrite(path, tmp_path / "noweights.kvt", {"weights.safetensors": None})
    with pytest.raises(ArtifactError, match=re.escape("lacks ['weights.safetensors']")):
        kvtrace.load(no_weights)


def test_corrupt_entries_raise_artifact_error(built, tmp_path):
    backend, _, path = built
    bad_weights = rewrite(path, tmp_path / "w.kvt", {"weights.safetensors": b"not safetensors"})
    with pytest.raises(ArtifactError, match=r"weights\.safetensors is corrupt"):
        kvtrace.load(bad_weights)
    program = "programs/prefill.json" if backend == "exported" else "programs/aoti.pt2"
    bad_program = rewrite(path, tmp_path / "p.kvt", {program: b"{}"})
    with pytest.raises(ArtifactError, match=f"could not load the {backend} programs.*the file is corrupt"):
        kvtrace.load(bad_program)
    other_torch = with_manifest(bad_program, tmp_path / "t.kvt", torch_version="1.0.0")
    with pytest.raises(ArtifactError, match=re.escape(f"written by torch 1.0.0, this is torch {torch.__version__}")):
        kvtrace.load(other_torch)


def test_missing_file_and_directory_paths(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        kvtrace.load(tmp_path / "nope.kvt")
    with pytest.raises(UsageError, match="does not exist"):
        kvtrace.load(tmp_path)
    spec = hf_cache_spec(tiny_model("llama").config, max_seq_len=8, batch_size=1, dtype=torch.float32)
    m = Manifest(backend="exported", cache_spec=spec, vocab_size=128, programs={p.name: p for p in DEFAULT_PROGRAMS})
    with pytest.raises(UsageError, match="is a directory"):
        write_artifact(tmp_path, m, {}, {}, None)
    assert list(tmp_path.iterdir()) == []


def test_manifest_json_round_trip_and_tokenizer_entry(tmp_path):
    spec = hf_cache_spec(tiny_model("llama").config, max_seq_len=8, batch_size=1, dtype=torch.float32)
    m = Manifest(backend="exported", cache_spec=spec, vocab_size=128, programs={p.name: p for p in DEFAULT_PROGRAMS},
                 eos_ids=(2,), weight_aliases={"a": "b"}, generation={"temperature": 0.0})
    text = m.to_json()
    assert json.loads(text)["version"] == VERSION
    assert Manifest.from_json(text) == m
    out = write_artifact(tmp_path / "sub" / "m.kvt", m, {"b": torch.ones(2)}, {"programs/x.json": b"{}"}, '{"tok": 1}')
    assert out == tmp_path / "sub" / "m.kvt"
    assert [p.name for p in out.parent.iterdir()] == ["m.kvt"]  # no temp file left
    with zipfile.ZipFile(out) as zf:
        assert zf.read("tokenizer.json") == b'{"tok": 1}'
        assert Manifest.from_json(zf.read("manifest.json").decode()) == m


def test_manifest_program_specs_round_trip_and_older_signature_form():
    from kvtrace._program_spec import InputSpec

    spec = hf_cache_spec(tiny_model("llama").config, max_seq_len=8, batch_size=1, dtype=torch.float32)
    image = ProgramSpec("prefill_image", method="forward_image", once=True, inputs=(
        InputSpec("cross_attention_states", ("B", 6, 64), "float32"),
        InputSpec("cross_attention_mask", ("B", "T", 6), "float32", default=1.0, binary=True)))
    m = Manifest(backend="exported", cache_spec=spec, vocab_size=128,
                 programs={**{p.name: p for p in DEFAULT_PROGRAMS}, "prefill_image": image})
    raw = json.loads(m.to_json())
    assert raw["programs"]["prefill_image"]["signature"] == (
        "(tokens[B,T] int64, input_pos[T] int64, cross_attention_states[B, 6, 64] float32, "
        "cross_attention_mask[B, T, 6] float32, *cache) -> logits[B,T,V]")
    assert Manifest.from_json(m.to_json()) == m
    # manifests written before programs had specs map names to signature strings
    raw["programs"] = {"prefill": "(tokens[B,T] ...)", "decode": "(tokens[B,1] ...)"}
    old = Manifest.from_json(json.dumps(raw))
    assert old.programs == {p.name: p for p in DEFAULT_PROGRAMS}
    raw["programs"] = {"prefill": "(tokens[B,T] ...)"}
    with pytest.raises(ArtifactError, match="expected at least prefill and decode"):
        Manifest.from_json(json.dumps(raw))
