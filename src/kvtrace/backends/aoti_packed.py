"""Backend "aoti-packed": one AOTInductor program, T symbolic, serving prefill and decode, its weights
inside the library, frozen and prepacked for the CPU matmul kernels where that is faster (bf16/fp16: also
max-autotuned over Inductor's GEMM templates; see ``aoti.inductor_options``), and for a program over several
rows on Intel fp32 the same program compiled as for one row beside it (``ONE_ROW``). The artifact's
weights.safetensors is empty.

A decoder whose weights are mostly in matmuls that Inductor's GEMM templates specialize for one row
(``one_row_template``: the int8 and int4 linears) gets a second program, ``DECODE``: its decode, captured with T = 1,
over its own copy of the frozen weights (``own_decode``). The manifest says which: decode ``served_by="prefill"``
when the step program serves it, no ``served_by`` and a signature of its own when not. (Manifests of kvtrace
<= 0.4.2 marked neither and signed only the step program: decode served by it.) A slots artifact of such a
decoder gets ``DECODE_ONE`` instead: its decode captured for one row (R = 1 static, T = 1), which runs every
call of one token in one row (the decode step of a single active slot, the one-token prefill of a prompt whose
rest a slot held); calls of more run on the step program.

Only for decoders whose programs are exactly prefill and decode, agreeing on their inputs, key_pos and
slots (one signature serves both); checked at export and again at load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeVar

from kvtrace._errors import ArtifactError, UsageError
from kvtrace.backends import one_row
from kvtrace.backends.aoti import AotiBackend
from kvtrace.backends.base import Program

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtrace.spec.manifest import Manifest
    from kvtrace.spec.program import ProgramSpec

__all__ = ["AOTI_PACKED", "DECODE", "DECODE_ONE", "MODEL", "ONE_ROW", "AotiPackedBackend", "ByRows",
           "one_row_decode", "own_decode"]

MODEL = "step"  # the package's T-symbolic model (its manifest signature's key too)
DECODE = "decode"  # the one-token decode model, where the decoder has its own (``own_decode``)
# Where a program over several cache rows compiles differently from a one-row one (fp32 on Intel: frozen with
# oneDNN-prepacked weights vs MKL over the embedded ones, ``aoti.inductor_options``), the package also holds
# MODEL compiled as for one row, and calls of at most ONE_ROW_MAX token rows (R x T) run on it: a slots
# artifact's decode step, SmolLM2 fp32, 2 threads: R=1 26.5 ms on MODEL vs 22.7 on the one-row library, R=8
# 35.3 vs 51.5 (stop 33). The price: the weights twice in memory (SmolLM2 fp32: 652 + 539 MB of libraries).
ONE_ROW = "step_one"
ONE_ROW_MAX = 2
# A slots decode captured for one row (``one_row_decode``): the step of a single active slot runs the one-row
# kernels of ``one_row_template`` modules, as a batch-1 artifact's own decode program does, instead of the GEMM
# template compiled for R symbolic rows.
DECODE_ONE = "decode_one"
T = TypeVar("T")


def own_decode(programs: Sequence[ProgramSpec], decoder: torch.nn.Module) -> bool:
    """Whether decode gets its own one-token program: more than half of ``decoder``'s weight bytes are in modules
    declaring ``one_row_template`` (``models.quant.Int8Linear``), and its programs are not slots programs (a
    slots decode steps R rows: unmeasured, served by the step program).

    The second program stores the frozen weights again (the two templates pack them differently), so it is worth
    it where one-row micro-kernels speed up most of a step. SmolLM2, 2 threads, alternated in one process (stop
    39): int8, decode 89.6-99.0 tokens/s as its own program vs 65.1-83.3 on the step's, prefill alike (the step
    program serves it either way), artifact 245 vs 148 MB. int4 / 8da4w once their linears are captured for the
    int4 template (``models.quant.template_ops``; stop 40): decode 104.0 vs 89.1 tokens/s, prefill 34.8 vs 89.6 ms
    (the template on the step program), artifact 222 vs 112 MB."""
    if any(p.slots for p in programs):
        return False
    return _mostly_one_row_templates(decoder)


def one_row_decode(programs: Sequence[ProgramSpec], decoder: torch.nn.Module) -> bool:
    """Whether a slots artifact gets ``DECODE_ONE``: its programs are slots programs and, as for ``own_decode``,
    more than half of ``decoder``'s weight bytes are in ``one_row_template`` modules. It stores the frozen weights
    once more, as ``own_decode``'s program does."""
    return any(p.slots for p in programs) and _mostly_one_row_templates(decoder)


