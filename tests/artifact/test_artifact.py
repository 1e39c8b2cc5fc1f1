"""The artifact file: manifest contents, loading without transformers or pickle, corrupt, foreign,
inconsistent and hostile files (#12: hashes, sizes, zip bombs, pickles in the .pt2, consistency of the
manifest with the programs)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

import kvtrace
from conftest import tiny_model
from kvtrace._errors import ArtifactError, UsageError
from kvtrace.artifact.archive import FORMAT, VERSION, Manifest, write_artifact
from kvtrace.backends import registry
from kvtrace.models.hf_generic import hf_cache_spec
from kvtrace.models.step import LIVE_PROGRAMS
from kvtrace.spec.program import DEFAULT_PROGRAMS, ProgramSpec
from kvtrace.spec.tolerances import close, tolerance_for

MAX_SEQ_LEN = 24
PROMPT = [[5, 17, 42, 8, 99, 3, 64]]
TOL = tolerance_for(torch.float32)
EXPECTED_ENTRIES = {
    "exported": {"manifest.json", "weights.safetensors", "programs/prefill.json", "programs/decode.json"},
    "aoti": {"manifest.json", "weights.safetensors", "programs/aoti.pt2"},
}


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """backend -> (backend, model, path): one tiny artifact per backend and module (an aoti one compiles ~30 s)."""
    done: dict[str, tuple[str, torch.nn.Module, Path]] = {}

    def get(backend: str) -> tuple[str, torch.nn.Module, Path]:
        if backend not in done:
            model = tiny_model("llama", eos_token_id=[2, 7])
            path = tmp_path_factory.mktemp(f"artifact-{backend}") / "tiny.kvt"
            kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=backend)
            done[backend] = (backend, model, path)
        return done[backend]

    return get


@pytest.fixture(scope="module", params=["exported", pytest.param("aoti", marks=pytest.mark.compile)])
def built(request, build):
    return build(request.param)


@pytest.fixture(scope="module")
def exported(build):
    return build("exported")[2]


@pytest.fixture(scope="module")
def aoti(build):
    return build("aoti")[2]


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
    expected = {p.name: p for p in LIVE_PROGRAMS}  # a Llama: attention over the live cache prefix
    # aoti: one library, prefill's (T symbolic), serves decode (backends/test_aoti_shared.py), but on a CPU where
    # decode's one-row linears are compiled as reductions of their own (backends/test_one_row.py)
    shared = backend == "aoti" and not registry.get("aoti").one_row_reductions(torch.float32, {"cpu"})
    if shared:
        expected["decode"] = dataclasses.replace(expected["decode"], served_by="prefill")
    assert m.programs == expected and set(m.signatures) == ({"prefill"} if shared else set(expected))
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
    if backend != "aoti":  # aoti: prefill's program (signed above, T symbolic) serves decode
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
    weights = bytearray(member(path, "weights.safetensors"))
    weights[-1] ^= 1  # the weights member is read outside zipfile (no CRC check there): the hash still sees it
    bad_hash = rewrite(path, tmp_path / "wh.kvt", {"weights.safetensors": bytes(weights)})
    with pytest.raises(ArtifactError, match=r"member weights\.safetensors does not match the SHA-256 its manifest"):
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
    from kvtrace.spec.program import InputSpec

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


# --- #12 item 5: sizes, hashes, unknown members, zip bombs -------------------------------------
def test_unknown_members_are_refused_before_they_are_read(exported, tmp_path):
    bad = rewrite(exported, tmp_path / "extra.kvt", {"notes.txt": b"hello"})
    with pytest.raises(ArtifactError, match=r"holds member\(s\) \['notes.txt'\] that its manifest does not list"):
        kvtrace.load(bad)
    listed = rewrite(exported, tmp_path / "listed.kvt", {"programs/evil.json": b"{}"}, rehash=True)
    with pytest.raises(ArtifactError, match=r"\['programs/evil.json'\] do not belong to a exported artifact"):
        kvtrace.load(listed)
    twice = tmp_path / "twice.kvt"
    twice.write_bytes(exported.read_bytes())
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(twice, "a") as zf:
        zf.writestr("weights.safetensors", b"shadow")
    with pytest.raises(ArtifactError, match=r"lists member\(s\) \['weights.safetensors'\] twice"):
        kvtrace.load(twice)


def _add_bomb(src: Path, dst: Path, name: str, size: int, declare: bool) -> Path:
    """``src`` plus a member of ``size`` zero bytes, deflated (~1000x) and streamed (never in memory);
    ``declare``: listed in the manifest with its true size and hash, as a forger would."""
    h = hashlib.sha256()
    for _ in range(size >> 20):
        h.update(bytes(1 << 20))
    d = manifest_dict(src)
    if declare:
        d["members"][name] = {"size": size, "sha256": h.hexdigest()}
    rewrite(src, dst, {"manifest.json": json.dumps(d).encode()})
    with zipfile.ZipFile(dst, "a", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf, zf.open(name, "w") as f:
        for _ in range(size >> 20):
            f.write(bytes(1 << 20))
    return dst


BOMB_SCRIPT = r"""
import resource, sys
import kvtrace
from kvtrace._errors import ArtifactError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    kvtrace.load(sys.argv[1])
    print("loaded")
