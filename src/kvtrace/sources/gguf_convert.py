"""A checked GGUF file -> an HF checkpoint's pieces (config, fp32 state dict, tokenizer), in seconds.

transformers' own GGUF path builds gguf's ``GGUFReader`` three times (config, tokenizer, weights: ~10 s each
on SmolLM2, most of it wrapping every vocabulary string in a numpy view) and a ``TensorNameMap`` once per
module (~400 times). This reads the header once (``sources.gguf``'s walk) and asks transformers and gguf only
for what they know — the metadata -> config mapping tables, the tokenizer conversion, gguf's tensor-name map
(built once) and dequantization, the per-architecture tensor processors (llama's q/k row permutation) — so the
result is what transformers' conversion gives, bit for bit (``tests/sources/test_gguf_convert.py`` holds
them side by side), without its readers.

The tensor data is memory-mapped; each tensor is dequantized by gguf's numpy kernels (vectorized over blocks),
the same calls transformers makes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtrace.sources.gguf import GGUFInfo

__all__ = ["Converted", "convert_gguf"]


@dataclass(frozen=True)
class Converted:
    config: Any  # the transformers PretrainedConfig
    state: dict[str, torch.Tensor]  # HF names -> fp32 tensors; a tied weight once (the first name)
    tokenizer: Any  # the transformers tokenizer (its backend_tokenizer is the tokenizers.Tokenizer)
    missing: list[str]  # parameters of the HF model no GGUF tensor fills
    mismatched: list[str]  # parameters a GGUF tensor of another shape would fill
    unexpected: list[str]  # GGUF tensors the HF model has no place for


def convert_gguf(path: Path, info: GGUFInfo) -> Converted:
    """Convert ``path`` (checked by ``check_gguf``, giving ``info``) as transformers would, fast."""
    from transformers import AutoConfig

    config_dict = _config_dict(info)
    config = AutoConfig.for_model(**config_dict)
    model = _skeleton(config)
    seen: set[int] = set()
    expected = {}  # the state dict's names -> shapes, a tied weight under its first name only
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            expected[name] = tuple(t.shape)
    names = _gguf_to_hf(model, config.model_type)
    processor = _processor(info.arch, config_dict)
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    buf = np.memmap(path, mode="r", dtype=np.uint8)  # pages are read as each tensor is dequantized
    with _one_thread():
        for t, raw in _tensors(buf, info):
            _convert_one(t, raw, processor, names, state, unexpected)
    missing = [n for n in expected if n not in state]
    mismatched = [f"{n} {list(state[n].shape)} (expected {list(shape)})" for n, shape in expected.items()
                  if n in state and tuple(state[n].shape) != shape]
    state = {n: state[n] for n in expected if n in state}
    return Converted(config, state, _tokenizer(path), missing, mismatched, unexpected)


def _convert_one(t: Any, raw: np.ndarray, processor: Any, names: dict[str, str], state: dict[str, torch.Tensor],
                 unexpected: list[str]) -> None:
    weights = processor.process(weights=_dequantize(raw, t.ggml_type), name=t.name, tensor_key_mapping=names,
                                parsed_parameters={"tensors": {}})
    hf = names.get(weights.name)
    if hf is None:
        unexpected.append(t.name)
        return
    w = np.ascontiguousarray(weights.weights, dtype=np.float32)  # copies a permuted or half-precision one
    if not w.flags.writeable:  # still a view of the mapped file (a float32 tensor): the state owns its memory
        w = w.copy()
    state[hf] = torch.from_numpy(w)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread: these small elementwise kernels gain nothing from two, and on a busy machine
    OpenMP's barriers wait for descheduled threads (SmolLM2's dequantization: 1-2 s on one thread, 10-20 s
    on two with other jobs running)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _config_dict(info: GGUFInfo) -> dict[str, Any]:
    """The metadata renamed by transformers' GGUF tables, as its legacy reader assembles them."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    arch = info.arch
    # llama.cpp labels Mistral "llama"; transformers tells them apart by a general.name of exactly "mistral"
    updated = "mistral" if "llama" in arch and info.meta.get("general.name") == "mistral" else arch
    config: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in info.tensors)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in info.meta.items():
        key = key.replace(arch, updated)
        prefix, _, rest = key.partition(".")
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        new = renames.get(prefix, {}).get(rest, -1)
        if new not in (-1, None):
            config[new] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in info.meta:
        config["vocab_size"] = info.meta["tokenizer.ggml.tokens"]  # the walk keeps an array's length
    return config


