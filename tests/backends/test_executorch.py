"""Backend "executorch": a .pte whose KV cache is the CacheSpec's buffers as initialized mutable state.

Exports (tiny random models, tens of seconds to minutes each on a shared 2-core machine) are ``compile``-marked
and shared per module. What is checked: logits and every cache layer vs eager after prefill and every token
on two prompts with a reset (Llama with a non-zero declared initial value, Qwen2, Qwen3, the vision decoder
with an image prompt); the Session API over the program's own buffers; the planted fault (the buffers
exported without their initial values) failing verify; ExecuTorch's own TextLLMRunner streaming the same
greedy tokens as eager; loading without transformers; a clear error when ExecuTorch is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kvtrace
from conftest import TINY, image_features, tiny_mllama, tiny_model
from kvtrace._errors import CaptureError, UsageError
from kvtrace.backends import et_runtime, registry
from kvtrace.backends.executorch import EXECUTORCH, _flatbuffer_program, is_pte, tokenizer_path
from kvtrace.sources.quiet import NATIVE_QUIET_ENV
from kvtrace.tools.runners import DecoderRunner, EagerRunner, Prompt, SessionRunner
from kvtrace.tools.verify_kv import verify_by_cache

# Skipped only where the optional executorch extra is absent: `make test` installs the dev extra, which includes it,
# so CI runs every test here. (test_missing_executorch_names_the_extra fakes its absence itself.)
pytest.importorskip("executorch", reason="the executorch extra (pip install 'kvtrace[executorch]')")

PROMPTS = [[5, 7, 9, 11, 13], [3, 4, 5]]
KV_INIT = -1.0  # a declared initial value the runtime's zero-filled memory would not give by accident


# --- no export ---------------------------------------------------------------------------------------------
def test_capabilities():
    b = registry.get("executorch")
    assert b is EXECUTORCH
    assert b.holds_state and b.standalone and b.one_program and b.packs_weights and not b.native_code
    assert b.compiled({"prefill": 1, "decode": 2, "prefill_image": 3}) == {"forward": 1, "prefill_image": 3}
    assert b.members(["prefill", "decode"]) == set()


def test_missing_executorch_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "executorch", None)  # import executorch -> ImportError
    with pytest.raises(UsageError, match=r"pip install 'kvtrace\[executorch\]'") as e:
        kvtrace.export(tiny_model("llama"), tmp_path / "m.pte", max_seq_len=16, backend="executorch")
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
    pte = tmp_path / "m.pte"
    pte.write_bytes(b"\0\0\0\0ET12" + bytes(64))  # an ExecuTorch file identifier: the executorch backend's file
    et_runtime.runtime.cache_clear()  # imported once per process: forget an earlier import here
    try:
        with pytest.raises(UsageError, match=r"pip install 'kvtrace\[executorch\]'"):
            kvtrace.load(pte)
    finally:
        et_runtime.runtime.cache_clear()


def test_importing_kvtrace_and_the_registry_imports_no_executorch():
    code = ("import sys, kvtrace; from kvtrace.backends import registry; registry.get('executorch'); "
            "print('executorch' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


# --- exports, shared per module ----------------------------------------------------------------------------
def _llama_decoder():
    """A tiny Llama decoder whose CacheSpec declares K/V initial value -1 (not what zeroed memory holds)."""
    from kvtrace.models.registry import make_decoder

    dec = make_decoder(tiny_model("llama"), max_seq_len=32, batch_size=1)
    dec.cache_spec = dataclasses.replace(dec.cache_spec, kv_init=KV_INIT)
    return dec


@pytest.fixture(scope="module")
def llama_pte(tmp_path_factory):
    dec = _llama_decoder()
    path = kvtrace.export(dec, tmp_path_factory.mktemp("et") / "llama.pte", backend="executorch",
                          prefill_logits="last")
    return dec, path


@pytest.mark.compile
def test_llama_pte_is_an_executorch_program_with_initialized_cache(llama_pte):
    dec, path = llama_pte
    assert path.suffix == ".pte" and is_pte(path)
    art = kvtrace.load(path)
    assert art.manifest.backend == "executorch" and art.cache_spec == dec.cache_spec
    assert art.manifest.programs["prefill"].key_pos is False and art.manifest.programs["prefill"].logits == "last"
    s = art.session()
    for b, t in zip(dec.cache_spec.buffers(), s.state, strict=True):  # as the program starts: declared values
        assert tuple(t.shape) == b.shape and bool((t == KV_INIT).all()), b.name
    assert len({t.data_ptr() for t in s.state}) == len(s.state)  # each buffer its own memory
    # ... started from one stored copy of the value all four declare (ExecuTorch would store four)
    program = _flatbuffer_program(path.read_bytes())
    (mutable,) = [program.MutableDataSegments(i) for i in range(program.MutableDataSegmentsLength())]
    one = s.state[0].numel() * s.state[0].element_size()
    assert mutable.OffsetsLength() == 2  # the reserved empty entry, then the one value
    assert one <= program.Segments(mutable.SegmentIndex()).Size() < 2 * one


@pytest.mark.compile
def test_a_pte_without_shared_tensors_is_written_as_executorch_serialized_it(llama_pte):
    from kvtrace.backends.executorch import _share_duplicate_segments

    blob = llama_pte[1].read_bytes()  # untied head: no XNNPACK weight repeats a program constant
    (only,) = _share_duplicate_segments(blob)  # the file as ExecuTorch wrote it: one piece, not copied
    assert only is blob


@pytest.mark.compile
def test_llama_pte_verifies_logits_and_every_cache_layer(llama_pte):
    dec, path = llama_pte
    report = kvtrace.verify(DecoderRunner(dec), [SessionRunner(kvtrace.load(path).session(), "executorch")],
                            PROMPTS, steps=6)
    assert report.passed, report.summary()
    rows = report.rows
    assert {r.prompt for r in rows} == {0, 1} and len(rows) == 2 * 7
    assert all(len(r.k_max_abs) == 2 and max(r.k_max_abs + r.v_max_abs) < 1e-4 for r in rows)


@pytest.mark.compile
def test_session_api_on_the_programs_own_buffers(llama_pte):
    dec, path = llama_pte
    art = kvtrace.load(path)
    s, ref = art.session(), DecoderRunner(dec).session
    a, b = s.prefill(PROMPTS[0]), ref.prefill(PROMPTS[0])
    torch.testing.assert_close(a, b[:, -1:], rtol=1e-4, atol=1e-4)
    assert s.position == 5
    snap = s.snapshot()
    first = s.decode([[3]])
    s.decode([[4]])
    s.rewind(2)
    assert s.position == 5
    torch.testing.assert_close(s.decode([[3]]), first)  # rewound: the same step again
    s.restore(snap)
    torch.testing.assert_close(s.decode([[3]]), first)
    other = art.session()  # its own program instance: untouched by s
    assert all(bool((t == KV_INIT).all()) for t in other.state)
    assert other.state[0].data_ptr() != s.state[0].data_ptr()
    s.reset()  # really back to the declared state, in the program's own memory
    assert s.position == 0 and all(bool((t == KV_INIT).all()) for t in s.state)
    torch.testing.assert_close(s.prefill(PROMPTS[0]), a)


@pytest.mark.compile
def test_a_session_on_eager_programs_swaps_into_the_programs_buffers_mid_answer(llama_pte):
    """The tiered start's swap: the eager decoder's cache is copied once into the .pte's own buffers, which are
    the session's cache from then on; the answer goes on as the .pte's own session gives it."""
    from kvtrace.runtime.session import Session, eager_programs

    dec, path = llama_pte
    art = kvtrace.load(path)
    ref = art.session()
    want = [ref.prefill(PROMPTS[0])] + [ref.decode([[t]]) for t in (3, 4, 5)]
    s = Session.of(eager_programs(dec, prefill_logits="last", vocab_size=art.manifest.vocab_size))
    got = [s.prefill(PROMPTS[0]), s.decode([[3]])]
    eager_state = s.state
    theirs = art.program_set()
    s.swap(theirs)
    assert s.label == "executorch" and s.position == len(PROMPTS[0]) + 1
    assert [t.data_ptr() for t in s.state] == [t.data_ptr() for t in theirs.state]  # the program's memory
    for mine, was in zip(s.state, eager_state, strict=True):  # copied in whole: the live prefix and the rest
        assert torch.equal(mine, was)
    got += [s.decode([[4]]), s.decode([[5]])]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for mine, want_t in zip(s.state, ref.state, strict=True):
        torch.testing.assert_close(mine, want_t, rtol=1e-4, atol=1e-4)
    s.reset()  # the declared initial values, in the program's buffers
    assert all(bool((t == KV_INIT).all()) for t in s.state)
    with pytest.raises(UsageError, match="this session's programs hold its cache"):
        s.swap(eager_programs(dec, prefill_logits="last"))  # out of a program's buffers: refused
    assert s.label == "executorch"
    # one program instance, one session: a second on the same buffers would write the first one's cache
    other = Session.of(eager_programs(dec, prefill_logits="last"))
    with pytest.raises(UsageError, match="another session already runs on them; take a new program set"):
        other.swap(theirs)
    with pytest.raises(UsageError, match="another session already runs on them"):
        Session.of(theirs)
    on_meta = Session.of(eager_programs(dec, prefill_logits="last"), device="meta")
    with pytest.raises(UsageError, match=r"refused: their cache is on \['cpu'\], this session's on meta"):
        on_meta.swap(art.program_set())
    assert other.label == on_meta.label == "eager" and other.position == 0
    fresh = art.program_set()  # a construction refused leaves its programs free for the next session
    with pytest.raises(UsageError, match="hold their cache themselves"):
        Session.of(fresh, cuda_graphs=True)
    assert Session.of(fresh).label == "executorch"


@pytest.mark.compile
def test_a_loaded_pte_runs_from_a_private_copy_the_users_file_cannot_change(llama_pte, tmp_path, monkeypatch):
    import gc
    import os
    import tempfile

    from kvtrace.backends.executorch import TEMP_PREFIX

    dec, good = llama_pte
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp / f"{TEMP_PREFIX}{int(dead.stdout)}-killed"  # left by a load whose process was killed
    stale.mkdir()
    path = tmp_path / "mine.pte"
    path.write_bytes(good.read_bytes())
    s = kvtrace.load(path).session()  # the artifact itself is not kept: the session holds what it needs
    (copy,) = [d for d in tmp.iterdir()]  # the stale dir removed, this load's private copy made
    assert copy.name.startswith(f"{TEMP_PREFIX}{os.getpid()}-") and (copy.stat().st_mode & 0o777) == 0o700
    first = s.prefill(PROMPTS[0])
    with path.open("r+b") as f:  # the user's file cut short in place (as `cp other.pte mine.pte` starts) ...
        f.truncate(4096)
    s.reset()
    torch.testing.assert_close(s.prefill(PROMPTS[0]), first)  # ... changes nothing that runs
    ref = DecoderRunner(dec).session
    torch.testing.assert_close(first, ref.prefill(PROMPTS[0])[:, -1:], rtol=1e-4, atol=1e-4)
    del s
    gc.collect()
    assert list(tmp.iterdir()) == []  # the copy goes with the last session
    with pytest.raises(kvtrace.ArtifactError):
        kvtrace.load(path)  # the truncated file itself (still an ExecuTorch header) is refused ...
    assert list(tmp.iterdir()) == []  # ... and a failed load leaves nothing behind


@pytest.mark.compile
def test_a_program_writing_a_buffer_the_cachespec_does_not_declare_is_refused(tmp_path):
    """ExecuTorch would serialize no initial value for it (the seed bug, for state kvtrace was not told about)."""
    dec = _llama_decoder()
    dec.register_buffer("calls", torch.zeros(1))
    forward = dec.forward

    def counting(*args, **kwargs):
        dec.calls.add_(1)
        return forward(*args, **kwargs)

    dec.forward = counting
    with pytest.raises(CaptureError, match=r"writes buffers \['method.calls'\] that the CacheSpec does not declare"):
        kvtrace.export(dec, tmp_path / "stray.pte", backend="executorch")
    assert not (tmp_path / "stray.pte").exists()


def test_bf16_is_refused_before_anything_loads_naming_what_to_use(tmp_path):
    """A bf16 .pte exports and verifies, but XNNPACK takes none of its matmuls (3.3 tokens/s for SmolLM2, 33 for
    float32 in the same hour): refused, in one line, by export and by the tiered start, before any build."""
    from kvtrace.artifact import tiered

    for refused in (lambda: kvtrace.export(tiny_model("llama"), tmp_path / "m.pte", backend="executorch",
                                           max_seq_len=16, dtype="bfloat16"),
                    lambda: tiered.start(str(tmp_path / "no-such-model"), backend="executorch", max_seq_len=16,
                                         dtype="bfloat16")):
        with pytest.raises(kvtrace.UnsupportedError, match=r"no fast bfloat16 path.*export with dtype float32") as e:
            refused()
        assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.compile
def test_the_export_says_nothing_of_meaningless_initial_state(tmp_path):
    """ExecuTorch warns, for any mutated buffer, that it assumes "a meaningless initial state" unless marked;
    kvtrace marks every one (and refuses a program with any other), so its users are not told the seed bug
    happened to them."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kvtrace.export(tiny_model("llama"), tmp_path / "m.pte", backend="executorch", max_seq_len=16)
    assert not [w for w in seen if "meaningless initial state" in str(w.message)]


