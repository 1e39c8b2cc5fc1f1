"""kvtrace.export end to end: exported programs and their cache against eager HF, initial state, weights once."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import kvtrace
from conftest import tiny_model, tiny_phi3_longrope
from helpers import elf_sections, package_libraries
from kvtrace._errors import CacheOverflowError, CaptureError, UnsupportedError, UsageError
from kvtrace.artifact import export as _export
from kvtrace.artifact.archive import Artifact
from kvtrace.cache.hf import cache_kwarg_name
from kvtrace.spec.cache import BufferSpec, CacheSpec, LayerKind, LayerSpec
from kvtrace.spec.manifest import WEIGHTS
from kvtrace.spec.tolerances import close, tolerance_for

MAX_SEQ_LEN = 32
PROMPT = torch.tensor([[5, 17, 42, 8, 99, 3, 64]])  # [1, 7]
STEPS = 16
TOL = tolerance_for(torch.float32)


# --- helpers ----------------------------------------------------------------------------------
def eager_step(model: torch.nn.Module, cache: object, ids: torch.Tensor) -> torch.Tensor:
    """One eager HF call on a DynamicCache; logits [B, T, V]."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{cache_kwarg_name(model): cache}).logits


def check_cache(session, cache, kv_init: float, where: str) -> float:
    """Every layer's K and V over [0, position) equals eager's DynamicCache; later slots hold kv_init."""
    pos = session.position
    worst = 0.0
    assert len(session.state) == 2 * len(cache.layers)
    for i, layer in enumerate(cache.layers):
        for j, ref in enumerate((layer.keys, layer.values)):  # [B, H_kv, pos, D]
            got = session.state[2 * i + j]  # [B, H_kv, S, D]
            assert ref.shape[-2] == pos, f"{where}: eager holds {ref.shape[-2]} positions, session {pos}"
            ok, diff, limit = close(got[:, :, :pos], ref, TOL)
            assert ok, f"{where}: layer {i} {'KV'[j]} differs from eager by {diff:.3g} > {limit:.3g}"
            worst = max(worst, diff)
            rest = got[:, :, pos:]
            ok, diff, _ = close(rest, torch.full_like(rest, kv_init), TOL)
            assert ok, f"{where}: layer {i} {'KV'[j]} was written at or beyond position {pos} ({diff:.3g})"
    return worst


