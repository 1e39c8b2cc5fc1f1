"""The artifact file: manifest contents, loading without transformers or pickle, corrupt, foreign,
inconsistent and hostile files (#12: hashes, sizes, zip bombs, pickles in the .pt2, consistency of the
manifest with the programs)."""

from __future__ import annotations

import dataclasses
import hashlib
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


def rewrite(src: Path, dst: Path, replace: dict[str, bytes | None], rehash: bool = False) -> Path:
    """Copy a zip, replacing (bytes) or dropping (None) some entries; new entries are appended.
    ``rehash``: also record the new members' sizes and SHA-256 in the manifest, as an attacker (or a
    careless tool) editing the file consistently would."""
    with zipfile.ZipFile(src) as zin:
        entries = {i.filename: (i, zin.read(i.filename)) for i in zin.infolist()}
    for name, blob in replace.items():
        if blob is None:
            entries.pop(name, None)
        else:
            entries[name] = (zipfile.ZipInfo(name), blob)
    if rehash and "manifest.json" not in replace:
        d = json.loads(entries["manifest.json"][1])
        d["members"] = {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                        for n, (_, b) in entries.items() if n != "manifest.json"}
        entries["manifest.json"] = (entries["manifest.json"][0], json.dumps(d).encode())
    with zipfile.ZipFile(dst, "w") as zout:
        for info, blob in entries.values():
            zout.writestr(info, blob)
    return dst


def manifest_dict(path: Path) -> dict:
    with zipfile.ZipFile(path) as zf:
        return json.loads(zf.read("manifest.json"))


def member(path: Path, name: str) -> bytes:
    with zipfile.ZipFile(path) as zf:
        return zf.read(name)


def with_manifest(src: Path, dst: Path, **changes) -> Path:
    d = {**manifest_dict(src), **changes}
    return rewrite(src, dst, {"manifest.json": json.dumps(d).encode()})