@pytest.mark.compile
def test_planted_fault_cache_without_initial_values_fails_verify(llama_pte, tmp_path):
    """The seed's bug: the cache exported as mutable buffers without their initial values."""
    dec, good = llama_pte
    broken = registry.register(dataclasses.replace(EXECUTORCH, name="executorch-noinit", initialize_state=False))
    try:
        bad = kvtrace.export(dec, tmp_path / "noinit.pte", backend=broken.name, prefill_logits="last")
        s = kvtrace.load(bad).session()
        assert not any(bool((t == KV_INIT).any()) for t in s.state)  # the runtime's memory, not the declared -1
        report = kvtrace.verify(DecoderRunner(dec), [SessionRunner(s, "noinit")], PROMPTS, steps=2)
    finally:
        registry.unregister(broken.name)
    assert not report.passed
    fail = report.first_failure("noinit")
    assert fail is not None and fail.prompt == 0 and fail.step == "prefill"
    assert "layers.0.k holds 0" in fail.failure and "declares -1" in fail.failure
    ok = kvtrace.verify(DecoderRunner(dec), [SessionRunner(kvtrace.load(good).session(), "good")], PROMPTS, steps=2)
    assert ok.passed


@pytest.mark.compile
def test_loading_needs_no_transformers_no_torch_export_deserialization_and_no_compiler(llama_pte):
    _, path = llama_pte
    code = ("import sys, torch, torch.export, torch._export.serde.serialize as ser, kvtrace\n"
            "def refuse(*a, **k): raise AssertionError('a torch.export program was deserialized')\n"
            "ser.deserialize = torch.export.load = refuse\n"
            "s = kvtrace.load(sys.argv[1]).session(); s.prefill([[5, 7, 9]]); s.decode([[3]])\n"
            "print(*(m in sys.modules for m in ('transformers', 'executorch.exir', 'torch._inductor.lowering')))")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    # ExecuTorch's compiler (exir) and Inductor's lowerings (which its custom ops' module imports) took ~6 s of
    # every load; running a .pte needs only the runtime extension and the llama kernels' library
    assert out.stdout.split() == ["False", "False", "False"]