def decompressed_blobs(data: bytes) -> Iterator[tuple[str, bytes]]:
    """Every entry of a zip, recursing into nested zips (the AOTInductor .pt2 package)."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for name in zf.namelist():
            blob = zf.read(name)
            if name.endswith(".pt2"):
                yield from decompressed_blobs(blob)
            else:
                yield name, blob


@dataclass
class Tiny:
    arch: str
    backend: str
    model: torch.nn.Module
    path: Path
    art: Artifact


TINY_CASES = [
    pytest.param(("llama", "exported"), id="llama-exported"),
    pytest.param(("qwen2", "exported"), id="qwen2-exported"),
    # exported fresh (HF sets rotary_emb.long_inv_freq on the first forward); decodes cross into the long factors
    pytest.param(("phi3-longrope", "exported"), id="phi3-longrope-exported"),
    pytest.param(("llama", "aoti"), id="llama-aoti", marks=pytest.mark.compile),
]


@pytest.fixture(scope="module", params=TINY_CASES)
def tiny(request, tmp_path_factory) -> Tiny:
    arch, backend = request.param
    model = tiny_phi3_longrope() if arch == "phi3-longrope" else tiny_model(arch)
    path = tmp_path_factory.mktemp(f"{arch}-{backend}") / "tiny.kvt"
    kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=backend)
    return Tiny(arch, backend, model, path, kvtrace.load(path))


# --- 1. logits and every layer's cache vs eager -----------------------------------------------
def test_logits_and_cache_match_eager_step_by_step(tiny):
    from transformers import DynamicCache

    model, s = tiny.model, tiny.art.session()
    cache = DynamicCache(config=model.config)
    ref = eager_step(model, cache, PROMPT)
    got = s.prefill(PROMPT)
    assert got.shape == ref.shape == (1, 7, model.config.vocab_size)
    assert s.position == 7
    ok, logit_diff, limit = close(got, ref, TOL)
    assert ok, f"prefill logits differ from eager by {logit_diff:.3g} > {limit:.3g}"
    cache_diff = check_cache(s, cache, 0.0, "after prefill")
    for step in range(STEPS):
        tok = ref[:, -1:].argmax(-1)  # [1, 1] eager's greedy pick
        ref = eager_step(model, cache, tok)
        got = s.decode(tok)
        assert got.shape == (1, 1, model.config.vocab_size)
        assert s.position == 8 + step
        ok, diff, limit = close(got, ref, TOL)
        assert ok, f"decode step {step}: logits differ from eager by {diff:.3g} > {limit:.3g}"
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"decode step {step}: greedy pick differs"
        logit_diff = max(logit_diff, diff)
        cache_diff = max(cache_diff, check_cache(s, cache, 0.0, f"after decode step {step}"))
    print(f"\n[{tiny.arch}-{tiny.backend}] max |logits - eager| = {logit_diff:.3g}, "
          f"max |K/V - eager| = {cache_diff:.3g} over prefill(7) + {STEPS} decode steps")


def test_cache_checker_has_teeth(tiny):
    """The comparison above fails when a slot beyond the position or a past slot is disturbed."""
    from transformers import DynamicCache

    s = tiny.art.session()
    cache = DynamicCache(config=tiny.model.config)
    eager_step(tiny.model, cache, PROMPT)
    s.prefill(PROMPT)
    check_cache(s, cache, 0.0, "untouched")
    s.state[3][:, :, 7].add_(1.0)  # layer 1 V, first slot past the position
    with pytest.raises(AssertionError, match="beyond position 7"):
        check_cache(s, cache, 0.0, "stray write")
    s.state[3][:, :, 7].zero_()
    s.state[2][:, :, 2].add_(0.01)  # layer 1 K, a past slot
    with pytest.raises(AssertionError, match="layer 1 K differs"):
        check_cache(s, cache, 0.0, "past slot")


# --- 6. weights once --------------------------------------------------------------------------
def test_no_weight_is_stored_twice(tiny):
    """Each weight's bytes occur once in the whole artifact (programs and packages included)."""
    blobs = dict(decompressed_blobs(tiny.path.read_bytes()))
    assert "weights.safetensors" in blobs
    params = dict(tiny.model.named_parameters())
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        needle = params[name].detach().contiguous().numpy().tobytes()
        where = {n: b.count(needle) for n, b in blobs.items() if b.count(needle)}
        assert where == {"weights.safetensors": 1}, f"{name} stored in {where}"