# --- 8. manifest contents ---------------------------------------------------------------------
def test_manifest_contents(built):
    backend, model, path = built
    raw = manifest_dict(path)
    assert raw["format"] == FORMAT == "kvtrace.artifact"
    assert raw["version"] == VERSION == 2
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
    # version 2: every other member's size and SHA-256, every weight's shape and dtype, each program's inputs
    assert set(raw["members"]) == EXPECTED_ENTRIES[backend] - {"manifest.json"}
    for name, rec in raw["members"].items():
        assert rec == {"size": infos[name].file_size, "sha256": hashlib.sha256(member(path, name)).hexdigest()}
    assert raw["weights"]["tok_embeddings.weight"] == {"shape": [128, 64], "dtype": "float32"}
    assert len(raw["weights"]) == len(art._keepalive[0])
    prefill = raw["signatures"]["prefill"]
    assert prefill[0]["dtype"] == "int64" and prefill[0]["shape"][0] == 1 and isinstance(prefill[0]["shape"][1], str)
    assert [i["shape"] for i in prefill[3:]] == [[1, 2, MAX_SEQ_LEN, 16]] * 4  # k, v of 2 layers [B, H_kv, S, D]
    assert raw["signatures"]["decode"][:2] == [{"shape": [1, 1], "dtype": "int64"}, {"shape": [1], "dtype": "int64"}]
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
    with pytest.raises(ArtifactError, match=r"version 99 .*reads version 2"):
        kvtrace.load(bad)
    # version 1 recorded no hashes, sizes or signatures: refused with what to do, never loaded unchecked
    v1 = with_manifest(built[2], tmp_path / "v1.kvt", version=1)
    with pytest.raises(ArtifactError, match=r"version 1 .*re-export it.*kvtrace cache clear"):
        kvtrace.load(v1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(format="something.else"), "not a kvtrace artifact"),
        (dict(backend="tflite"), "unknown backend 'tflite'"),
        (dict(cache_spec={"layers": "full"}), "cache spec in manifest is malformed"),
        (dict(cache_spec=None), "cache_spec must be an object, found None"),
        (dict(surprise=1), "manifest fields do not match version 2: unknown field"),
        (dict(eos_ids=["two"]), "eos_ids must be a list of ints"),
        (dict(eos_ids=3), "eos_ids must be a list of ints"),
        (dict(vocab_size="128"), "vocab_size must be an int >= 1"),
        (dict(vocab_size=True), "vocab_size must be an int >= 1"),
        (dict(bos_id="one"), "bos_id must be null or an int"),
        (dict(chat_template=7), "chat_template must be null or a string"),
        (dict(generation=[]), "generation must be an object"),
        (dict(generation={"temperature": "hot"}), "generation must be an object of numbers"),
        (dict(weight_aliases=["a"]), "weight_aliases must be an object of strings"),
        (dict(model_name=None), "model_name must be a string"),
        (dict(export_seconds="fast"), "export_seconds must be a number"),
        (dict(programs=[]), "programs must be an object of program specs"),
        (dict(programs={"prefill": 3, "decode": {}}), "programs must be an object of program specs"),
        (dict(programs={"prefill": {"single_token": "no"}, "decode": {}}), "programs must be an object"),
        (dict(members=[]), "members must be an object of"),
        (dict(members={"weights.safetensors": {"size": -1, "sha256": "00"}}), "members must be an object of"),
        (dict(weights={"w": {"shape": [1.5], "dtype": "float32"}}), "weights must be an object of"),
        (dict(weights={"w": {"shape": [2], "dtype": "complex"}}), "weights must be an object of"),
        (dict(signatures={"prefill": "x"}), "signatures must be an object of lists"),
        (dict(members=None), "members must be"),
        (dict(cache_spec={"layers": [{"kind": "full"}], "batch_size": 1}), "cache spec in manifest is malformed"),
        (dict(cache_spec={"layers": 5}), "cache spec in manifest is malformed"),
        (dict(backend=["aoti"]), "backend must be a string"),
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
    program = "programs/prefill.json" if backend == "exported" else "programs/aoti.pt2"
    # a replaced member that the manifest does not vouch for: refused by size / hash before it is parsed
    bad_weights = rewrite(path, tmp_path / "w0.kvt", {"weights.safetensors": b"not safetensors"})
    with pytest.raises(ArtifactError, match=r"member weights\.safetensors is 15 bytes, its manifest says \d+"):
        kvtrace.load(bad_weights)
    same_size = bytearray(member(path, program))
    same_size[len(same_size) // 2] ^= 1
    bad_hash = rewrite(path, tmp_path / "h.kvt", {program: bytes(same_size)})
    with pytest.raises(ArtifactError, match=f"member {program} does not match the SHA-256 its manifest records"):
        kvtrace.load(bad_hash)
    # the same, re-hashed consistently: parsed, and refused as corrupt
    bad_weights = rewrite(path, tmp_path / "w.kvt", {"weights.safetensors": b"not safetensors"}, rehash=True)
    with pytest.raises(ArtifactError, match=r"weights\.safetensors is corrupt"):
        kvtrace.load(bad_weights)
    bad_program = rewrite(path, tmp_path / "p.kvt", {program: b"{}"}, rehash=True)
    match = "is not a serialized program" if backend == "exported" else "aoti.pt2 is not a readable package"
    with pytest.raises(ArtifactError, match=match):
        kvtrace.load(bad_program)
    if backend == "exported":  # valid JSON of the wrong shape gets past the parser, then torch refuses it
        graph = json.loads(member(path, program))
        del graph["graph_module"]["graph"]["nodes"]
        bad_graph = rewrite(path, tmp_path / "g.kvt", {program: json.dumps(graph).encode()}, rehash=True)
        with pytest.raises(ArtifactError, match=r"could not load the exported programs.*the file is corrupt"):
            kvtrace.load(bad_graph)
        other_torch = with_manifest(bad_graph, tmp_path / "t.kvt", torch_version="1.0.0")
        with pytest.raises(ArtifactError, match=re.escape(f"written by torch 1.0.0, this is torch {torch.__version__}")):
            kvtrace.load(other_torch)


def test_missing_file_and_directory_paths(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        kvtrace.load(tmp_path / "nope.kvt")
    with pytest.raises(UsageError, match="is a directory; expected an artifact file"):
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
        written = Manifest.from_json(zf.read("manifest.json").decode())
    assert dataclasses.replace(written, members={}, weights={}) == m  # the rest as given
    assert written.weights == {"b": {"shape": [2], "dtype": "float32"}}
    assert set(written.members) == {"weights.safetensors", "programs/x.json", "tokenizer.json"}
    assert written.members["tokenizer.json"] == {"size": 10, "sha256": hashlib.sha256(b'{"tok": 1}').hexdigest()}


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
    # manifests of version 1 mapped names to signature strings; version 2 refuses them (no specs, no checks)
    raw["programs"] = {"prefill": "(tokens[B,T] ...)", "decode": "(tokens[B,1] ...)"}
    with pytest.raises(ArtifactError, match="programs must be an object of program specs"):
        Manifest.from_json(json.dumps(raw))
    raw["programs"] = {"prefill": {}}
    with pytest.raises(ArtifactError, match="expected at least prefill and decode"):
        Manifest.from_json(json.dumps(raw))
