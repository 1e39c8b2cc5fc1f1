"""The CLI as a user runs it: commands, --json, --help examples, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import make_tiny_hf_dir
from kvtrace.cli.main import EXAMPLES, main


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf")
    make_tiny_hf_dir(d)
    return d


@pytest.fixture(scope="module")
def artifact(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tiny.kvt"
    assert main(["export", str(hf_dir), "-o", str(out), "--max-seq-len", "32", "--quiet"]) == 0
    return out


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(errors) == 1, err  # one clear line
    return errors[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("kvtrace 0.")


@pytest.mark.parametrize("command", sorted(EXAMPLES))
def test_help_has_an_example(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "example:" in out and f"kvtrace {command}" in out


def test_export_writes_one_file(artifact):
    assert artifact.is_file() and artifact.stat().st_size > 0
    assert [p.name for p in artifact.parent.iterdir()] == ["tiny.kvt"]  # no temp files left behind


def test_export_defaults_to_last_position_prefill_logits(artifact, hf_dir, tmp_path):
    import kvtrace

    assert kvtrace.load(artifact).manifest.programs["prefill"].logits == "last"  # what `kvtrace run` needs
    out = tmp_path / "all.kvt"
    assert main(["export", str(hf_dir), "-o", str(out), "--max-seq-len", "32", "--prefill-logits", "all", "-q"]) == 0
    assert kvtrace.load(out).session().prefill(torch.tensor([[1, 2, 3]])).shape[1] == 3


def test_run_streams_and_reports_stats(artifact, capsys):
    # sampled (seeded) so the random tiny model does not stop at EOS right away
    argv = ["run", str(artifact), "--prompt", "hello world", "--max-len", "10", "--raw", "--temperature", "2", "--seed", "1"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert cap.out.strip()  # streamed text
    assert "prompt tokens" in cap.err and "tokens/s" in cap.err


def test_run_json_and_chat_template(artifact, capsys):
    assert main(["run", str(artifact), "--prompt", "the cat", "--max-len", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # ChatML template around "the cat": <|im_start|> etc. are unknown words -> more than 2 tokens
    assert out["prompt_tokens"] > 2
    assert out["stop_reason"] in ("eos", "max_new_tokens", "max_seq_len")
    assert out["new_tokens"] == len(out["tokens"])


def test_run_applies_the_penalty_flags(artifact, capsys):
    """--repetition-penalty / --presence-penalty / --frequency-penalty reach the generation: the answer is that of
    generate with the same Sampling (seeded at temperature 2, so the random tiny model does not stop at once)."""
    import kvtrace
    from kvtrace.runtime.generate import Sampling, generate

    main(["run", str(artifact), "--prompt", "hello", "--max-len", "20", "--raw", "--json", "--temperature", "2",
          "--seed", "1", "--repetition-penalty", "1.8", "--presence-penalty", "0.5", "--frequency-penalty", "1"])
    got = json.loads(capsys.readouterr().out)
    art = kvtrace.load(artifact)
    ids = art.tokenizer().encode("hello", add_special_tokens=True).ids

    def answer(**penalties):
        return generate(art.session(), ids, max_new_tokens=20 - len(ids), eos_ids=art.manifest.eos_ids,
                        sampling=Sampling(temperature=2.0, seed=1, **penalties)).tokens

    want = answer(repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=1.0)
    assert got["tokens"] == want and want != answer(), "the penalties change this answer"


def test_run_applies_logit_bias(artifact, capsys):
    """--logit-bias ID:BIAS (repeatable) bans and favours tokens as Sampling(logit_bias=...) does."""
    args = ["run", str(artifact), "--prompt", "hello", "--max-len", "12", "--raw", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)["tokens"]
    assert main([*args, "--logit-bias", f"{plain[0]}:-100", "--logit-bias", "2:-100"]) == 0  # no eos either
    out = json.loads(capsys.readouterr().out)
    got = out["tokens"]
    assert plain[0] not in got and 2 not in got and len(got) == 12 - out["prompt_tokens"]  # to --max-len: no eos
    assert main([*args, "--logit-bias", "7:100"]) == 0
    assert set(json.loads(capsys.readouterr().out)["tokens"]) == {7}
    for bad, words in [("7", "expected ID:BIAS"), ("7:101", "expected ID:BIAS"), ("x:1", "expected ID:BIAS")]:
        with pytest.raises(SystemExit):
            main([*args, "--logit-bias", bad])
        assert words in capsys.readouterr().err
    assert main([*args, "--logit-bias", "3:1", "--logit-bias", "3:2"]) == 2
    assert "names a token id twice" in capsys.readouterr().err


def test_run_is_deterministic_with_seed(artifact, capsys):
    args = ["run", str(artifact), "--prompt", "hello", "--max-len", "16", "--raw", "--json",
            "--temperature", "1.0", "--top-k", "5", "--seed", "3"]
    main(args)
    a = json.loads(capsys.readouterr().out)["tokens"]
    main(args)
    b = json.loads(capsys.readouterr().out)["tokens"]
    assert a == b
    assert main([*args, "--huge-pages"]) == 0  # the weights in huge pages: the same tokens
    assert json.loads(capsys.readouterr().out)["tokens"] == a


def test_huge_pages_reaches_the_loads_of_generate_chat_and_serve(hf_dir, artifact, monkeypatch, capsys):
    """--huge-pages is passed to every load the command makes (the artifact remembers it: its sessions' program
    instances are collapsed into huge pages too); without it, none asks."""
    import argparse
    import io

    from kvtrace.artifact import archive
    from kvtrace.cli.serve import load_served
    from kvtrace.cli.ui import UI

    real, asked = archive.load, []

    def spy(*a, **kw):
        art = real(*a, **kw)
        asked.append(art.huge_pages)
        return art

    monkeypatch.setattr(archive, "load", spy)
    gen = ["generate", "hello", "--model", str(hf_dir), "--backend", "exported", "--max-seq-len", "32",
           "--max-new-tokens", "2", "--json"]
    assert main([*gen, "--no-tiered", "--huge-pages"]) == 0  # built, then loaded
    assert main([*gen, "--huge-pages"]) == 0  # tiered start, a cache hit
    assert main(gen) == 0
    assert asked == [True, True, False]
    asked.clear()
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"content": "hello"}) + "\n"))
    assert main(["chat", str(artifact), "--json", "--max-new-tokens", "2", "--huge-pages"]) == 0
    capsys.readouterr()
    served = argparse.Namespace(model=str(artifact), expected_sha256=None, parallel=None, huge_pages=True)
    assert load_served(served, UI(quiet=True, json_mode=False)).huge_pages
    assert asked == [True, True]


def test_run_checks_the_pinned_sha256_before_reading_the_artifact(artifact, capsys):
    import hashlib

    good = hashlib.sha256(artifact.read_bytes()).hexdigest()
    args = ["run", str(artifact), "--prompt", "hello", "--max-len", "8", "--raw", "--json"]
    assert main([*args, "--expected-sha256", good]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == 1
    assert main([*args, "--expected-sha256", "0" * 64]) == 2
    line = _error_line(capsys)
    assert "sha" in line.lower() and good[:8] in line  # says which hash the file has


def test_generate_caches_the_compiled_artifact(hf_dir, capsys):
    args = ["generate", "hello world", "--model", str(hf_dir), "--backend", "exported", "--max-seq-len", "32",
            "--max-new-tokens", "4", "--raw", "--json", "--temperature", "2", "--seed", "1"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["cache_hit"] is False and second["cache_hit"] is True
    assert first["tokens"] and first["tokens"] == second["tokens"]  # same seed, same artifact
    assert main(["cache", "list", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert any(e["path"].endswith(".kvt") for e in entries)
    assert main(["cache", "clear"]) == 0
    capsys.readouterr()
    assert main(["cache", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_generate_reads_prompt_from_stdin(hf_dir, tmp_path):
    cmd = [sys.executable, "-m", "kvtrace.cli", "generate", "-", "--model", str(hf_dir), "--backend",
           "exported", "--max-seq-len", "32", "--max-new-tokens", "3", "--raw", "--json"]
    env = {"KVTRACE_CACHE": str(tmp_path / "c"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(cmd, input="hello world", capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == 2


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "hi", "--model", "/nonexistent/model"], "does not exist"),
        (["generate", "   ", "--model", "smollm2-135m-instruct"], "prompt is empty"),
        (["run", "/nonexistent.kvt", "--prompt", "hi"], "does not exist"),
        (["export", "/nonexistent", "-o", "x.kvt"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, expected, capsys):
    assert main(argv) == 2
    assert expected in _error_line(capsys)


def test_directory_that_is_not_a_model(tmp_path, capsys):
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "config.json" in _error_line(capsys)


def test_corrupt_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    assert main(["export", str(bad), "-o", str(tmp_path / "x.kvt")]) == 2
    assert "gguf" in _error_line(capsys).lower()
    assert not (tmp_path / "x.kvt").exists()


def test_gguf_of_another_architecture(tmp_path, capsys):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["export", str(path), "-o", str(tmp_path / "x.kvt")]) == 2
    line = _error_line(capsys)
    assert "gpt2" in line and "llama" in line


def test_prompt_longer_than_context(artifact, capsys):
    long = " ".join(["hello"] * 40)  # 40 tokens > max_seq_len 32
    assert main(["run", str(artifact), "--prompt", long, "--max-len", "64", "--raw"]) == 2
    line = _error_line(capsys)
    assert "40" in line and "32" in line


def test_corrupt_artifact(tmp_path, artifact, capsys):
    bad = tmp_path / "bad.kvt"
    bad.write_bytes(artifact.read_bytes()[: artifact.stat().st_size // 2])
    assert main(["run", str(bad), "--prompt", "hello"]) == 2
    assert "corrupt" in _error_line(capsys)


def test_debug_shows_traceback(capsys):
    from kvtrace import SourceError

    with pytest.raises(SourceError):
        main(["generate", "hi", "--model", "/nonexistent/model", "--debug"])


def test_verify_fits_its_exports_to_a_model_built_for_fewer_than_256_positions(hf_dir, capsys):
    """The tiny model holds 64 positions: without --max-seq-len the exports verify over a cache of 64, not the
    default 256 its export would refuse; a --max-seq-len asked for past it is refused by name."""
    code = main(["verify", str(hf_dir), "--against", "exported", "--steps", "2", "--raw", "--prompt", "hello world"])
    assert code == 0, capsys.readouterr()
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    assert main(["verify", str(hf_dir), "--against", "exported", "--steps", "2", "--raw", "--prompt", "hello",
                 "--max-seq-len", "100"]) == 1
    assert "max_seq_len 100 exceeds the model's max_position_embeddings 64" in capsys.readouterr().out


def test_verify_command_passes_and_writes_json(hf_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["verify", str(hf_dir), "--against", "jit-eager,exported", "--steps", "2", "--raw",
                 "--prompt", "hello world", "--max-seq-len", "32", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert {s["candidate"] for s in report["summary"]} == {"jit-eager", "exported"}
    assert len(report["rows"]) == 2 * 2 * (1 + 2)  # candidates x prompts x (prefill + steps)
    text = capsys.readouterr().out
    assert text.rstrip().endswith("PASS")
    # piped (not a terminal): the table as Markdown, every cell whole, not folded into 80 columns
    lines = text.splitlines()
    assert any(ln.startswith("| candidate | steps | logits max abs | worst step |") for ln in lines), text
    row = next(ln for ln in lines if ln.startswith("| exported | "))
    assert row.endswith(" | PASS |") and row.count("|") == lines[lines.index(row) - 2].count("|"), text


def test_tables_markdown_keeps_cells_whole_and_drops_markup():
    from rich.console import Group
    from rich.table import Table

    from kvtrace.cli.ui import tables_markdown

    t = Table(title="a title", caption="a | caption")
    t.add_column("candidate")
    t.add_column("result")
    t.add_row("smollm2-135m-instruct-aoti-packed-282d18a178652afafac7.kvt (vs decoder-eager-int8)",
              "[green]PASS[/green] (noise floor: 1/18 steps)")
    u = Table()
    u.add_column("x")
    u.add_row("1")
    assert tables_markdown(Group(t, u)).splitlines() == [
        "a title", "", "| candidate | result |", "|---|---|",
        "| smollm2-135m-instruct-aoti-packed-282d18a178652afafac7.kvt (vs decoder-eager-int8) | PASS (noise floor: "
        "1/18 steps) |", "", "a / caption", "", "| x |", "|---|", "| 1 |"]


def test_verify_refuses_an_artifact_of_another_dtype_than_the_reference(hf_dir, tmp_path, capsys):
    """A bf16 artifact verified with the default --dtype float32 used to FAIL at float32's tolerance, unexplained."""
    import kvtrace

    art = kvtrace.export(str(hf_dir), tmp_path / "bf16.kvt", max_seq_len=32, dtype="bfloat16")
    code = main(["verify", str(hf_dir), "--against", "", "--artifact", str(art), "--steps", "1", "--raw",
                 "--prompt", "hello world", "--max-seq-len", "32"])
    err = capsys.readouterr().err
    assert code == 2 and "holds a bfloat16 model, but the reference runs in float32; pass --dtype bfloat16" in err
    assert main(["verify", str(hf_dir), "--against", "", "--artifact", str(art), "--steps", "1", "--raw",
                 "--prompt", "hello world", "--max-seq-len", "32", "--dtype", "bfloat16"]) == 0, capsys.readouterr()