except ArtifactError as e:
    print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "ArtifactError:", e)
"""


@pytest.mark.parametrize("declare", [False, True], ids=["unlisted", "declared"])
def test_a_zip_bomb_is_refused_before_it_is_decompressed(exported, tmp_path, declare):
    size = 256 << 20
    bomb = _add_bomb(exported, tmp_path / "bomb.kvt", "tokenizer.json", size, declare)
    assert bomb.stat().st_size < exported.stat().st_size + (size >> 9)  # 256 MiB in well under 1 MiB
    proc = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, str(bomb)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.strip().splitlines()[-1]
    expected = "zip bomb" if declare else "that its manifest does not list"
    assert "ArtifactError" in out and expected in out, out
    assert int(out.split()[1]) < 32 << 10, out  # max RSS grew by < 32 MiB (it grew by the member's size before)


def test_a_directory_of_too_many_members_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    from kvtrace.artifact import reader as _artifact

    many = tmp_path / "many.kvt"
    with zipfile.ZipFile(many, "w") as zf:
        for i in range(40):
            zf.writestr(f"m{i}", b"")
    parsed = []
    monkeypatch.setattr(_artifact, "MAX_MEMBERS", 32)
    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", lambda self: parsed.append(1))
    with pytest.raises(ArtifactError, match=r"zip directory lists 40 members \(.*at most 32"):
        kvtrace.load(many)
    assert parsed == []  # refused from the end record, before zipfile read the directory


def test_member_size_ceiling_and_compression_method(exported, tmp_path):
    from kvtrace.artifact import reader as _artifact

    d = manifest_dict(exported)
    d["members"]["tokenizer.json"] = {"size": 5, "sha256": hashlib.sha256(b"ab\xffcd").hexdigest()}
    lzma = rewrite(exported, tmp_path / "lz.kvt", {"manifest.json": json.dumps(d).encode()})
    with zipfile.ZipFile(lzma, "a") as zf:
        zf.writestr("tokenizer.json", b"ab\xffcd", compress_type=zipfile.ZIP_LZMA)
    with pytest.raises(ArtifactError, match="uses zip compression method 14"):
        kvtrace.load(lzma)
    weights = manifest_dict(exported)["members"]["weights.safetensors"]["size"]
    _artifact.MEMBER_MAX_BYTES, saved = weights - 1, _artifact.MEMBER_MAX_BYTES
    try:
        with pytest.raises(ArtifactError, match=rf"weights.safetensors claims {weights} bytes .*at most {weights - 1}"):
            kvtrace.load(exported)
    finally:
        _artifact.MEMBER_MAX_BYTES = saved


def test_expected_sha256_is_checked_before_anything_is_parsed(exported, tmp_path):
    digest = hashlib.sha256(exported.read_bytes()).hexdigest()
    assert kvtrace.load(exported, expected_sha256=digest).manifest.backend == "exported"
    assert kvtrace.load(exported, expected_sha256=digest.upper()).manifest.backend == "exported"
    with pytest.raises(ArtifactError, match=f"has SHA-256 {digest}, expected {'0' * 64}.*nothing in it was read"):
        kvtrace.load(exported, expected_sha256="0" * 64)
    noise = tmp_path / "noise.kvt"
    noise.write_bytes(b"not a zip at all")  # a hash mismatch, not a zip error: nothing was parsed
    with pytest.raises(ArtifactError, match="has SHA-256"):
        kvtrace.load(noise, expected_sha256=digest)
    for bad in ("abc", 123, "g" * 64):
        with pytest.raises(UsageError, match="expected_sha256 must be 64 hex digits"):
            kvtrace.load(exported, expected_sha256=bad)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_artifacts_are_written_with_the_callers_umask(tmp_path, umask):
    spec = hf_cache_spec(tiny_model("llama").config, max_seq_len=8, batch_size=1, dtype=torch.float32)
    m = Manifest(backend="exported", cache_spec=spec, vocab_size=128, programs={p.name: p for p in DEFAULT_PROGRAMS})
    old = os.umask(umask)
    try:
        out = write_artifact(tmp_path / "m.kvt", m, {"b": torch.ones(2)}, {}, None)
        plain = tmp_path / "plain"
        plain.write_bytes(b"")  # what any new file gets under this umask
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o666 & ~umask


# --- #12 item 7 + 4: inconsistent members of an exported artifact -------------------------------
def _weights_blob(path: Path, change) -> tuple[bytes, dict]:
    from safetensors.torch import load, save

    weights = load(member(path, "weights.safetensors"))
    change(weights)
    table = {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in weights.items()}
    return save(weights), table


@pytest.mark.parametrize(("change", "match"), [
    (lambda w: w.update({"tok_embeddings.weight": w["tok_embeddings.weight"][:64].clone()}),
     r"program \w+ reads weight tok_embeddings.weight as float32 \[128, 64\], but weights.safetensors holds "
     r"float32 \[64, 64\]"),
    (lambda w: w.update({"norm": w["norm"].double()}), r"reads weight norm as float32 \[64\].*holds float64 \[64\]"),
    (lambda w: w.pop("norm"), r"reads weight\(s\) \['norm'\] that weights.safetensors does not hold"),
])
def test_exported_weights_of_the_wrong_shape_or_dtype_are_refused(exported, tmp_path, change, match):
    blob, table = _weights_blob(exported, change)
    d = {**manifest_dict(exported), "weights": table}  # the weight table edited consistently too
    bad = rewrite(exported, tmp_path / "w.kvt", {"weights.safetensors": blob, "manifest.json": json.dumps(d).encode()})
    bad = rewrite(bad, tmp_path / "w2.kvt", {}, rehash=True)
    with pytest.raises(ArtifactError, match=match):
        kvtrace.load(bad)


def test_weights_that_disagree_with_the_manifests_weight_table_are_refused(exported, tmp_path):
    blob, _ = _weights_blob(exported, lambda w: w.update({"norm": w["norm"][:32].clone()}))
    bad = rewrite(exported, tmp_path / "w.kvt", {"weights.safetensors": blob}, rehash=True)
    with pytest.raises(ArtifactError, match=r"weight norm is float32 \[32\], the manifest says float32 \[64\]"):
        kvtrace.load(bad)
    blob, _ = _weights_blob(exported, lambda w: w.update({"extra": torch.ones(1)}))
    bad = rewrite(exported, tmp_path / "x.kvt", {"weights.safetensors": blob}, rehash=True)
    with pytest.raises(ArtifactError, match=r"holds other weights than the manifest lists \(differ: \['extra'\]\)"):
        kvtrace.load(bad)


@pytest.mark.parametrize("aliases", [{"lm_head.weight": "nope"}, {"norm": "tok_embeddings.weight"}])
def test_a_weight_alias_to_a_missing_or_stored_weight_is_refused(exported, tmp_path, aliases):
    bad = with_manifest(exported, tmp_path / "a.kvt", weight_aliases=aliases)
    with pytest.raises(ArtifactError, match=r"weight alias .* names a"):
        kvtrace.load(bad)


def test_a_tokenizer_that_is_not_utf8_or_not_a_tokenizer_is_refused(exported, tmp_path):
    bad = rewrite(exported, tmp_path / "t.kvt", {"tokenizer.json": b"\xff\xfe{}"}, rehash=True)
    with pytest.raises(ArtifactError, match=r"tokenizer.json is not UTF-8 text"):
        kvtrace.load(bad)
    art = kvtrace.load(rewrite(exported, tmp_path / "j.kvt", {"tokenizer.json": b"{}"}, rehash=True))
    with pytest.raises(ArtifactError, match=r"tokenizer.json is not a readable tokenizer"):
        art.tokenizer()


def test_the_tokenizer_is_parsed_once_and_shared(exported, tmp_path):
    import tokenizers

    text = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1}, unk_token="a")).to_str()
    art = kvtrace.load(rewrite(exported, tmp_path / "t.kvt", {"tokenizer.json": text.encode()}, rehash=True))
    tok = art.tokenizer()
    assert tok.token_to_id("b") == 1 and art.tokenizer() is tok  # generate asks for it twice per start


def _edit_spec(path: Path, dst: Path, *, heads: int | None = None, max_seq_len: int | None = None,
               signatures: bool = False) -> Path:
    """The manifest's CacheSpec edited (KV heads / max_seq_len); ``signatures``: the recorded program
    signatures edited to agree with it, as a careful forger would."""
    d = manifest_dict(path)
    spec = d["cache_spec"]
    for layer in spec["layers"]:
        layer["n_kv_heads"] = heads or layer["n_kv_heads"]
        layer["max_len"] = max_seq_len or layer["max_len"]
    spec["max_seq_len"] = max_seq_len or spec["max_seq_len"]
    if signatures:
        b = spec["batch_size"]
        for sig in d["signatures"].values():
            for i in sig[-2 * len(spec["layers"]):]:
                i["shape"] = [b, spec["layers"][0]["n_kv_heads"], spec["max_seq_len"], i["shape"][3]]
    return rewrite(path, dst, {"manifest.json": json.dumps(d).encode()})


@pytest.mark.parametrize("signatures", [False, True], ids=["spec-only", "spec-and-signatures"])
@pytest.mark.parametrize("edit", [dict(heads=4), dict(max_seq_len=48)], ids=["heads", "max_seq_len"])
def test_exported_cache_spec_that_disagrees_with_the_programs_is_refused(exported, tmp_path, edit, signatures):
    bad = _edit_spec(exported, tmp_path / "s.kvt", **edit, signatures=signatures)
    where = "as recorded at export" if not signatures else r"program \w+ was built for cache"
    with pytest.raises(ArtifactError, match=rf"{where}.*the artifact is inconsistent"):
        kvtrace.load(bad)


def test_exported_vocab_size_and_program_specs_are_checked_against_the_graph(exported, tmp_path):
    with pytest.raises(ArtifactError, match=r"program \w+ returns \(1, \w+, 128\) logits, the manifest declares vocab_size 1000"):
        kvtrace.load(with_manifest(exported, tmp_path / "v.kvt", vocab_size=1000))
    d = manifest_dict(exported)
    d["programs"]["prefill"]["key_pos"] = d["programs"]["decode"]["key_pos"] = False
    with pytest.raises(ArtifactError, match=r"takes 7 inputs, but the manifest's CacheSpec and program spec declare 6"):
        kvtrace.load(rewrite(exported, tmp_path / "k.kvt", {"manifest.json": json.dumps(d).encode()}))


# --- #12 item 3: no pickle on the load path, even from a crafted .pt2 ---------------------------
class _Payload:
    """Unpickling this creates ``marker``: proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickled_pt2(base: bytes | None, marker: Path, root: str = "aoti") -> bytes:
    """A .pt2 package (``base``'s members, if any) plus an exported program whose weight payload says
    ``use_pickle`` and holds ``_Payload``: torch's package loader unpickles it with weights_only=False."""
    import io
    import pickle

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return x * self.w

    buf = io.BytesIO()
    torch.export.save(torch.export.export(Scale(), (torch.ones(2),)), buf)
    entries: dict[str, bytes] = {}
    if base is not None:
        with zipfile.ZipFile(io.BytesIO(base)) as z:
            entries.update({i.filename: z.read(i) for i in z.infolist()})
    with zipfile.ZipFile(buf) as z:
        for i in z.infolist():
            entries.setdefault(f"{root}/{i.filename.split('/', 1)[1]}", z.read(i))
    config_name = f"{root}/data/weights/model_weights_config.json"
    config = json.loads(entries[config_name])
    for meta in config["config"].values():
        meta["use_pickle"] = True
        entries[f"{root}/data/weights/{meta['path_name']}"] = pickle.dumps(_Payload(marker))
    entries[config_name] = json.dumps(config).encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, blob in entries.items():
            z.writestr(name, blob)
    return out.getvalue()