def test_tied_weights_are_stored_once_and_artifact_is_small(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert emb.data_ptr() == head.data_ptr()
    path = kvtrace.export(model, tmp_path / "tied.kvt", max_seq_len=MAX_SEQ_LEN)
    with zipfile.ZipFile(path) as zf:
        manifest = json.loads(zf.read("manifest.json"))
        stored = safetensors.torch.load(zf.read("weights.safetensors"))
    aliases = manifest["weight_aliases"]
    assert len(aliases) == 1, aliases
    ((alias, target),) = aliases.items()
    assert {alias, target} == {"tok_embeddings.weight", "output.weight"}  # LlamaDecoder names
    assert target in stored and alias not in stored
    assert close(stored[target], head, TOL)[0]
    needle = emb.detach().numpy().tobytes()
    assert sum(b.count(needle) for _, b in decompressed_blobs(path.read_bytes())) == 1

    unique: dict[int, torch.Tensor] = {}
    for t in model.state_dict().values():
        unique.setdefault(t.data_ptr(), t)
    by_name = {f"w{i}": t.contiguous() for i, t in enumerate(unique.values())}
    unique_bytes = len(safetensors.torch.save(by_name))
    size = path.stat().st_size
    assert size < 1.3 * unique_bytes, f"artifact {size} B vs unique weights {unique_bytes} B"

    # and the loaded programs see the tie: logits equal eager
    s = kvtrace.load(path).session()
    from transformers import DynamicCache

    ok, diff, limit = close(s.prefill(PROMPT), eager_step(model, DynamicCache(config=model.config), PROMPT), TOL)
    assert ok, (diff, limit)


# --- 2. a Decoder with non-zero initial state -------------------------------------------------
TOY_VOCAB, TOY_DIM, TOY_LEN = 24, 8, 12


class ToyDecoder(torch.nn.Module):
    """Embedding + linear head over a one-layer cache with kv_init=0.5 and an extra `bias` buffer (init 7).

    The forward reads every cache slot (written or not), adds ``bias`` to the logits and increments it, so
    the logits depend on the declared initial values.
    """

    def __init__(self, kv_init: float = 0.5, max_seq_len: int = TOY_LEN):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(TOY_VOCAB, TOY_DIM)
        self.head = torch.nn.Linear(TOY_DIM, TOY_VOCAB)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.requires_grad_(False)
        self.cache_spec = CacheSpec(
            layers=(LayerSpec(LayerKind.FULL, 1, TOY_DIM, max_seq_len),),
            batch_size=1,
            max_seq_len=max_seq_len,
            dtype="float32",
            kv_init=kv_init,
            extra=(BufferSpec("bias", (1,), "float32", 7.0),),
        )

    def forward(self, tokens, input_pos, k, v, bias):
        x = self.emb(tokens)  # [B, T, D]
        k.index_copy_(2, input_pos, x.unsqueeze(1))  # k: [B, 1, S, D]
        v.index_copy_(2, input_pos, torch.tanh(x).unsqueeze(1))
        ctx = k.sum(2) + v.mean(2)  # [B, 1, D]: every slot, including never-written ones
        logits = self.head(x + ctx) + bias
        bias.add_(1)
        return logits


TOY_PROMPT = torch.tensor([[1, 2, 3]])
TOY_TOKENS = (4, 9, 16)


def toy_reference(toy: ToyDecoder) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The toy's eager run from freshly allocated spec state: (logits per call, final state)."""
    state = toy.cache_spec.allocate()
    out = []
    with torch.no_grad():
        out.append(toy(TOY_PROMPT, torch.arange(3), *state))
        for i, t in enumerate(TOY_TOKENS):
            out.append(toy(torch.tensor([[t]]), torch.tensor([3 + i]), *state))
    return out, state


def run_toy(session) -> list[torch.Tensor]:
    return [session.prefill(TOY_PROMPT), *(session.decode(torch.tensor([[t]])) for t in TOY_TOKENS)]


def all_close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[bool, float]:
    results = [close(a, b, TOL) for a, b in zip(got, ref, strict=True)]
    return all(r[0] for r in results), max(r[1] for r in results)


@pytest.fixture(scope="module", params=["exported", pytest.param("aoti", marks=pytest.mark.compile)])
def toy(request, tmp_path_factory) -> tuple[ToyDecoder, Artifact]:
    toy = ToyDecoder()
    path = kvtrace.export(toy, tmp_path_factory.mktemp(f"toy-{request.param}") / "toy.kvt", backend=request.param)
    return toy, kvtrace.load(path)


def assert_initial(session, spec: CacheSpec) -> None:
    for b, t in zip(spec.buffers(), session.state, strict=True):
        ok, diff, _ = close(t, torch.full(b.shape, float(b.init)), TOL)
        assert ok, f"{b.name} does not hold its initial value {b.init} (off by {diff})"


def test_nonzero_initial_state_round_trips(toy):
    decoder, art = toy
    assert art.cache_spec == decoder.cache_spec
    assert art.manifest.vocab_size == TOY_VOCAB
    ref, ref_state = toy_reference(decoder)
    s = art.session()
    assert_initial(s, decoder.cache_spec)
    ok, diff = all_close(run_toy(s), ref)
    assert ok, f"logits differ from the toy's eager run by {diff}"
    for name, got, want in zip(["k", "v", "bias"], s.state, ref_state, strict=True):
        assert close(got, want, TOL)[0], name
    assert close(s.state[2], torch.tensor([7.0 + 1 + len(TOY_TOKENS)]), TOL)[0]

    s.reset()
    assert s.position == 0
    assert_initial(s, decoder.cache_spec)  # 7.0 and 0.5 again, not 0
    ok, diff = all_close(run_toy(s), ref)
    assert ok, f"after reset(): logits differ by {diff}"


def test_loader_ignoring_initial_values_would_be_caught(toy, monkeypatch):
    decoder, art = toy
    ref, _ = toy_reference(decoder)  # from the real initial values

    def zeros_cache(self, device="cpu"):
        return [torch.zeros(b.shape, dtype=b.torch_dtype, device=device) for b in self.buffers()]

    def zeros_buffer(self, device="cpu"):
        return torch.zeros(self.shape, dtype=self.torch_dtype, device=device)

    monkeypatch.setattr(CacheSpec, "allocate", zeros_cache)
    monkeypatch.setattr(BufferSpec, "allocate", zeros_buffer)
    ok, diff = all_close(run_toy(art.session()), ref)
    assert not ok, "a session starting from zeros passed the comparison: the test cannot see initial values"
    assert diff > 1.0


def test_extra_state_snapshot_restore_and_no_rewind(toy):
    decoder, art = toy
    ref, _ = toy_reference(decoder)
    s = art.session()
    s.prefill(TOY_PROMPT)
    snap = s.snapshot()
    first = s.decode(torch.tensor([[TOY_TOKENS[0]]]))
    with pytest.raises(UnsupportedError, match="bias"):
        s.rewind(1)
    s.restore(snap)
    assert s.position == 3
    assert close(s.state[2], torch.tensor([8.0]), TOL)[0]  # the bias restored too
    again = s.decode(torch.tensor([[TOY_TOKENS[0]]]))
    assert close(again, first, TOL)[0] and close(again, ref[1], TOL)[0]


# --- 5. export errors -------------------------------------------------------------------------
def test_export_to_a_directory_is_refused_before_capture(tmp_path, monkeypatch):
    monkeypatch.setattr(_export, "capture_programs", lambda *a: pytest.fail("captured before checking the path"))
    with pytest.raises(UsageError, match=f"{tmp_path}.*is a directory"):
        kvtrace.export(ToyDecoder(), tmp_path)


def test_export_failing_half_way_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def boom(decoder, programs=None):
        calls.append(decoder)
        raise RuntimeError("boom half-way through capture")

    monkeypatch.setattr(_export, "capture_programs", boom)
    with pytest.raises(CaptureError, match="boom half-way"):
        kvtrace.export(ToyDecoder(), tmp_path / "toy.kvt")
    assert calls, "capture was not reached"
    assert list(tmp_path.iterdir()) == []


def test_export_failing_while_writing_leaves_no_temp_and_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "toy.kvt"
    target.write_bytes(b"the previous artifact")

    real_open = zipfile.ZipFile.open

    class FullDisk:
        """The weights member's stream: its first write (the safetensors header) goes in, the next one fails."""

        def __init__(self, out):
            self.out, self.writes = out, 0

        def write(self, b):
            self.writes += 1
            if self.writes > 1:
                raise RuntimeError("disk full while writing weights")
            return self.out.write(b)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.out.__exit__(*exc)

    def fail_weights(self, name, *a, **k):  # manifest.json has gone into the temp zip when the weights start
        out = real_open(self, name, *a, **k)
        return FullDisk(out) if name == WEIGHTS else out

    monkeypatch.setattr(zipfile.ZipFile, "open", fail_weights)
    with pytest.raises(RuntimeError, match="disk full"):
        kvtrace.export(ToyDecoder(), target)
    assert list(tmp_path.iterdir()) == [target]
    assert target.read_bytes() == b"the previous artifact"


def test_export_of_a_decoder_whose_forward_does_not_take_its_state(tmp_path):
    class TwoStateForward(ToyDecoder):
        def forward(self, tokens, input_pos, k, v):
            return self.head(self.emb(tokens))

    with pytest.raises(CaptureError, match="3 state tensors"):
        kvtrace.export(TwoStateForward(), tmp_path / "bad.kvt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(backend="tflite"), "backend"),
        (dict(dtype="int8"), "dtype"),
        (dict(max_seq_len=0), "max_seq_len"),
    ],
)
def test_export_rejects_bad_options(tmp_path, kwargs, match):
    with pytest.raises(UsageError, match=match):
        kvtrace.export(ToyDecoder(), tmp_path / "x.kvt", **kwargs)


