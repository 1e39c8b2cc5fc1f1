"""perplexity: llama.cpp's chunking and scoring, checked against HF's own loss, known distributions and artifacts."""

from __future__ import annotations

import json
import math

import pytest
import torch

import kvtrace
from conftest import make_tiny_hf_dir, tiny_model
from kvtrace._errors import UsageError
from kvtrace.cli.main import main
from kvtrace.tools.perplexity import chunk_tokens, perplexity, scored_per_chunk, text_ids
from kvtrace.tools.runners import EagerRunner, SessionRunner

CTX = 16


class FixedRunner:
    """A runner whose prefill returns ``logits_of(ids)``: distributions the test knows exactly."""

    def __init__(self, name, logits_of):
        self.name, self.logits_of, self.resets = name, logits_of, 0

    def reset(self):
        self.resets += 1

    def prefill(self, tokens):
        return self.logits_of(tokens)


def _ids(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_chunks_drop_the_partial_tail_start_with_bos_and_refuse_short_texts():
    ids = list(range(10, 10 + 3 * CTX + 5))
    c = chunk_tokens(ids, CTX)
    assert c.shape == (3, CTX) and c[1, 3] == ids[CTX + 3] and c[2, -1] == ids[3 * CTX - 1]
    b = chunk_tokens(ids, CTX, bos_id=1, chunks=2)
    assert b.shape == (2, CTX) and b[:, 0].tolist() == [1, 1] and b[1, 1] == ids[CTX + 1]
    assert scored_per_chunk(512) == 255 and scored_per_chunk(4) == 1 and scored_per_chunk(5) == 2
    with pytest.raises(UsageError, match="the text has 15 tokens; a context of 16 needs at least 16"):
        chunk_tokens(ids[:15], CTX)
    with pytest.raises(UsageError, match=r"at least 4 tokens.*got 3"):
        chunk_tokens(ids, 3)


def test_uniform_predictions_have_the_vocabulary_as_perplexity_and_scores_follow_llama_cpp():
    vocab = 50
    chunks = chunk_tokens(_ids(vocab, 4 * CTX).tolist(), CTX)
    uniform = FixedRunner("uniform", lambda t: torch.zeros(1, t.shape[1], vocab))

    def sure(t):  # every position certain of the token after it (the last of the chunk: of token 0)
        out = torch.full((1, t.shape[1], vocab), -1e4)
        nxt = torch.cat([t[0, 1:], t[0, :1]])
        out[0, torch.arange(t.shape[1]), nxt] = 0.0
        return out

    oracle = FixedRunner("oracle", sure)
    rep = perplexity([uniform, oracle], chunks)
    u, o = rep.rows
    assert u.tokens == o.tokens == 4 * scored_per_chunk(CTX)
    assert u.ppl == pytest.approx(vocab, rel=1e-6) and u.ppl_err < 1e-9 and u.kl_mean is None
    assert abs(o.ppl - 1.0) < 1e-6
    # KL(uniform || one-hot-ish) = sum_v 1/V (log 1/V - log q(v)): 49 tokens at -1e4 - logsumexp
    assert abs(o.kl_mean - ((vocab - 1) / vocab * 1e4 - math.log(vocab))) < 1.0
    assert o.top1_agree == 0.0  # uniform's argmax is token 0, which the text never holds
    assert uniform.resets == oracle.resets == 4  # an empty cache for every chunk


def test_kl_and_top1_agree_with_a_direct_computation_on_a_perturbed_model():
    model = tiny_model("llama")
    other = tiny_model("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    chunks = chunk_tokens(_ids(128, 3 * CTX).tolist(), CTX)
    rep = perplexity([EagerRunner(model), EagerRunner(other, name="perturbed"), EagerRunner(model, name="same")],
                     chunks)
    ref, pert, same = rep.rows
    assert same.kl_mean == 0.0 and same.top1_agree == 1.0 and same.ppl == ref.ppl
    first = CTX // 2
    with torch.no_grad():
        p = torch.log_softmax(model(chunks).logits[:, first:-1].float(), -1)  # [N, scored, V]
        q = torch.log_softmax(other(chunks).logits[:, first:-1].float(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert pert.kl_mean == pytest.approx(float(kl.mean()), rel=1e-4) and pert.kl_mean > 1e-4
    assert pert.kl_max == pytest.approx(float(kl.max()), rel=1e-4)
    assert pert.top1_agree == pytest.approx(float((p.argmax(-1) == q.argmax(-1)).float().mean()))


def test_eager_perplexity_is_hf_own_loss_over_the_scored_half():
    model = tiny_model("llama")
    chunks = chunk_tokens(_ids(128, 3 * CTX + 7).tolist(), CTX)
    rep = perplexity([EagerRunner(model)], chunks)
    labels = chunks.clone()
    labels[:, : CTX // 2 + 1] = -100  # HF shifts: labels[j] is predicted by position j - 1
    with torch.no_grad():
        loss = model(input_ids=chunks, labels=labels).loss  # mean over every unmasked label
    assert rep.reference.nll == pytest.approx(float(loss), rel=1e-5)
    assert rep.reference.ppl == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_artifacts_score_as_eager_and_an_int8_cache_strays_measurably(tmp_path):
    model = tiny_model("llama")
    chunks = chunk_tokens(_ids(128, 3 * CTX).tolist(), CTX)
    runners = [EagerRunner(model)]
    for kv in (None, "int8"):
        path = kvtrace.export(model, tmp_path / f"{kv}.kvt", max_seq_len=CTX, backend="exported",
                              prefill_logits="all", kv_dtype=kv)
        runners.append(SessionRunner(kvtrace.load(path).session(), f"exported {kv}"))
    ref, fp32, int8 = perplexity(runners, chunks).rows
    assert fp32.ppl == pytest.approx(ref.ppl, rel=1e-5) and fp32.kl_mean < 1e-8 and fp32.top1_agree == 1.0
    assert 1e-9 < int8.kl_mean < 1e-2 and int8.top1_agree > 0.9  # one int8 step per value: close, not equal


def test_artifacts_that_cannot_be_scored_are_refused_with_what_to_do(tmp_path):
    model = tiny_model("llama")
    chunks = chunk_tokens(_ids(128, 2 * CTX).tolist(), CTX)
    last = kvtrace.export(model, tmp_path / "last.kvt", max_seq_len=CTX, backend="exported", prefill_logits="last")
    with pytest.raises(UsageError, match=r"last position's logits only.*--prefill-logits all"):
        perplexity([EagerRunner(model), SessionRunner(kvtrace.load(last).session(), "last")], chunks)
    short = kvtrace.export(model, tmp_path / "short.kvt", max_seq_len=CTX - 4, backend="exported",
                           prefill_logits="all")
    with pytest.raises(UsageError, match=r"holds 12 tokens \(max_seq_len\) but a chunk is 16"):
        perplexity([EagerRunner(model), SessionRunner(kvtrace.load(short).session(), "short")], chunks)
    wide = FixedRunner("wide", lambda t: torch.zeros(1, t.shape[1], 129))
    with pytest.raises(UsageError, match="wide predicts over 129 tokens, the reference eager over 128"):
        perplexity([EagerRunner(model), wide], chunks)


def test_text_ids_start_chunks_with_bos_only_where_the_tokenizer_adds_it(tmp_path):
    import tokenizers

    make_tiny_hf_dir(tmp_path)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))  # WordLevel: adds no BOS
    ids, bos = text_ids(tok, "hello world the cat", bos_id=1)
    assert ids == [3, 4, 5, 6] and bos is None
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    ids, bos = text_ids(tok, "hello world the cat", bos_id=1)
    assert ids == [1, 3, 4, 5, 6] and bos == 1  # as llama.cpp tokenizes it: chunk 0 keeps the text's first token


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf")
    make_tiny_hf_dir(d)
    return d


def _text(tmp_path, words: int = 80):
    import random

    rng = random.Random(0)
    f = tmp_path / "text.txt"
    f.write_text(" ".join(rng.choice(["hello", "world", "the", "cat", "sat"]) for _ in range(words)))
    return f


def test_cli_rows_json_and_the_kl_gate(hf_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    text, out = _text(tmp_path), tmp_path / "ppl.json"
    argv = ["perplexity", str(hf_dir), "--text", str(text), "--ctx", str(CTX), "--backend", "exported",
            "--kv-dtype", "auto,int8", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == ["eager fp32", "exported", "exported kv int8"]
    assert data["chunks"] == 5 and data["ctx"] == CTX and data["text_tokens"] == 80
    assert all(r["tokens"] == 5 * scored_per_chunk(CTX) for r in data["rows"])
    assert data["rows"][1]["ppl_vs_reference"] == pytest.approx(1.0, abs=1e-5)
    assert "| exported kv int8 |" in printed and "5 chunks of 16 tokens" in printed
    int8_kl = data["rows"][2]["kl_mean"]
    assert int8_kl > 0
    assert main([*argv, "--max-kl", str(int8_kl * 2)]) == 0  # the artifacts are cached: no second export
    assert main([*argv, "--max-kl", str(int8_kl / 2)]) == 1
    assert "FAIL exported kv int8: mean KL" in capsys.readouterr().out


def test_cli_scores_an_artifact_alone_with_its_own_tokenizer(hf_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    art, text = tmp_path / "m.kvt", _text(tmp_path)
    assert main(["export", str(hf_dir), "-o", str(art), "--max-seq-len", str(CTX), "--backend", "exported",
                 "--prefill-logits", "all", "--quiet"]) == 0
    out = tmp_path / "a.json"
    assert main(["perplexity", str(art), "--text", str(text), "--ctx", str(CTX), "--json", str(out), "--quiet"]) == 0
    alone = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in alone] == ["m.kvt"] and alone[0]["kl_mean"] is None
    capsys.readouterr()
    assert main(["perplexity", str(hf_dir), "--text", str(text), "--ctx", str(CTX), "--backend", "exported",
                 "--artifact", str(art), "--json", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["eager fp32", "exported", "m.kvt"]
    assert rows[2]["ppl"] == pytest.approx(alone[0]["ppl"], rel=1e-6) and rows[2]["kl_mean"] < 1e-8


@pytest.mark.parametrize("argv,message", [
    (["--text", "missing.txt"], "--text missing.txt is not a file"),
    (["--ctx", "512"], "the text has 80 tokens; a context of 512 needs at least 512"),
])
def test_cli_bad_input_is_one_line(hf_dir, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setenv("KVTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    text = _text(tmp_path)
    base = ["perplexity", str(hf_dir), "--text", str(text), "--backend", "exported", "--quiet", "--ctx", str(CTX)]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1 and message in lines[0], err