def _skeleton(config: Any) -> torch.nn.Module:
    """The HF model of ``config`` on the meta device: its parameter names and ties, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _gguf_to_hf(model: torch.nn.Module, model_type: str) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, from gguf's name map (built once), the way transformers
    matches them: each state-dict name of the model, then of each submodule for names still unmatched."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == model_type)
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)

    def walk(module: torch.nn.Module, qual: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for hf in module.state_dict():
            name, suffix = hf, ""
            if hf.endswith((".weight", ".bias")):
                name, suffix = hf.rsplit(".", 1)
                suffix = "." + suffix
            gguf_name = name_map.get_name(name)
            if gguf_name is not None:
                out[gguf_name + suffix] = qual + hf
        for child, sub in module.named_children():  # a submodule's names fill only what is still unmatched
            out.update({k: v for k, v in walk(sub, f"{qual}{child}.").items() if k not in out})
        return out

    return walk(model, "")


def _processor(arch: str, config: dict[str, Any]) -> Any:
    """transformers' per-architecture tensor processor (llama: q/k rows back from llama.cpp's rope order)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)


def _tensors(buf: Any, info: GGUFInfo) -> Any:
    """(tensor, its stored data as gguf's reader shapes it) per tensor, in file order: plain types as values
    ``[*reversed(dims)]``, block types as bytes ``[*reversed(dims)[:-1], bytes per row]``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for t in info.tensors:
        qtype = GGMLQuantizationType(t.ggml_type)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(t.dims))
        n = int(np.prod(shape))
        start = info.data_start + t.offset
        nbytes = n // block * block_bytes
        raw = np.asarray(buf[start : start + nbytes])  # read-only pages of the mapped file
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
        yield t, data


def _dequantize(data: np.ndarray, ggml_type: int) -> np.ndarray:
    """gguf's dequantization; the common block types in torch instead (gguf's numpy kernels loop over row
    groups in Python), with the same float32 operations in the same order, so the same bits."""
    from gguf import dequantize

    fast = _TORCH_DEQUANT.get(ggml_type)
    if fast is None:
        return dequantize(data, ggml_type)
    block, nbytes = fast[1], fast[2]
    blocks = torch.from_numpy(np.array(data, order="C").reshape(-1, nbytes))  # [n_blocks, bytes]: a copy of the file's
    out = fast[0](blocks)  # [n_blocks, block] float32
    return out.reshape(*data.shape[:-1], data.shape[-1] // nbytes * block).numpy()


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 scale at bytes ``start .. start+1`` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: the low nibbles are elements 0..15, the high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # 18 bytes: d f16, 16 bytes of nibbles; x = d * (q - 8)
    return _half(b, 0) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # 20 bytes: d f16, m f16, 16 bytes of nibbles; x = d * q + m
    return _half(b, 0) * _nibbles(b[:, 4:]).float() + _half(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # 34 bytes: d f16, 32 int8; x = q * d
    return b[:, 2:].contiguous().view(torch.int8).float() * _half(b, 0)


# ggml type -> (kernel, elements per block, bytes per block)
_TORCH_DEQUANT = {2: (_q4_0, 32, 18), 3: (_q4_1, 32, 20), 8: (_q8_0, 32, 34)}


def _tokenizer(path: Path) -> Any:
    """The tokenizer transformers builds from the file (its fast metadata reader and converter), wrapped
    as ``AutoTokenizer`` wraps it, without re-reading the config through the slow reader."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    arch, tokenizer, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, tokenizer)
    return TokenizersBackend(tokenizer_object=backend, **{**tokenizer_config, **extra})