# --- 8da4w: XNNPACK's dynamically quantized GEMMs ------------------------------------------------------------------
def test_only_8da4w_is_offered_and_said_so_before_any_capture(tmp_path):
    for scheme in ("int8", "int4", "gguf"):
        why = "fold the GGUF blocks" if scheme == "gguf" else f"does not offer quant='{scheme}'; it takes '8da4w'"
        with pytest.raises(kvtrace.UnsupportedError, match=why):
            kvtrace.export(tiny_model("llama"), tmp_path / "q.pte", backend="executorch", max_seq_len=16, quant=scheme)
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def llama_8da4w(tmp_path_factory):
    model = tiny_model("llama")
    return model, kvtrace.export(model, tmp_path_factory.mktemp("et8") / "q.pte", backend="executorch", max_seq_len=32,
                                 quant="8da4w", prefill_logits="last")


def _kernel_calls(path: Path) -> list[str]:
    """The operators the forward method calls outside delegates (ExecuTorch's portable kernels), in order."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(path.read_bytes())
    (plan,) = [p for p in getattr(pte, "program", pte).execution_plan if p.name == "forward"]
    return [plan.operators[i.instr_args.op_index].name for c in plan.chains for i in c.instructions
            if type(i.instr_args).__name__ == "KernelCall"]


@pytest.mark.compile
def test_8da4w_pte_runs_xnnpacks_quantized_gemms_and_verifies_against_the_same_weights(llama_8da4w, llama_pte):
    model, path = llama_8da4w
    art = kvtrace.load(path)
    qs = art.manifest.quant
    assert (qs.scheme, qs.group_size, qs.activations, qs.int4_layout) == ("8da4w", 32, "int8-asym", None)
    assert set(qs.tensors.values()) == {"int4-sym", "int8"} and qs.tensors["output"] == "int8"
    # every quantized matmul and its activation quantization inside XNNPACK, none in a portable kernel
    calls = _kernel_calls(path)
    assert not [c for c in calls if "quant" in c or "choose" in c or "linear" in c or "mm" in c], calls
    assert path.stat().st_size < 0.5 * llama_pte[1].stat().st_size  # the fp32 .pte of the same shapes
    report = verify_by_cache(model, EagerRunner(model), [SessionRunner(art.session(), "8da4w")], PROMPTS, steps=6)
    assert report.passed, report.summary()
    assert {r.reference for r in report.rows} == {"decoder-eager-8da4w-g32-int8-asym"}
    assert report.floors["8da4w"] is not None  # judged with the reference's noise floor measured
    (s,) = report.summary()
    assert s["tokens_agree"] == s["steps"] and s["logits_max_abs"] < 0.02


@pytest.mark.compile
def test_8da4w_pte_with_a_wrong_group_size_fails_verify(llama_8da4w, tmp_path, monkeypatch):
    """The program quantizes and dequantizes groups of 64 while its manifest records 32."""
    from kvtrace.models import quant as q

    model, good = llama_8da4w
    real, real_init = q.quantize_int4, q.DynQuantLinear.__init__
    monkeypatch.setattr(q, "quantize_int4", lambda w, g, symmetric=False: real(w, 64, symmetric))
    monkeypatch.setattr(q.DynQuantLinear, "__init__", lambda self, qv, sc, g, bits, b:
                        real_init(self, qv, sc, 64 if bits == 4 else g, bits, b))
    bad = kvtrace.export(model, tmp_path / "g64.pte", backend="executorch", max_seq_len=32, quant="8da4w",
                         prefill_logits="last")
    monkeypatch.undo()
    assert kvtrace.load(bad).manifest.quant.group_size == 32
    runners = [SessionRunner(kvtrace.load(p).session(), n) for n, p in (("good", good), ("wrong-group", bad))]
    report = verify_by_cache(model, EagerRunner(model), runners, PROMPTS, steps=2)
    assert report.first_failure("good") is None
    fail = report.first_failure("wrong-group")
    assert fail is not None and (fail.prompt, fail.step) == (0, "prefill"), fail


# --- other families --------------------------------------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize(("arch", "overrides"), [("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 4}),
                                                ("gemma2", {})], ids=["qwen2", "qwen3", "mistral-sliding", "gemma2"])
def test_families_verify(arch, overrides, tmp_path):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral with a window of 4 (rings: a 10-token prompt and 8
    decoded tokens cross it; ExecuTorch's remainder of a negative int once broke the ring's slot positions),
    Gemma 2 (its own decoder: soft-capping, local rings of 8 and global layers)."""
    model = tiny_model(arch, **overrides)
    path = kvtrace.export(model, tmp_path / f"{arch}.pte", max_seq_len=32, backend="executorch")
    prompts = [list(range(5, 25, 2)), [3, 4, 5]]
    report = kvtrace.verify(EagerRunner(model), [SessionRunner(kvtrace.load(path).session(), arch)], prompts, steps=8)
    assert report.passed, report.summary()