def _mostly_one_row_templates(decoder: torch.nn.Module) -> bool:
    return one_row.weight_share(decoder, lambda m: getattr(m, "one_row_template", False)) > 0.5


class AotiPackedBackend(AotiBackend):
    def program_specs(self, programs: tuple[ProgramSpec, ...], decoder: torch.nn.Module) -> tuple[ProgramSpec, ...]:
        """As declared, decode ``served_by="prefill"`` unless it gets its own program (``own_decode``)."""
        if own_decode(programs, decoder):
            return programs
        return tuple(dataclasses.replace(p, served_by="prefill") if p.name == "decode" else p for p in programs)

    def capture(self, decoder: torch.nn.Module,
                programs: tuple[ProgramSpec, ...]) -> dict[str, torch.export.ExportedProgram]:
        """The standard capture, int4 linears calling the op Inductor's int4 template lowers (``template_ops``);
        and ``DECODE_ONE`` where ``one_row_decode``: the step program's spec at one token, for one row."""
        from kvtrace.capture.export import capture_programs
        from kvtrace.models.quant import template_ops

        with template_ops(decoder):
            eps = capture_programs(decoder, programs)
            if one_row_decode(programs, decoder):
                [step] = (p for p in programs if not p.single_token)
                one = dataclasses.replace(step, name=DECODE_ONE, single_token=True)
                eps |= capture_programs(decoder, (one,), one_row=True)
            return eps

    def compiled(self, programs: Mapping[str, T], signed: Collection[str] | None = None) -> dict[str, T]:
        """The step program (prefill's, T symbolic) and, where decode is served by no other, ``DECODE``. At load,
        an older manifest (decode unmarked, ``signed`` holding no DECODE) is the one-program layout it was."""
        out = {MODEL: programs["prefill"]}
        decode = programs["decode"]
        if getattr(decode, "served_by", None) is None and (signed is None or DECODE in signed):
            out[DECODE] = decode
        return out

    def check_programs(self, names: Sequence[str], model: str) -> None:
        if sorted(names) != ["decode", "prefill"]:
            raise UsageError(f"backend {self.name} serves prefill and decode from one program; "
                             f"{model} declares programs {list(names)}. Use --backend aoti")

    def check_manifest(self, path: Path, manifest: Manifest) -> None:
        pre, dec = manifest.programs["prefill"], manifest.programs["decode"]
        if ((pre.inputs, pre.key_pos, pre.slots, pre.single_token, pre.served_by, dec.single_token)
                != (dec.inputs, dec.key_pos, dec.slots, False, None, True)) or dec.served_by not in (None, "prefill"):
            raise ArtifactError(f"{path}: an {self.name} artifact serves a T-symbolic prefill and a one-token decode "
                                "agreeing on their inputs, but its manifest's program specs differ; re-export it")

    one_row_variants: ClassVar[Mapping[str, str]] = {ONE_ROW: MODEL}  # packaged where its options differ
    captured_variants: ClassVar[Mapping[str, str]] = {DECODE_ONE: MODEL}  # where ``one_row_decode``

    def serve(self, loaded: dict[str, Program], manifest: Manifest) -> dict[str, Program]:
        step = loaded[MODEL] if ONE_ROW not in loaded else ByRows(loaded[ONE_ROW], loaded[MODEL])
        if DECODE_ONE in loaded:  # one token of one row (a decode step, a one-token prefill) on the one-row program
            step = ByRows(loaded[DECODE_ONE], step, most=1)
        return {"prefill": step, "decode": loaded.get(DECODE, step)}


class ByRows:
    """``one`` for calls of at most ``most`` token rows (tokens [R, T], R x T; default ONE_ROW_MAX), ``many`` for the
    rest: one program compiled two ways (or captured for one row), taking the same inputs (the same signature,
    probed alike at load)."""

    def __init__(self, one: Program, many: Program, most: int = ONE_ROW_MAX):
        self.one, self.many, self.most = one, many, most

    def __call__(self, *flat: torch.Tensor) -> torch.Tensor:
        tokens = flat[0]  # [R, T]
        return (self.one if tokens.numel() <= self.most else self.many)(*flat)

    def fresh(self) -> ByRows:
        return ByRows(self.one.fresh(), self.many.fresh(), self.most)


AOTI_PACKED = AotiPackedBackend(
    "aoti-packed", "AOTInductor with frozen, prepacked weights and CPU GEMM templates (fastest decode, slowest "
    "compile); one program serves prefill and decode (int8 / int4 decoders: decode on its own)", native_code=True,
    packs_weights=True, one_program=True,
    no_compile_cache=True)