@pytest.mark.parametrize("fp32_reference", [True, False])
def test_verify_bf16_uses_an_fp32_reference_unless_told_not_to(fp32_reference, hf_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["verify", str(hf_dir), "--against", "exported", "--dtype", "bfloat16", "--steps", "2", "--raw",
                 "--prompt", "hello world", "--max-seq-len", "32", "--json", str(out),
                 *([] if fp32_reference else ["--no-fp32-reference"])])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and report["tolerance"]["fp32_reference"] == str(fp32_reference).lower()
    (summary,) = report["summary"]
    if fp32_reference:  # both errors against fp32 are measured and shown
        assert 0 < summary["eager_logits_vs_fp32"] < 1 and 0 <= summary["logits_vs_fp32"] < 1
        assert "no further from fp32" in text
    else:
        assert summary["logits_vs_fp32"] is None and "fp32" not in text


def _bench_quick(hf_dir, tmp_path, capsys, backends: str) -> tuple[str, dict, dict]:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["bench", "--model", str(hf_dir), "--backends", backends, "--prompt-len", "4",
                 "--new-tokens", "4", "--runs", "1", "--max-seq-len", "64", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(out.read_text())
    rows = {r["backend"]: r for r in data["results"]}
    assert set(rows) == set(backends.split(","))
    for r in rows.values():
        assert r["decode_tok_s"] > 0 and r["prefill_ms"] > 0 and not r["error"]
        assert r["tokens_match_eager"] is True
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return printed, data, rows


def test_bench_quick_mode(hf_dir, tmp_path, capsys):
    printed, data, rows = _bench_quick(hf_dir, tmp_path, capsys, "hf-eager,exported")
    # stdout is not a terminal here: a full-width Markdown table, no header squeezed into 80 columns ("bac…")
    assert "| backend | dtype | quant | kv | prompt | compile s | prefill ms | decode tok/s |" in printed and "…" not in printed
    assert "| exported | float32 | none | auto | 4 |" in printed and "fresh process |" in printed
    assert data["bandwidth_gb_s"] > 0
    assert [p for p, _ in rows["exported"]["position_sweep"]] == [32, 48]  # 32, then max_seq_len - 16


@pytest.mark.compile
def test_bench_jit_row_compiles_once_per_program(hf_dir, tmp_path, capsys):
    _printed, _data, rows = _bench_quick(hf_dir, tmp_path, capsys, "hf-eager,jit")
    assert rows["jit"]["recompiles"] == 0


def test_lint_command(hf_dir, tmp_path, capsys):
    out = tmp_path / "lint.json"
    assert main(["lint", str(hf_dir), "--json", str(out)]) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    from kvtrace.tools.lint import EXPECTED_PROGRAMS

    assert report["captures"] == EXPECTED_PROGRAMS and report["findings"] == []


# --- vision decoder (Llama 3.2 Vision text decoder) ------------------------------------------------
@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """(HF dir of a tiny MllamaForCausalLM + tokenizer, its exported artifact, an image features file)."""
    from safetensors.torch import save_file

    from conftest import image_features, tiny_mllama

    root = tmp_path_factory.mktemp("vision")
    (root / "hf").mkdir()
    make_tiny_hf_dir(root / "hf", model=tiny_mllama())
    art = root / "vision.kvt"
    assert main(["export", str(root / "hf"), "-o", str(art), "--max-seq-len", "32", "--image-tokens", "6",
                 "--quiet"]) == 0
    save_file({"cross_attention_states": image_features()}, root / "image.safetensors")
    return root / "hf", art, root / "image.safetensors"


def test_run_with_image_features(vision, capsys):
    _, art, image = vision
    base = ["run", str(art), "--prompt", "the cat sat", "--max-len", "12", "--raw", "--json"]
    assert main([*base, "--image-features", str(image)]) == 0
    with_image = json.loads(capsys.readouterr().out)
    assert main(base) == 0
    text_only = json.loads(capsys.readouterr().out)
    assert with_image["prompt_tokens"] == text_only["prompt_tokens"] == 3
    assert with_image["new_tokens"] >= 1 and text_only["new_tokens"] >= 1


def test_image_features_errors(vision, artifact, tmp_path, capsys):
    from safetensors.torch import save_file

    _, art, image = vision
    assert main(["run", str(artifact), "--prompt", "hi", "--image-features", str(image)]) == 2
    assert "exported from a text-only model" in _error_line(capsys)
    bad = tmp_path / "bad.safetensors"
    save_file({"cross_attention_states": torch_zeros(1, 5, 64)}, bad)
    assert main(["run", str(art), "--prompt", "hi", "--raw", "--image-features", str(bad)]) == 2
    assert "shape [1, 5, 64]; this artifact expects [1, 6, 64]" in _error_line(capsys)
    assert main(["run", str(art), "--prompt", "hi", "--image-features", str(tmp_path / "none.safetensors")]) == 2
    assert "does not exist" in _error_line(capsys)


def test_verify_vision_decoder_with_image(vision, tmp_path, capsys):
    hf, _, image = vision
    out = tmp_path / "report.json"
    code = main(["verify", str(hf), "--against", "exported", "--steps", "4", "--raw", "--prompt", "hello world",
                 "--max-seq-len", "32", "--image-features", str(image), "--json", str(out)])
    assert code == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert len(report["rows"]) == 4 * (1 + 4)  # 2 prompts with the image, then the same 2 text only
    assert main(["verify", str(hf.parent.parent / "nope"), "--image-features", str(image)]) == 2
    capsys.readouterr()


def torch_zeros(*shape):
    import torch

    return torch.zeros(*shape)


# --- bad input is one line with exit 2, checked before any work (#12 item 7) -----------------------
def _code(argv) -> int:
    """main's exit code, whether it returns it or argparse exits."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _only_line(capsys) -> str:
    """stderr is exactly one line, an error (no usage block, no traceback)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], err
    return lines[0]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--temperature", "nan"], "--temperature: expected a finite number, got 'nan'"),
        (["--temperature", "inf"], "--temperature: expected a finite number, got 'inf'"),
        (["--temperature", "-1"], "--temperature: expected a number >= 0"),
        (["--top-p", "0"], "--top-p: expected a number in (0, 1], got '0'"),
        (["--top-p", "1.5"], "--top-p: expected a number in (0, 1]"),
        (["--top-p", "nan"], "--top-p: expected a finite number"),
        (["--top-k", "0"], "--top-k: expected a whole number >= 1, got 0"),
        (["--seed", "-1"], "--seed: expected a whole number in [0, 9223372036854775807], got -1"),
        (["--seed", str(2**70)], "--seed: expected a whole number in [0,"),
        (["--max-len", "0"], "--max-len: expected a whole number >= 1, got 0"),
        (["--max-len", "ten"], "--max-len: expected a whole number >= 1, got 'ten'"),
        (["--repetition-penalty", "0"], "--repetition-penalty: expected a number > 0, got '0'"),
        (["--presence-penalty", "2.5"], "--presence-penalty: expected a number in [-2, 2] (0 = off), got '2.5'"),
        (["--frequency-penalty", "nan"], "--frequency-penalty: expected a finite number"),
    ],
)
def test_bad_sampling_and_size_flags_are_one_line_exit_2(flags, expected, artifact, capsys):
    assert _code(["run", str(artifact), "--prompt", "hello", "--raw", *flags]) == 2
    line = _only_line(capsys)
    assert expected in line and "see kvtrace run --help" in line


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["verify", "x", "--steps", "-1"], "--steps: expected a whole number >= 0"),
        (["export", "x", "-o", "y.kvt", "--max-seq-len", "0"], "--max-seq-len: expected a whole number >= 1"),
        (["export", "x", "-o", "y.kvt", "--image-tokens", "-6"], "--image-tokens: expected a whole number >= 1"),
        # --model /nonexistent: were a flag not checked, no default model is built
        (["generate", "hi", "--model", "/nonexistent", "--max-new-tokens", "0"], "--max-new-tokens: expected a whole"),
        (["bench", "--model", "/nonexistent", "--prompt-len", "4,x"], "--prompt-len: expected whole numbers >= 1 sep"),
        (["bench", "--model", "/nonexistent", "--runs", "0"], "--runs: expected a whole number >= 1"),
        (["cache", "purge"], "invalid choice: 'purge'"),
        (["nope"], "invalid choice: 'nope'"),
    ],
)
def test_bad_flags_of_every_command_are_one_line_exit_2(argv, expected, capsys):
    assert _code(argv) == 2
    assert expected in _only_line(capsys)