@pytest.mark.compile
def test_vision_decoder_verifies_image_and_text_prompts(tmp_path):
    model = tiny_mllama()
    path = kvtrace.export(model, tmp_path / "mllama.pte", max_seq_len=32, backend="executorch", image_tokens=6)
    art = kvtrace.load(path)
    assert set(art.manifest.programs) == {"prefill", "decode", "prefill_image"}
    prompts = [Prompt([5, 7, 9], {"cross_attention_states": image_features()}), [3, 4, 5, 6]]
    s = art.session()
    for b, t in zip(art.cache_spec.buffers(), s.state, strict=True):  # values of four sizes, each stored once
        assert torch.equal(t, b.allocate()), b.name
    program = _flatbuffer_program(path.read_bytes())
    assert program.MutableDataSegments(0).OffsetsLength() == 1 + 4  # self K/V, cross K/V, mask, flag
    report = kvtrace.verify(EagerRunner(model), [SessionRunner(s, "executorch")], prompts, steps=5)
    assert report.passed, report.summary()
    cross = report.rows[0]  # the image prompt's prefill: the cross layers (1, 3) hold the image K/V
    assert all(cross.k_max_abs[i] < 1e-4 for i in (1, 3))


# --- ExecuTorch's own LLM runner -------------------------------------------------------------------------------
def _bpe_model_dir(d: Path) -> tuple[Path, object]:
    """A tiny byte-level BPE tokenizer (what ExecuTorch's HF tokenizer reads) and a random Llama whose greedy
    picks are printable ASCII tokens (other rows of its head zeroed), saved as an HF model dir. Its head is tied
    to its embedding, as in SmolLM2 and Llama 3.2."""
    import tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the cat sat on the mat", "caches are declared state", "who founded meta"] * 20,
                            vocab_size=300, min_frequency=1, special_tokens=["<s>", "</s>"])
    bpe.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                          "bos_token": "<s>", "eos_token": "</s>"}))
    tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    torch.manual_seed(0)
    vocab = 320
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": vocab}, bos_token_id=0, eos_token_id=1,
                                         tie_word_embeddings=True)).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20)
        words = [i for i in range(2, tok.get_vocab_size()) if tok.decode([i]).strip().isascii()
                 and tok.decode([i]).strip().isprintable() and tok.decode([i]).strip()]
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[words] = True
        model.lm_head.weight[~keep] = 0.0
        model.lm_head.weight.mul_(20)
    model.save_pretrained(d)
    return d, model


