"""Shared test helpers (not fixtures: those live in conftest.py). Import as ``from helpers import ...``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers as tf

from conftest import CHATML
from kvtrace.spec.tolerances import close, tolerance_for


def assert_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32, what: str = "") -> float:
    """``a`` within ``dtype``'s tolerance (kvtrace.spec.tolerances) of the reference ``b``; the max abs diff."""
    ok, diff, limit = close(a, b, tolerance_for(dtype))
    assert ok, f"{what}: max|a - b| = {diff:.3g} > {limit:.3g}"
    return diff


class CacheKwargOnlyLlama(tf.LlamaForCausalLM):
    """A Llama whose forward takes the cache as ``cache=`` only, as transformers 5.40 will (5.24 still takes
    the deprecated ``past_key_values=`` through its ``**kwargs``): a caller using the old name fails."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kwargs):
        if "past_key_values" in kwargs:
            raise TypeError("forward() got an unexpected keyword argument 'past_key_values'")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, **kwargs)


def cache_kwarg_only_model() -> CacheKwargOnlyLlama:
    from conftest import TINY

    torch.manual_seed(0)
    return CacheKwargOnlyLlama(tf.LlamaConfig(**TINY)).eval().requires_grad_(False)


def write_gguf(
    path: Path, arch: str = "llama", *, vocab: int = 8, hidden: int = 64, layers: int = 2,
    tensors: str | None = None, template: str = CHATML, padding: int = 0, raw: dict | None = None,
    qtype: str | None = None, embd_qtype: str | None = None, qtypes: dict | None = None,
) -> Path:
    """A tiny random GGUF labelled ``arch`` holding the tensors of architecture ``tensors`` (default:
    ``arch``), complete enough for transformers to load. ``padding``: bytes of a description written
    before the chat template (pushes it deep into the metadata); ``raw``: extra tensors {name: array}.
    ``qtype`` ("Q4_0", "Q4_1", "Q8_0", "F16", ...): the blocks' weight matrices stored as that GGML type (quantized by
    the gguf package), ``embd_qtype`` the token embedding's; ``qtypes``: per tensor name, overriding both."""
    import gguf  # here, not at import: the GPU machine's image has no gguf and its tests need none

    rng = np.random.default_rng(0)
    heads, kv_heads, inter = 4, 2, 128
    tensors = tensors or arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    if padding:
        w.add_description("x" * padding)
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    # transformers reads no head_dim from a qwen3 GGUF: Qwen3Config's 128 (that of every Qwen3) applies
    head_dim = 128 if tensors == "qwen3" else hidden // heads
    if tensors == "qwen3":
        w.add_key_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b", "ab", "Ġ", "c"][:vocab])
    w.add_token_types([3, 3, 3, 1, 1, 1, 1, 1][:vocab])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(template)

    def rand(name: str, *shape: int) -> None:  # numpy shape is HF's [out, in]; GGUF stores dims reversed
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        kind = (qtypes or {}).get(name, embd_qtype if name == "token_embd.weight" else qtype if len(shape) == 2 else None)
        if kind in (None, "F32"):
            w.add_tensor(name, data)
        elif kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            t = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)

    rand("token_embd.weight", vocab, hidden)  # no output.weight: lm_head is tied to the embedding
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        if tensors == "phi3":  # fused q/k/v and gate/up
            rand(f"blk.{i}.attn_qkv.weight", q + 2 * kv, hidden)
            rand(f"blk.{i}.ffn_up.weight", 2 * inter, hidden)
        else:
            rand(f"blk.{i}.attn_q.weight", q, hidden)
            rand(f"blk.{i}.attn_k.weight", kv, hidden)
            rand(f"blk.{i}.attn_v.weight", kv, hidden)
            rand(f"blk.{i}.ffn_gate.weight", inter, hidden)
            rand(f"blk.{i}.ffn_up.weight", inter, hidden)
        if tensors == "qwen2":
            rand(f"blk.{i}.attn_q.bias", q)
            rand(f"blk.{i}.attn_k.bias", kv)
            rand(f"blk.{i}.attn_v.bias", kv)
        if tensors == "qwen3":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, np.float32))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        rand(f"blk.{i}.attn_output.weight", hidden, q)
        rand(f"blk.{i}.ffn_down.weight", hidden, inter)
    for name, array in (raw or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# planted faults shared by the jit-trust and lint tests: forwards that a capture at one length gets wrong
class BranchOnLength(tf.LlamaForCausalLM):
    """Takes a Python branch on the prompt length: a capture at one length is wrong at another."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if input_ids.shape[1] > 4:
            out.logits = out.logits * 2
        return out


class BakedLength(tf.LlamaForCausalLM):
    """Turns the prompt length into a Python int and computes with it: the capture bakes the example's length."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        n = int(input_ids.shape[1])
        out.logits = out.logits * n
        return out


def verify_bf16_export(low: torch.nn.Module, path: Path, prompts, steps: int, max_seq_len: int):
    """Export the bf16 model ``low`` as bf16 programs (export's default dtype is float32: say it), check the
    artifact holds bf16, and verify it against eager bf16 with the fp32 reference (the model upcast); the
    report passed with one row per prompt and step. Returns the artifact."""
    import copy

    import kvtrace
    from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

    high = copy.deepcopy(low).float()
    kvtrace.export(low, path, max_seq_len=max_seq_len, backend="exported", dtype="bfloat16")
    art = kvtrace.load(path)
    assert art.cache_spec.dtype == "bfloat16"  # the bf16 programs are the ones verified
    report = verify(EagerRunner(low), [SessionRunner(art.session(), "exported")], prompts, steps=steps,
                    dtype=torch.bfloat16, fp32=EagerRunner(high, "fp32"))
    assert report.passed, [f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed]
    assert len(report.rows) == len(prompts) * (1 + steps)
    return art


def assert_exact_beyond_window(model: torch.nn.Module, art, runner: str, prompts, steps: int, window: int, kinds,
                               *, kv_limit: float = 1e-5, logits_limit: float = 1e-4,
                               rel_limit: float | None = None) -> dict[str, float]:
    """Verify artifact ``art`` (through a Session named ``runner``) against HF eager on ``prompts`` with ``steps``
    greedy steps each, the second prompt decoding past twice the ``window``; every row passes with logits and
    every cache layer far inside fp32's tolerance (the same arithmetic as HF's, not an approximation), and
    eager's own sliding layers (``kinds[i]`` is layer i's LayerKind) held the last window - 1 tokens while
    its full layers held everything. Returns the worst logits and cache errors."""
    from kvtrace.spec.cache import LayerKind
    from kvtrace.tools.verify import EagerRunner, SessionRunner, verify

    eager = EagerRunner(model)
    report = verify(eager, [SessionRunner(art.session(), runner)], prompts, steps=steps)
    assert report.passed, "\n".join(f"p{r.prompt}/{r.step}: {r.failure}" for r in report.rows if not r.passed)
    assert len(report.rows) == len(prompts) * (1 + steps)
    end = len(prompts[-1]) + steps
    assert max(r.position for r in report.rows) == end > 2 * window
    for r in report.rows:
        where = (r.prompt, r.step)
        assert r.cache_len_ok and r.token_agree and r.top1_agree == 1.0, where
        assert len(r.k_max_abs) == len(kinds) and max(*r.k_max_abs, *r.v_max_abs) <= kv_limit, where
        assert r.logits_max_abs <= logits_limit, (*where, r.logits_max_abs)
        assert rel_limit is None or r.logits_max_rel <= rel_limit, (*where, r.logits_max_rel)
    held = [layer.keys.shape[2] for layer in eager._cache.layers]
    assert held == [window - 1 if k is LayerKind.SLIDING else end for k in kinds]
    return {"logits": max(r.logits_max_abs for r in report.rows),
            "cache": max(max(*r.k_max_abs, *r.v_max_abs) for r in report.rows)}


def elf_sections(so: bytes) -> dict[str, int]:
    """Section name -> size in bytes of a 64-bit little-endian ELF library (a compiled AOTInductor program:
    its frozen weights are ``.lrodata``)."""
    import struct

    assert so[:6] == b"\x7fELF\x02\x01", "not a 64-bit little-endian ELF file"
    shoff, = struct.unpack_from("<Q", so, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", so, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", so, shoff + i * shentsize) for i in range(shnum)]  # name, type, flags, addr, offset, size
    names_at = headers[shstrndx][4]

    def name(off: int) -> str:
        return so[names_at + off: so.index(b"\0", names_at + off)].decode()

    return {name(h[0]): h[5] for h in headers if h[0]}


def package_libraries(path) -> dict[str, bytes]:
    """Model name -> its compiled library (.so bytes), of an AOTInductor artifact's package (programs/aoti.pt2)."""
    import io
    import zipfile

    with zipfile.ZipFile(path) as zf, zipfile.ZipFile(io.BytesIO(zf.read("programs/aoti.pt2"))) as pkg:
        return {n.split("/aotinductor/")[1].split("/")[0]: pkg.read(n) for n in pkg.namelist() if n.endswith(".so")}
