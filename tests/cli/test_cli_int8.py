"""--kv-dtype int8 through the CLI on a tiny HF model dir: export writes an int8-cache artifact, verify picks
the same-decoder int8 reference from its manifest and reports the error vs the unquantized cache."""

from __future__ import annotations

import json

import pytest

import kvtrace
from conftest import make_tiny_hf_dir
from kvtrace.cli.main import main


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf_int8")
    make_tiny_hf_dir(d)
    return d


def test_export_and_verify_an_int8_cache_artifact(hf_dir, tmp_path, capsys):
    art = tmp_path / "int8.kvt"
    assert main(["export", str(hf_dir), "-o", str(art), "--max-seq-len", "32", "--kv-dtype", "int8", "-q"]) == 0
    spec = kvtrace.load(art).cache_spec
    assert spec.kv_dtype == "int8" and {b.dtype for b in spec.buffers()} == {"int8", "float16"}
    capsys.readouterr()
    out = tmp_path / "report.json"
    code = main(["verify", str(hf_dir), "--artifact", str(art), "--against", "", "--steps", "3", "--raw",
                 "--prompt", "hello world the cat", "--max-seq-len", "32", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    (s,) = report["summary"]
    assert report["passed"] and s["candidate"] == "int8.kvt" and s["reference"] == "decoder-eager-int8"
    assert "kv_rule" in report["tolerance"] and "not judged" in text
    (u,) = report["vs_fp32"]["summary"]
    assert report["vs_fp32"]["judged"] is False and u["reference"] == "eager" and 0 < u["kv_max_abs"] < 0.05
    # judged with the reference's noise floor too (two perturbed eager runs), shown in the table and the JSON
    floor = report["noise_floors"]["int8.kvt"]
    assert s["noise_floor"] == floor and floor["perturbations"] == ["float64-linear", "split-k-linear"]
    assert floor["steps"] == s["steps"] and len(floor["k"]) == len(floor["v"]) > 0
    assert "noise_rule" in report["tolerance"] and "noise floor" in text
    assert sum(s["judged_by"].values()) == s["steps"] and {r["rule"] for r in report["rows"]} <= {"tolerance",
                                                                                                "noise floor"}


def test_verify_without_the_noise_floor(hf_dir, tmp_path, capsys):
    art = tmp_path / "int8.kvt"
    assert main(["export", str(hf_dir), "-o", str(art), "--max-seq-len", "32", "--kv-dtype", "int8", "-q"]) == 0
    out = tmp_path / "report.json"
    code = main(["verify", str(hf_dir), "--artifact", str(art), "--against", "", "--steps", "2", "--raw",
                 "--prompt", "hello world", "--max-seq-len", "32", "--json", str(out), "--no-noise-floor"])
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert "noise_floors" not in report and "noise_rule" not in report["tolerance"]
    assert report["summary"][0]["noise_floor"] is None


def test_verify_against_exports_with_the_kv_dtype_flag(hf_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["verify", str(hf_dir), "--against", "exported", "--kv-dtype", "int8", "--steps", "2", "--raw",
                 "--prompt", "hello world", "--max-seq-len", "32", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [s["reference"] for s in report["summary"]] == ["decoder-eager-int8"]


def test_the_artifact_cache_key_includes_the_kv_dtype():
    from kvtrace.artifact.store import artifact_key

    opts = dict(backend="aoti", max_seq_len=64, dtype="float32", batch_size=1)
    assert artifact_key("abc", **opts, kv_dtype="int8") != artifact_key("abc", **opts)
    assert artifact_key("abc", **opts, kv_dtype="auto") == artifact_key("abc", **opts)  # auto: as before


def test_unknown_kv_dtype_is_one_line_exit_2(hf_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse refuses it before anything is loaded
        main(["export", str(hf_dir), "-o", str(tmp_path / "x.kvt"), "--kv-dtype", "int4"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--kv-dtype" in line and "int8" in line