@pytest.mark.compile
def test_executorchs_text_llm_runner_streams_eagers_greedy_tokens(tmp_path):
    import executorch.extension.llm.runner as runner_mod  # part of executorch, which this module requires
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (the .pte's fused kernels)

    (tmp_path / "src").mkdir()
    src, model = _bpe_model_dir(tmp_path / "src")
    pte = kvtrace.export(str(src), tmp_path / "model.pte", max_seq_len=64, backend="executorch")
    tok_file = tokenizer_path(pte)
    assert tok_file == tmp_path / "model.tokenizer.json" and tok_file.is_file()
    # one copy of the tied table (the lookup's constant, which XNNPACK's head reads too); the declared (zero)
    # cache values stored as initialized state, not left to the runtime's allocator
    blob = pte.read_bytes()
    table = model.model.embed_tokens.weight.detach().contiguous().numpy().tobytes()
    assert blob.count(table) == 1
    assert _flatbuffer_program(blob).MutableDataSegmentsLength() == 1
    prompt, n = "the cat sat", 12
    runner = runner_mod.TextLLMRunner(str(pte), str(tok_file))
    pieces: list[str] = []
    runner.generate(prompt, runner_mod.GenerationConfig(temperature=0.0, max_new_tokens=n, echo=False),
                    token_callback=pieces.append)
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(tok_file))
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    eager = [tok.decode([t]) for t in out[0, len(ids):].tolist()]
    assert len(pieces) == n and pieces == eager