def _torch_loader_runs_the_payload(pt2: bytes, tmp_path: Path, marker: Path) -> bool:
    """Positive control: torch's own package loader on the same .pt2 runs the pickle."""
    from torch._inductor.package import load_package

    f = tmp_path / "control.pt2"
    f.write_bytes(pt2)
    with contextlib.suppress(Exception):
        load_package(str(f), "prefill")
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran


def test_a_pickle_inside_the_pt2_never_runs(exported, tmp_path):
    """An "aoti" artifact (forged from the exported one: same programs and signatures, no compile needed)
    whose package holds a pickled weight payload: refused before torch sees the package."""
    marker = tmp_path / "payload-ran"
    pt2 = pickled_pt2(None, marker)
    assert _torch_loader_runs_the_payload(pt2, tmp_path, marker)
    d = {**manifest_dict(exported), "backend": "aoti"}
    forged = rewrite(exported, tmp_path / "forged.kvt", {"programs/prefill.json": None, "programs/decode.json": None,
                                                           "programs/aoti.pt2": pt2, "manifest.json": json.dumps(d).encode()})
    forged = rewrite(forged, tmp_path / "forged2.kvt", {}, rehash=True)
    with pytest.raises(ArtifactError, match=r"aoti.pt2 holds 'aoti/.*', which kvtrace never writes"):
        kvtrace.load(forged)
    assert not marker.exists()


