"""QuantSpec: which weights of a decoder are stored quantized, in which format (recorded in the manifest).

Schemes (``SCHEMES``; ``kvtrace export --quant``):

- ``int8``: every linear layer's weight int8, one scale per output channel (symmetric), computed by
  ``aten._weight_int8pack_mm`` with bfloat16 activations;
- ``int4``: every linear layer's weight 4-bit, groups of ``group_size`` input features with a scale and a
  zero each (asymmetric, min/max), computed by ``aten._weight_int4pack_mm_for_cpu`` with bfloat16
  activations: ``w = (q - 8) * scale + zero``;
- ``8da4w``: int4 weights, symmetric per group (zero 0), and each row of activations quantized to int8
  (symmetric, one scale per token) before the matmul, as torchao's 8da4w / ExecuTorch's XNNPACK export
  compute it; on x86 the matmul is the int4 kernel's (no int8 x int4 kernel ships for x86 CPUs). The
  ``executorch`` backend computes the same weights as XNNPACK's dynamically quantized GEMMs do: each row of
  activations int8 with a scale and a zero point (asymmetric), float32 otherwise (``act="int8-asym"``);
- ``gguf``: a GGUF's own Q4_0 / Q4_1 / Q8_0 blocks, kept as the file stores them (no re-quantization) and
  computed in float32 exactly from them: ``w = d * q + m`` (Q4_1), ``d * (q - 8)`` (Q4_0), ``d * q`` (Q8_0),
  32 weights per block, float16 d and m. Tensors of other GGUF types are dequantized (``dequantized``).

``head`` (int8/int4/8da4w): the token embedding and the output head (tied or not) as int8, one scale per
row — on SmolLM2 the tied 49152 x 576 embedding is ~21 % of the weights. Norms, biases and RoPE tables stay
in the model's dtype. ``tensors`` records the format of every quantized module by name.

Layer 1: imports nothing from kvtrace but ``kvtrace._errors``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvtrace._errors import ArtifactError, UsageError

__all__ = ["ACTIVATIONS", "ACTIVATION_MODES", "BF16_ACTIVATIONS", "FORMATS", "GROUP_SIZES", "INT4_LAYOUTS", "SCHEMES", "QuantSpec",
           "parse_quant"]

SCHEMES = ("int8", "int4", "8da4w", "gguf")
GROUP_SIZES = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu takes
# per-module formats: int8 per output channel; int4 group-wise asymmetric / symmetric (8da4w);
# an int8 embedding (per row); the GGUF block types kept as they are
FORMATS = ("int8", "int4", "int4-sym", "q4_0", "q4_1", "q8_0")
# torch's CPU int4pack layouts (``aten._convert_weight_to_int4pack_for_cpu``), by what torch dispatches: "n64" (AVX-512:
# blocks of 64 outputs, outputs n and n + 32 in one byte), "n32" (AVX2: 32, n and n + 16), "pairs" (others: n, n + 1)
INT4_LAYOUTS = ("n64", "n32", "pairs")
# what each scheme's matmuls compute with, unless a backend records otherwise (``QuantSpec.act``): bf16 activations;
# each row int8 (symmetric) then bf16; float32. "int8-asym": each row int8 with a zero point, float32 otherwise
ACTIVATIONS = {"int8": "bfloat16", "int4": "bfloat16", "8da4w": "int8-dynamic", "gguf": "float32"}
ACTIVATION_MODES = ("bfloat16", "int8-dynamic", "int8-asym", "float32")
BF16_ACTIVATIONS = ("bfloat16", "int8-dynamic")  # the modes whose matmuls round their inputs and outputs to bf16


@dataclass(frozen=True)
class QuantSpec:
    """How a decoder's weights are quantized: the scheme and, per quantized module, its format."""

    scheme: str
    group_size: int | None = None  # int4 / 8da4w: input features per scale (GGUF blocks: 32)
    head: bool = True  # int8/int4/8da4w: embedding and output head as int8 too
    # module name -> format (FORMATS), sorted; a tied head names its embedding ("output": "tied:tok_embeddings")
    tensors: dict[str, str] = field(default_factory=dict)
    dequantized: dict[str, str] = field(default_factory=dict)  # gguf: module -> why it is not kept (its GGUF type)
    # int4 / 8da4w: the CPU int4pack layout the stored int4 weights are packed in (``INT4_LAYOUTS``). torch packs and
    # reads it by the CPU capability it dispatches (AVX-512: 64 outputs a block, AVX2: 32, others: pairs), so a
    # weight packed under one is read as scrambled values under another; load refuses a mismatch. None: not
    # recorded (kvtrace <= 0.4.2), or no int4 module.
    int4_layout: str | None = None
    # the activations the programs compute with where a backend's kernels differ from the scheme's own (ACTIVATIONS):
    # "int8-asym" for executorch's 8da4w (XNNPACK's dynamically quantized GEMMs); None: the scheme's own
    act: str | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise UsageError(f"quant must be one of {list(SCHEMES)} (or 'none'), got {self.scheme!r}")
        if self.scheme in ("int4", "8da4w"):
            if self.group_size not in GROUP_SIZES:
                raise UsageError(f"{self.scheme} group_size must be one of {list(GROUP_SIZES)}, got {self.group_size!r}")
        elif self.scheme == "gguf":
            if self.group_size not in (None, 32):
                raise UsageError(f"gguf blocks hold 32 weights; group_size {self.group_size!r} does not apply")
            object.__setattr__(self, "group_size", 32)
        elif self.group_size is not None:
            raise UsageError(f"{self.scheme} is per output channel; group_size {self.group_size!r} does not apply")
        if self.int4_layout is not None and self.int4_layout not in INT4_LAYOUTS:
            raise UsageError(f"int4_layout must be one of {list(INT4_LAYOUTS)}, got {self.int4_layout!r}")
        if self.act is not None and (self.act not in ACTIVATION_MODES or self.act == ACTIVATIONS[self.scheme]
                                     or (self.act == "int8-asym") != (self.scheme == "8da4w")):
            raise UsageError(f"{self.scheme} weights computed with {self.act!r} activations is not a combination "
                             f"kvtrace offers (8da4w: 'int8-dynamic' or 'int8-asym')")
        for name, fmt in self.tensors.items():
            if fmt not in FORMATS and not fmt.startswith("tied:"):
                raise UsageError(f"quantized module {name}: format must be one of {list(FORMATS)}, got {fmt!r}")

    def __hash__(self) -> int:  # verify groups candidates by it; the dicts are never mutated
        return hash((self.scheme, self.group_size, self.head, tuple(sorted(self.tensors.items())),
                     tuple(sorted(self.dequantized.items())), self.act))

    @property
    def activations(self) -> str:
        """What the quantized matmuls compute with: "bfloat16", "int8-dynamic" (8da4w), "int8-asym" (executorch's
        8da4w) or "float32" (gguf)."""
        return self.act or ACTIVATIONS[self.scheme]

    def computed_with(self, activations: str) -> QuantSpec:
        """This spec as a backend whose kernels compute it with ``activations`` (``Backend.quant_activations``):
        itself where those are the scheme's own, else with ``act`` recorded."""
        return self if activations == self.activations else dataclasses.replace(self, act=activations)

    @property
    def key(self) -> str:
        """What changes the programs (the artifact cache keys on it): scheme, group size, head."""
        return self.scheme + (f"-g{self.group_size}" if self.scheme in ("int4", "8da4w") else "") + (
            "" if self.head or self.scheme == "gguf" else "-nohead") + (f"-{self.act}" if self.act else "")

    def describe(self) -> str:
        n = len(self.tensors)
        extra = f", {len(self.dequantized)} dequantized" if self.dequantized else ""
        return f"{self.key} ({n} quantized modules{extra}; activations {self.activations})"

    def to_dict(self) -> dict[str, Any]:
        d = {"scheme": self.scheme, "group_size": self.group_size, "head": self.head,
             "tensors": dict(sorted(self.tensors.items())), "dequantized": dict(sorted(self.dequantized.items()))}
        if self.int4_layout is not None:  # omitted when None: other manifests read as before
            d["int4_layout"] = self.int4_layout
        if self.act is not None:  # likewise
            d["act"] = self.act
        return d

    @classmethod
    def from_dict(cls, d: Any) -> QuantSpec:
        required = {"scheme", "group_size", "head", "tensors", "dequantized"}
        ok = (isinstance(d, dict) and required <= set(d) <= required | {"int4_layout", "act"}
              and isinstance(d["head"], bool) and isinstance(d.get("int4_layout", ""), str)
              and isinstance(d.get("act", ""), str)
              and all(isinstance(d[k], dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in d[k].items())
                      for k in ("tensors", "dequantized")))
        if not ok:
            raise ArtifactError(f"manifest quant must be {{scheme, group_size, head, tensors, dequantized[, int4_layout, act]}}, "
                                f"found {str(d)[:80]}; the file is corrupt, re-export it")
        try:
            return cls(**d)
        except UsageError as e:
            raise ArtifactError(f"manifest quant is invalid ({e}); re-export the artifact") from e


def parse_quant(quant: Any, group_size: int | None = None, head: bool = True) -> QuantSpec | None:
    """None / "none" -> None; a scheme name -> its QuantSpec (no modules recorded yet); a QuantSpec as is."""
    if quant is None or quant == "none":
        return None
    if isinstance(quant, QuantSpec):
        return quant
    if quant in ("int4", "8da4w") and group_size is None:
        group_size = 32
    return QuantSpec(str(quant), group_size=group_size, head=head)