# --- the CLI ------------------------------------------------------------------------------------------------
@pytest.mark.compile
def test_cli_export_run_and_verify_against_executorch(tmp_path, capsys):
    from conftest import make_tiny_hf_dir
    from kvtrace.cli.main import main

    src = tmp_path / "hf"
    src.mkdir()
    make_tiny_hf_dir(src, words_only=True)
    pte = tmp_path / "tiny.pte"
    assert main(["export", str(src), "--backend", "executorch", "-o", str(pte), "--max-seq-len", "32"]) == 0
    assert is_pte(pte) and tokenizer_path(pte).is_file()
    assert main(["run", str(pte), "--prompt", "hello world", "--raw", "--max-len", "8", "--temperature", "0"]) == 0
    printed = capsys.readouterr()
    assert "stop: max_new_tokens" in (printed.out + printed.err).replace("\n", " ")
    # ExecuTorch's pip build logs its CPU probe (cpuinfo_utils.cpp, Info level, from C++ to fd 2) when XNNPACK
    # first starts in a process: shown with --debug, kept out of the terminal otherwise
    run = [sys.executable, "-m", "kvtrace.cli", "run", str(pte), "--prompt", "hello", "--raw", "--max-len", "4"]
    env = {k: v for k, v in os.environ.items() if k != NATIVE_QUIET_ENV}
    debug, plain = (subprocess.run(run + extra, capture_output=True, text=True, env=env, timeout=120, check=True)
                    for extra in (["--debug"], []))
    assert "cpuinfo_utils.cpp" in debug.stderr
    assert "cpuinfo_utils.cpp" not in plain.stderr and "decode" in plain.stderr, plain.stderr
    out = tmp_path / "report.json"
    code = main(["verify", str(src), "--against", "executorch", "--steps", "3", "--raw", "--prompt", "hello world",
                 "--max-seq-len", "32", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["passed"] is True and [s["candidate"] for s in report["summary"]] == ["executorch"]
    assert len(report["rows"]) == 2 * (1 + 3)  # prompts x (prefill + steps), logits and every layer's K/V