@pytest.mark.parametrize("where", ["inside_a_file", "proc"])
def test_unwritable_output_is_refused_before_capture(where, hf_dir, tmp_path, monkeypatch, capsys):
    import kvtrace.artifact.export

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before checking -o")

    monkeypatch.setattr(kvtrace.artifact.export, "capture_programs", no_capture)
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path / "file.txt" / "m.kvt" if where == "inside_a_file" else "/proc/kvtrace-test/m.kvt"
    assert _code(["export", str(hf_dir), "-o", str(out), "--max-seq-len", "32"]) == 2
    line = _only_line(capsys)
    assert f"-o {out} cannot be written" in line and "choose another path" in line.lower()


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_unwritable_report_paths_are_refused_before_any_work(flag, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    bad = str(tmp_path / "file.txt" / "out")
    argv = (["verify", "/nonexistent/model", "--json", bad] if flag == "--json"
            else ["bench", "--model", "/nonexistent/model", "--plot", bad])
    assert _code(argv) == 2
    assert f"{flag} {bad} cannot be written" in _only_line(capsys)  # not the missing model: checked first


def test_unwritable_cache_folder_is_one_line_exit_2(hf_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "file.txt"))
    assert _code(["generate", "hello", "--model", str(hf_dir), "--backend", "exported", "--max-seq-len", "32"]) == 2
    line = _only_line(capsys)
    assert f"KVTRACE_CACHE {tmp_path / 'file.txt'} is not a writable folder" in line
    assert _code(["cache", "list"]) == 2
    assert "KVTRACE_CACHE" in _only_line(capsys)