@pytest.mark.compile
def test_a_pickle_added_to_a_real_aoti_package_never_runs(aoti, tmp_path):
    marker = tmp_path / "payload-ran"
    pt2 = pickled_pt2(member(aoti, "programs/aoti.pt2"), marker)
    assert _torch_loader_runs_the_payload(pt2, tmp_path, marker)
    bad = rewrite(aoti, tmp_path / "pickled.kvt", {"programs/aoti.pt2": pt2}, rehash=True)
    with pytest.raises(ArtifactError, match=r"which kvtrace never writes.*refusing to load it"):
        kvtrace.load(bad)
    assert not marker.exists()
    # every other kind of member torch's packaging knows is refused as well
    for extra in ("aoti/data/constants/custom_obj_0", "aoti/data/aotinductor/prefill/custom_objs_config.json",
                  "aoti/extra/notes", "aoti/data/aotinductor/prefill/prefill_compile_flags.o"):
        with zipfile.ZipFile(io.BytesIO(member(aoti, "programs/aoti.pt2"))) as z:
            entries = {i.filename: z.read(i) for i in z.infolist()}
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for name, blob in {**entries, extra: b"x"}.items():
                z.writestr(name, blob)
        bad = rewrite(aoti, tmp_path / "extra.kvt", {"programs/aoti.pt2": buf.getvalue()}, rehash=True)
        with pytest.raises(ArtifactError, match=re.escape(f"holds {extra!r}")):
            kvtrace.load(bad)


