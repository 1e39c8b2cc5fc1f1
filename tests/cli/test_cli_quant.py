"""--quant through the CLI: export writes a quantized artifact, verify picks the same-quantization reference from
its manifest (and reports the error vs the unquantized model), bench takes a list, a GGUF keeps its blocks."""

from __future__ import annotations

import json

import pytest

import kvtrace
from conftest import make_tiny_hf_dir
from helpers import write_gguf
from kvtrace.cli.main import main


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf_quant")
    make_tiny_hf_dir(d)
    return d


def test_export_and_verify_an_int4_artifact(hf_dir, tmp_path, capsys):
    art = tmp_path / "int4.kvt"
    assert main(["export", str(hf_dir), "-o", str(art), "--max-seq-len", "32", "--quant", "int4",
                 "--quant-group-size", "64", "-q"]) == 0
    q = kvtrace.load(art).manifest.quant
    assert q.scheme == "int4" and q.group_size == 64 and set(q.tensors.values()) >= {"int4", "int8"}
    capsys.readouterr()
    out = tmp_path / "report.json"
    code = main(["verify", str(hf_dir), "--artifact", str(art), "--against", "", "--steps", "3", "--raw",
                 "--prompt", "hello world the cat", "--max-seq-len", "32", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    (s,) = report["summary"]
    assert report["passed"] and s["reference"] == "decoder-eager-int4-g64" and "quant_rule" in report["tolerance"]
    assert "not judged" in text and "quantized weights" in text
    (u,) = report["vs_fp32"]["summary"]
    assert report["vs_fp32"]["judged"] is False and u["reference"] == "eager" and u["logits_max_abs"] > 0


def test_verify_against_exports_with_the_quant_flag(hf_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["verify", str(hf_dir), "--against", "exported", "--quant", "8da4w", "--steps", "2", "--raw",
                 "--prompt", "hello world", "--max-seq-len", "32", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    assert [s["reference"] for s in json.loads(out.read_text())["summary"]] == ["decoder-eager-8da4w-g32"]


def test_gguf_quant_on_a_gguf_and_refused_elsewhere(hf_dir, tmp_path, capsys):
    gguf = write_gguf(tmp_path / "q41.gguf", qtype="Q4_1", embd_qtype="Q8_0")
    art = tmp_path / "g.kvt"
    assert main(["export", str(gguf), "-o", str(art), "--max-seq-len", "16", "--quant", "gguf", "-q"]) == 0
    assert kvtrace.load(art).manifest.quant.tensors["tok_embeddings"] == "q8_0"
    capsys.readouterr()
    code = main(["verify", str(gguf), "--artifact", str(art), "--against", "", "--steps", "2", "--raw",
                 "--prompt", "ab c", "--max-seq-len", "16"])
    assert code == 0, capsys.readouterr().out
    assert main(["export", str(hf_dir), "-o", str(tmp_path / "x.kvt"), "--max-seq-len", "16", "--quant", "gguf",
                 "-q"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("kvtrace export: error")]
    assert "GGUF" in line and "int8" in line and not (tmp_path / "x.kvt").exists()


def test_unknown_quant_is_one_line_exit_2(hf_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # argparse refuses it before anything is loaded
        main(["export", str(hf_dir), "-o", str(tmp_path / "x.kvt"), "--quant", "int3"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--quant" in line and "int4" in line
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quant", "none,int4,int4"])
    assert e.value.code == 2 and "without repeats" in capsys.readouterr().err


def test_bench_puts_quantized_rows_side_by_side(hf_dir):
    from conftest import tiny_model
    from kvtrace.tools.bench import render_markdown, run_bench

    data = run_bench(model=tiny_model("llama"), backends=("hf-eager", "exported"), prompt_lens=(4,), new_tokens=4,
                     runs=1, max_seq_len=32, quants=("none", "int8", "int4"), fresh_process=False)
    rows = [(r["backend"], r["quant"]) for r in data["results"]]
    assert rows == [("hf-eager", "none"), ("exported", "none"), ("exported", "int8"), ("exported", "int4")]
    by = {r["quant"]: r for r in data["results"] if r["backend"] == "exported"}
    assert all(not r["error"] for r in by.values()), [r["error"] for r in by.values()]
    assert by["int4"]["bytes_per_token"] < by["int8"]["bytes_per_token"] < by["none"]["bytes_per_token"]
    assert by["int4"]["artifact_mib"] < by["none"]["artifact_mib"]
    assert "| exported | float32 | int4 | auto | 4 |" in render_markdown(data)


@pytest.mark.parametrize(("argv", "backend"), [
    ([], "aoti"), (["--quant", "int4"], "aoti-packed"), (["--quant", "int8"], "aoti-packed"),
    (["--quant", "8da4w"], "aoti-packed"), (["--quant", "gguf"], "aoti"), (["--quant", "int4", "--backend", "aoti"], "aoti"),
    (["--quant", "int4", "--no-tiered"], "aoti-packed")])
def test_generate_builds_quantized_weights_on_aoti_packed_unless_told_otherwise(argv, backend, monkeypatch, capsys):
    seen = []

    def build(source, *, backend, **kw):
        seen.append(backend)
        raise kvtrace.UsageError("stopped before building")

    monkeypatch.setattr("kvtrace.artifact.store.cached_artifact", build)
    monkeypatch.setattr("kvtrace.artifact.tiered.start", build)
    assert main(["generate", "hi", *argv]) == 2
    assert seen == [backend] and "stopped before building" in capsys.readouterr().err


@pytest.mark.parametrize(("cmd", "argv", "want"), [
    ("generate", [], ("aoti", "gguf")),  # the default model: Q4_1 blocks, a Q8_0 embedding
    ("generate", ["--quant", "none"], ("aoti", "none")),
    ("generate", ["--backend", "exported"], ("exported", "gguf")),
    ("generate", ["--backend", "aoti-packed"], ("aoti-packed", "none")),  # it takes no GGUF blocks
    ("generate", ["--backend", "executorch"], ("executorch", "none")),
    ("generate", ["--dtype", "bfloat16"], ("aoti", "none")),
    ("generate", ["--kv-dtype", "int8"], ("aoti", "none")),
    ("generate", ["--no-tiered"], ("aoti", "gguf")),
    ("generate", ["--quant", "int8"], ("aoti-packed", "int8")),
    ("chat", [], ("aoti", "gguf")),
    ("chat", ["--quant", "none"], ("aoti", "none"))])
def test_a_gguf_sources_blocks_are_kept_by_default_where_the_run_can_keep_them(cmd, argv, want, monkeypatch, capsys):
    """--quant auto (generate's and chat's default): the GGUF's own blocks (the same numbers as its float32
    weights, a fraction of the bytes a token reads) where the backend, dtype and device take them."""
    seen = []

    def build(source, *, backend, quant=None, **kw):
        seen.append((backend, quant))
        raise kvtrace.UsageError("stopped before building")

    monkeypatch.setattr("kvtrace.artifact.store.cached_artifact", build)
    monkeypatch.setattr("kvtrace.artifact.tiered.start", build)
    assert main([cmd, *(["hi"] if cmd == "generate" else []), *argv]) == 2
    assert seen == [want] and "stopped before building" in capsys.readouterr().err


def test_quant_auto_keeps_blocks_only_for_a_gguf_stored_mostly_as_kept_blocks(hf_dir, tmp_path):
    import argparse

    from kvtrace.cli.args import chosen_quant
    from kvtrace.sources.gguf_blocks import kept_share

    q41 = write_gguf(tmp_path / "q41.gguf", qtype="Q4_1")
    f16 = write_gguf(tmp_path / "f16.gguf", qtype="F16")
    mixed = write_gguf(tmp_path / "mixed.gguf", qtype="F16", qtypes={"blk.0.ffn_up.weight": "Q8_0"})
    assert kept_share(q41) > 0.95 and kept_share(f16) == 0.0 and 0 < kept_share(mixed) < 0.5

    def auto(model):
        return chosen_quant(argparse.Namespace(model=str(model), quant="auto", backend=None, dtype="float32"))

    assert (auto(q41), auto(f16), auto(mixed), auto(hf_dir)) == ("gguf", "none", "none", "none")
    for arch in ("qwen2", "qwen3", "phi3"):  # the other families whose GGUF-native programs verify (test_quant.py)
        other = write_gguf(tmp_path / f"{arch}.gguf", arch, qtype="Q4_1")
        assert kept_share(other) > 0.95 and auto(other) == "gguf", arch
    assert auto(write_gguf(tmp_path / "qwen2-f16.gguf", "qwen2", qtype="F16")) == "none"


def test_kept_type_ids_are_the_gguf_packages():
    from gguf.constants import GGMLQuantizationType

    from kvtrace.sources.gguf_blocks import _KEPT_TYPE_IDS, KEPT

    assert {GGMLQuantizationType(i).name for i in _KEPT_TYPE_IDS} == set(KEPT) == set(_KEPT_TYPE_IDS.values())