def test_generate_rebuilds_a_corrupt_cached_artifact_with_a_notice(hf_dir, capsys):
    args = ["generate", "hello world", "--model", str(hf_dir), "--backend", "exported", "--max-seq-len", "32",
            "--max-new-tokens", "3", "--raw", "--json"]
    assert main(args) == 0
    capsys.readouterr()
    (entry,) = (p for p, _ in __import__("kvtrace.artifact.store", fromlist=["x"]).list_artifacts())
    entry.write_bytes(entry.read_bytes()[:1000])  # truncated: kvtrace.load raises ArtifactError
    assert main(args) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["cache_hit"] is False
    notes = [ln for ln in cap.err.splitlines() if "failed its integrity check" in ln]
    assert len(notes) == 1 and entry.name in notes[0] and "rebuilding it" in notes[0]
    assert main(args) == 0  # healed: a plain cache hit from now on
    cap = capsys.readouterr()
    assert json.loads(cap.out)["cache_hit"] is True and "integrity" not in cap.err


def test_mislabelled_gguf_is_one_line_exit_2_and_nothing_is_cached(tmp_path, capsys):
    from helpers import write_gguf
    from kvtrace.sources.store import list_cache

    path = write_gguf(tmp_path / "m.gguf", "qwen2", tensors="llama")  # old code: exit 0, zero biases cached
    assert _code(["export", str(path), "-o", str(tmp_path / "m.kvt"), "--max-seq-len", "32"]) == 2
    line = _only_line(capsys)
    assert "'qwen2'" in line and "missing blk.0.attn_q.bias" in line and "'llama' model" in line
    assert list_cache() == [] and not (tmp_path / "m.kvt").exists()