def test_export_in_another_dtype_leaves_the_callers_model_untouched(tmp_path):
    import copy

    from transformers import DynamicCache

    model = tiny_model("llama")
    path = kvtrace.export(model, tmp_path / "bf16.kvt", max_seq_len=16, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    art = kvtrace.load(path)
    assert art.cache_spec.dtype == "bfloat16"
    ref_model = copy.deepcopy(model).to(torch.bfloat16)
    ref = eager_step(ref_model, DynamicCache(config=ref_model.config), PROMPT)
    got = art.session().prefill(PROMPT)
    assert got.dtype == torch.bfloat16
    ok, diff, limit = close(got, ref, tolerance_for(torch.bfloat16))
    assert ok, (diff, limit)


@pytest.mark.parametrize("max_seq_len", [1, 2])
def test_export_of_the_smallest_caches(tmp_path, max_seq_len):
    decoder = ToyDecoder(max_seq_len=max_seq_len)
    s = kvtrace.load(kvtrace.export(decoder, tmp_path / "small.kvt")).session()
    state = decoder.cache_spec.allocate()
    with torch.no_grad():
        ref = decoder(torch.tensor([[5] * max_seq_len]), torch.arange(max_seq_len), *state)
    assert close(s.prefill(torch.tensor([[5] * max_seq_len])), ref, TOL)[0]
    with pytest.raises(CacheOverflowError, match=f"needs {max_seq_len + 1} cache slots.*max_seq_len={max_seq_len}"):
        s.decode(torch.tensor([[5]]))


# --- aoti-packed: one frozen program with prepacked weights ----------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize(("dtype", "logits"), [("float32", "all"), ("bfloat16", "last")])
def test_aoti_packed_matches_eager_with_one_program_holding_the_weights(tmp_path, dtype, logits):
    from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

    tdtype = getattr(torch, dtype)
    model = tiny_model("llama", tdtype)
    path = kvtrace.export(model, tmp_path / "packed.kvt", max_seq_len=MAX_SEQ_LEN, dtype=dtype, backend="aoti-packed",
                          prefill_logits=logits)
    art = kvtrace.load(path)
    assert art.session().prefill(PROMPT).shape[1] == (1 if logits == "last" else PROMPT.shape[1])
    report = verify(EagerRunner(model), [SessionRunner(art.session(), "aoti-packed")],
                    [PROMPT, torch.tensor([[1, 2]])], steps=8, dtype=tdtype)
    assert report.passed, report.summary()
    with zipfile.ZipFile(path) as zf:
        assert safetensors.torch.load(zf.read("weights.safetensors")) == {}  # the weights live in the program
        with zipfile.ZipFile(io.BytesIO(zf.read("programs/aoti.pt2"))) as pkg:
            models = {n.split("/aotinductor/")[1].split("/")[0] for n in pkg.namelist() if "/aotinductor/" in n}
    assert models == {"step"}  # one program serves prefill and decode
    [lib] = package_libraries(path).values()
    # One copy of each weight in the library: compiled with grad mode on, Inductor never froze, and its GEMM
    # templates (bf16 here) kept every original next to its packed copy (1.93x the weights on this model).
    weights = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    constants = elf_sections(lib)[".lrodata"]
    assert constants <= 1.15 * weights, f"library constants {constants} B for {weights} B of weights"
    # In a fresh process: a frozen program's AMX kernels (bf16) die of SIGILL unless the loader asks Linux for
    # the AMX tiles, as the compiling process did (aoti._runner).
    code = f"import kvtrace, torch; print(kvtrace.load({str(path)!r}).session().prefill(torch.tensor([[1, 2, 3]])).shape)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert art.manifest.backend == "aoti-packed" and set(art.manifest.programs) == {"prefill", "decode"}


def test_aoti_packed_refuses_decoders_with_more_programs(tmp_path):
    from conftest import tiny_mllama

    with pytest.raises(UsageError, match=r"aoti-packed serves prefill and decode from one program.*--backend aoti"):
        kvtrace.export(tiny_mllama(), tmp_path / "v.kvt", max_seq_len=16, backend="aoti-packed", image_tokens=6)
    assert not (tmp_path / "v.kvt").exists()


@pytest.mark.compile
def test_aoti_packed_export_twice_is_still_correct(tmp_path):
    """Frozen, prepacked weights live in the compiled program. Exporting the same model again must not
    come back from Inductor's compile caches: on SmolLM2 bf16 a cache hit returned a program with wrong
    weights (logits off by 147, argmax agreement 0), so packed compiles bypass the caches. The tiny model
    did not reproduce the bad hit; this guards the second export's numbers, the note records the SmolLM2 case."""
    model = tiny_model("llama", torch.bfloat16)
    tol = tolerance_for(torch.bfloat16)
    with torch.no_grad():
        ref = model(input_ids=PROMPT).logits
    for i in range(2):
        path = kvtrace.export(model, tmp_path / f"p{i}.kvt", max_seq_len=MAX_SEQ_LEN, dtype="bfloat16",
                              backend="aoti-packed")
        got = kvtrace.load(path).session().prefill(PROMPT)
        assert close(got, ref, tol)[0], f"export {i}: max diff {(got.float() - ref.float()).abs().max():.3g}"


# --- prefill_logits="last": the vocabulary projection on the last position only ----------------------
def _head_input_rows(ep: torch.export.ExportedProgram, vocab: int) -> Any:
    """dim 1 (T) of the input of the vocabulary projection (the graph's last matmul, [B, ?, dim] -> [B, ?, V])."""
    linears = [n for n in ep.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    head = linears[-1]
    assert head.meta["val"].shape[-1] == vocab
    return head.args[0].meta["val"].shape[1]


# LlamaDecoder; HFDecoder (HF's logits_to_keep: a phi3 with gelu, which LlamaDecoder does not reproduce)
@pytest.mark.parametrize("arch", ["llama", "phi3-gelu"])
def test_prefill_logits_last_projects_one_row_and_matches_eager(arch, tmp_path):
    from kvtrace.models.registry import make_decoder
    from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

    model = tiny_model("phi3", hidden_act="gelu_new") if arch == "phi3-gelu" else tiny_model(arch)
    vocab = model.config.vocab_size
    decoder = make_decoder(model, max_seq_len=MAX_SEQ_LEN)
    assert type(decoder).__name__ == ("HFDecoder" if arch == "phi3-gelu" else "LlamaDecoder")
    programs = _export.with_prefill_logits(_export.program_specs(decoder), "last", decoder)
    eps = _export.capture_programs(decoder, programs)
    assert _head_input_rows(eps["prefill"], vocab) == 1  # the head sees one row, not T
    full = _export.capture_programs(decoder, _export.program_specs(decoder))
    assert not isinstance(_head_input_rows(full["prefill"], vocab), int)  # "all": T (symbolic) rows
    assert not decoder.last_logits  # the caller's decoder is untouched; a copy was set

    art = kvtrace.load(kvtrace.export(model, tmp_path / "last.kvt", max_seq_len=MAX_SEQ_LEN, prefill_logits="last"))
    assert art.manifest.programs["prefill"].logits == "last"
    assert art.manifest.programs["prefill"].signature().endswith("-> logits[B,1,V]")
    s = art.session()
    assert s.prefill_logits == "last"
    got = s.prefill(PROMPT)
    assert got.shape == (1, 1, vocab)
    with torch.no_grad():
        ref = model(input_ids=PROMPT).logits[:, -1:]
    assert close(got, ref, TOL)[0]
    report = verify(EagerRunner(model), [SessionRunner(art.session(), "last")], [PROMPT, torch.tensor([[1, 2]])],
                    steps=4)
    assert report.passed, report.summary()


def test_prefill_logits_last_wrong_row_fails_verify(tmp_path):
    """The comparison is on the last position: a program that returns the first row instead must fail."""
    from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

    model = tiny_model("llama")
    art = kvtrace.load(kvtrace.export(model, tmp_path / "all.kvt", max_seq_len=MAX_SEQ_LEN))
    runner = SessionRunner(art.session(), "first-row")
    runner.prefill_logits = "last"
    runner.prefill = lambda tokens, **inputs: art_session_first_row(runner.session, tokens)
    report = verify(EagerRunner(model), [runner], [PROMPT], steps=1)
    fail = report.first_failure("first-row")
    assert fail is not None and fail.step == "prefill" and fail.failure.startswith("logits max abs"), fail


def art_session_first_row(session: Any, tokens: torch.Tensor) -> torch.Tensor:
    return session.prefill(tokens)[:, :1]


def test_prefill_logits_is_checked(tmp_path):
    with pytest.raises(UsageError, match=r"prefill_logits must be one of \('all', 'last'\), got 'first'"):
        kvtrace.export(tiny_model("llama"), tmp_path / "x.kvt", max_seq_len=16, prefill_logits="first")
    with pytest.raises(UsageError, match="needs a Decoder that can run its head on the last position only"):
        kvtrace.export(ToyDecoder(), tmp_path / "x.kvt", prefill_logits="last")
    assert not (tmp_path / "x.kvt").exists()


# --- key_pos: attention over the live cache prefix only ----------------------------------------------
def test_live_prefix_programs_read_L_slots_and_fill_the_cache_to_the_last_slot(tmp_path):
    from kvtrace.models.registry import make_decoder
    from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

    model = tiny_model("llama")
    decoder = make_decoder(model, max_seq_len=16)
    eps = _export.capture_programs(decoder)
    for name, ep in eps.items():
        sdpa = [n for n in ep.graph.nodes if "scaled_dot_product" in str(n.target)]
        assert len(sdpa) == model.config.num_hidden_layers
        keys = sdpa[0].args[1].meta["val"].shape[2]  # k: [B, H_kv, L, D]
        assert not isinstance(keys, int), f"{name}: attention reads {keys} slots, not the symbolic live prefix L"
    # decode reads the live prefix as a view of the cache (cache.full.live), prefill gathers it
    gathers = {name: sum("index_select" in str(n.target) for n in ep.graph.nodes) for name, ep in eps.items()}
    assert gathers == {"prefill": 2 * model.config.num_hidden_layers, "decode": 0}, gathers
    art = kvtrace.load(kvtrace.export(model, tmp_path / "m.kvt", max_seq_len=16))
    assert all(p.key_pos for p in art.manifest.programs.values())
    assert "key_pos[L] int64" in art.manifest.programs["decode"].signature()
    # 6 prompt tokens + 10 decode steps: the last step writes and reads slot 15, L == max_seq_len
    report = verify(EagerRunner(model), [SessionRunner(art.session(), "live")], [list(range(5, 11))], steps=10)
    assert report.passed, report.summary()
    assert report.rows[-1].position == 16


@pytest.mark.compile
def test_aoti_programs_of_another_cache_size_are_not_reused(tmp_path):
    """An Inductor compile-cache hit once served a decode program compiled for 24 cache slots to an export
    for 40 ("index out of bounds: 0 <= tmp7 < 24L" at position 24). Artifact compiles bypass the caches;
    this exports the same model at two sizes in one process and decodes the second one to its last slot."""
    from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

    model = tiny_model("llama")
    kvtrace.export(model, tmp_path / "s24.kvt", max_seq_len=24, backend="aoti")
    art = kvtrace.load(kvtrace.export(model, tmp_path / "s40.kvt", max_seq_len=40, backend="aoti"))
    report = verify(EagerRunner(model), [SessionRunner(art.session(), "s40")], [PROMPT[0].tolist()], steps=33)
    assert report.passed, report.summary()
    assert report.rows[-1].position == 40