# --- #12 item 4: an inconsistent aoti artifact is refused, never run -----------------------------
CHECK_SCRIPT = r"""
import sys, torch, kvtrace
from kvtrace._errors import ArtifactError
try:
    art = kvtrace.load(sys.argv[1])
    s = art.session()
    logits = s.prefill(torch.tensor([[5, 17, 42]]))
    s.decode(torch.tensor([[3]]))
    print("LOADED finite" if bool(torch.isfinite(logits).all()) else "LOADED nonfinite")
except ArtifactError as e:
    print("ArtifactError:", e)
"""


def load_in_subprocess(path: Path) -> str:
    """Load + prefill + decode in a fresh process; a crash (signal, abort) fails the test, not pytest."""
    proc = subprocess.run([sys.executable, "-c", CHECK_SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by a signal): {proc.stderr[-2000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.compile
@pytest.mark.parametrize(("edit", "match"), [
    (dict(heads=4), r"program \w+ \(as recorded at export\) was built for cache layers.0.k float32 \[1, 2, 24, 16\]"),
    (dict(heads=4, signatures=True), r"program \w+ refuses the inputs its manifest declares \(input_handles\[3\]: "
                                     r"unmatched dim value at 1, expected: 2, but got: 4\)"),
    (dict(max_seq_len=48, signatures=True), r"refuses the inputs its manifest declares \(input_handles\[3\]: "
                                            r"unmatched dim value at 2, expected: 24, but got: 48\)"),
    (dict(max_seq_len=12, signatures=True), r"unmatched dim value at 2, expected: 24, but got: 12"),
], ids=["heads", "heads-and-signatures", "longer-max_seq_len", "shorter-max_seq_len"])
def test_aoti_cache_spec_edits_are_refused_instead_of_corrupting_memory(aoti, tmp_path, edit, match):
    bad = _edit_spec(aoti, tmp_path / "edited.kvt", **edit)
    out = load_in_subprocess(bad)
    assert out.startswith("ArtifactError:") and re.search(match, out), out


@pytest.mark.compile
@pytest.mark.parametrize(("change", "match"), [
    (lambda w: w.update({"tok_embeddings.weight": w["tok_embeddings.weight"][:64].clone()}),
     r"compiled for weight tok_embeddings.weight as float32 of 32768 bytes \(64-byte aligned\), but weights.safetensors holds "
     r"float32 \[64, 64\] \(16384 bytes\)"),
    (lambda w: w.update({"norm": w["norm"].to(torch.bfloat16)}), r"weight norm as float32 of 256 bytes.*bfloat16"),
    (lambda w: w.update({"norm": w["norm"][:48].clone()}), r"weight norm as float32 of 256 bytes.*\(192 bytes\)"),
    (lambda w: w.pop("norm"), r"reads weight norm, which weights.safetensors does not hold"),
])
def test_aoti_weights_of_another_size_or_dtype_are_refused(aoti, tmp_path, change, match):
    blob, table = _weights_blob(aoti, change)
    d = {**manifest_dict(aoti), "weights": table}  # the weight table agrees: only the library can tell
    bad = rewrite(aoti, tmp_path / "w.kvt", {"weights.safetensors": blob, "manifest.json": json.dumps(d).encode()})
    out = load_in_subprocess(rewrite(bad, tmp_path / "w2.kvt", {}, rehash=True))
    assert out.startswith("ArtifactError:") and re.search(match, out), out


@pytest.mark.compile
def test_aoti_vocab_size_is_checked_against_the_probe(aoti, tmp_path):
    out = load_in_subprocess(with_manifest(aoti, tmp_path / "v.kvt", vocab_size=1000))
    assert out.startswith("ArtifactError:") and "declares logits [B, T, 1000]" in out, out
    assert load_in_subprocess(aoti) == "LOADED finite"


@pytest.mark.compile
def test_aoti_runtime_input_checks_stay_on_after_load(aoti):
    art = kvtrace.load(aoti)
    spec = art.cache_spec
    ok = [torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)]
    assert art._programs["decode"](*ok, *spec.allocate()).shape == (1, 1, 128)  # T = L = 1: no lower bound of 2
    short = [torch.zeros(1, 2, 12, 16) for _ in spec.buffers()]  # a cache of 12 slots for a program of 24
    with pytest.raises(RuntimeError, match="unmatched dim value at 2, expected: 24, but got: 12"):
        art._programs["decode"](*ok, *short)
    assert os.environ.get("AOTI_RUNTIME_CHECK_INPUTS") is None  # latched in the library, not left in the env


@pytest.mark.compile
def test_aoti_temp_dirs_are_removed_on_every_path(aoti, tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp / f"kvtrace-aoti-{int(dead.stdout)}-killed"  # left by a load whose process was killed
    live = tmp / f"kvtrace-aoti-{os.getppid()}-busy"  # another process's load in progress
    for d in (stale, live):
        d.mkdir()
        (d / "prefill.so").write_bytes(b"x")
    art = kvtrace.load(aoti)
    assert sorted(p.name for p in tmp.iterdir()) == [live.name]  # ours removed after loading, the stale one too
    assert art.session().prefill(torch.tensor(PROMPT)).shape == (1, len(PROMPT[0]), 128)  # still runs
    with pytest.raises(ArtifactError):
        kvtrace.load(_edit_spec(aoti, tmp_path / "bad.kvt", heads=4, signatures=True))
    assert sorted(p.name for p in tmp.iterdir()) == [live.name]  # a failed load leaves nothing either


# --- #12 item 7: the CLI on a corrupt artifact: exit 2, one line -----------------------------------
def test_cli_on_a_corrupt_artifact_exits_2_with_one_line(exported, tmp_path):
    data = bytearray(exported.read_bytes())
    data[len(data) // 3] ^= 0x55
    bad = tmp_path / "corrupt.kvt"
    bad.write_bytes(bytes(data))
    code = "import sys; from kvtrace.cli.main import main; sys.exit(main(sys.argv[1:]))"
    for argv in (["run", str(bad), "--prompt", "hi"], ["run", str(tmp_path), "--prompt", "hi"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
        assert len(lines) == 1 and "Traceback" not in proc.stderr and lines[0].startswith("kvtrace run: error:"), lines