def test_verify_reports_a_candidate_it_cannot_build_and_runs_the_others(hf_dir, artifact, tmp_path, monkeypatch,
                                                                         capsys):
    import kvtrace.artifact.export
    from kvtrace import CaptureError

    def fail(*args, **kwargs):
        raise CaptureError("exporting LlamaForCausalLM failed (exported): simulated")

    monkeypatch.setattr(kvtrace.artifact.export, "export", fail)
    bad = tmp_path / "bad.kvt"
    bad.write_bytes(artifact.read_bytes()[:1000])
    out = tmp_path / "report.json"
    code = main(["verify", str(hf_dir), "--against", "jit-eager,exported", "--artifact", str(bad),
                 "--artifact", str(artifact), "--steps", "1", "--raw", "--prompt", "hello world",
                 "--max-seq-len", "32", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1, text
    summary = {s["candidate"]: s for s in json.loads(out.read_text())["summary"]}
    assert set(summary) == {"jit-eager", "exported", "bad.kvt", "tiny.kvt"}
    assert summary["jit-eager"]["passed"] and summary["tiny.kvt"]["passed"]  # the others still ran
    assert "not run: export (exported) raised CaptureError" in summary["exported"]["first_failure"]
    assert "not run: loading" in summary["bad.kvt"]["first_failure"] and "ArtifactError" in summary["bad.kvt"]["first_failure"]
    assert "failed: exported, bad.kvt" in text and text.rstrip().endswith("FAIL")


def test_verify_missing_artifact_is_bad_input(hf_dir, capsys):
    assert _code(["verify", str(hf_dir), "--artifact", "/nonexistent.kvt"]) == 2
    assert "--artifact /nonexistent.kvt does not exist" in _only_line(capsys)


def test_generate_answers_at_once_then_caches_the_compiled_artifact(hf_dir, capsys):
    """Tiered start: the first run answers on the eager decoder while the build runs in the background,
    waits for that build after the answer, and the next run is a cache hit on the compiled programs."""
    args = ["generate", "hello world", "--model", str(hf_dir), "--backend", "exported", "--max-seq-len", "32",
            "--max-new-tokens", "4", "--raw", "--json"]
    assert main(args) == 0
    cap = capsys.readouterr()
    first = json.loads(cap.out)
    assert first["cache_hit"] is False and first["compile_s"] > 0 and "build_error" not in first
    assert first["programs"] in ("eager", "exported")
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["cache_hit"] is True and second["programs"] == "exported" and second["compile_s"] == 0
    assert second["tokens"] == first["tokens"]  # greedy: the eager programs answer as the compiled ones


def test_generate_no_tiered_compiles_first(hf_dir, capsys):
    args = ["generate", "hello world", "--model", str(hf_dir), "--backend", "exported", "--max-seq-len", "32",
            "--max-new-tokens", "4", "--raw", "--no-tiered"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "compiled in" in err and "background" not in err


def test_generate_says_it_compiles_in_the_background(hf_dir, capsys):
    args = ["generate", "hello world", "--model", str(hf_dir), "--backend", "exported", "--max-seq-len", "32",
            "--max-new-tokens", "4", "--raw"]
    assert main(args) == 0
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "compiling it in the background" in err and "answering with the eager decoder" in err
    assert "exported artifact cached (built in" in err
