"""Backend "aoti-packed": one AOTInductor program, T symbolic, serving prefill and decode, its weights
inside the library, frozen and prepacked for the CPU matmul kernels where that is faster (bf16/fp16: also
max-autotuned over Inductor's GEMM templates; see ``aoti.inductor_options``), and for a program over several
rows on Intel fp32 the same program compiled as for one row beside it (``ONE_ROW``). The artifact's
weights.safetensors is empty.

Only for decoders whose programs are exactly prefill and decode, agreeing on their inputs, key_pos and
slots (one signature serves both); checked at export and again at load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, TypeVar

from kvtrace._errors import ArtifactError, UsageError
from kvtrace.backends.aoti import AotiBackend
from kvtrace.backends.base import Program

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtrace.spec.manifest import Manifest
    from kvtrace.spec.program import ProgramSpec

__all__ = ["AOTI_PACKED", "MODEL", "ONE_ROW", "AotiPackedBackend", "ByRows"]

MODEL = "step"  # the one model of the package (its manifest signature's key too)
# Where a program over several cache rows compiles differently from a one-row one (fp32 on Intel: frozen with
# oneDNN-prepacked weights vs MKL over the embedded ones, ``aoti.inductor_options``), the package also holds
# MODEL compiled as for one row, and calls of at most ONE_ROW_MAX token rows (R x T) run on it: a slots
# artifact's decode step, SmolLM2 fp32, 2 threads: R=1 26.5 ms on MODEL vs 22.7 on the one-row library, R=8
# 35.3 vs 51.5 (stop 33). The price: the weights twice in memory (SmolLM2 fp32: 652 + 539 MB of libraries).
ONE_ROW = "step_one"
ONE_ROW_MAX = 2
T = TypeVar("T")


class AotiPackedBackend(AotiBackend):
    def program_specs(self, programs: tuple[ProgramSpec, ...], decoder: torch.nn.Module) -> tuple[ProgramSpec, ...]:
        return programs  # one program always (``compiled``); no ProgramSpec says so

    def compiled(self, programs: Mapping[str, T]) -> dict[str, T]:
        return {MODEL: programs["prefill"]}  # prefill's program, T symbolic, serves decode too

    def check_programs(self, names: Sequence[str], model: str) -> None:
        if sorted(names) != ["decode", "prefill"]:
            raise UsageError(f"backend {self.name} serves prefill and decode from one program; "
                             f"{model} declares programs {list(names)}. Use --backend aoti")

    def check_manifest(self, path: Path, manifest: Manifest) -> None:
        pre, dec = manifest.programs["prefill"], manifest.programs["decode"]
        if ((pre.inputs, pre.key_pos, pre.slots, pre.single_token, dec.single_token)
                != (dec.inputs, dec.key_pos, dec.slots, False, True)):
            raise ArtifactError(f"{path}: an {self.name} artifact serves a T-symbolic prefill and a one-token decode "
                                "with one program, but its manifest's program specs differ; re-export it")

    one_row_variants: ClassVar[Mapping[str, str]] = {ONE_ROW: MODEL}  # packaged where its options differ

    def serve(self, loaded: dict[str, Program], manifest: Manifest) -> dict[str, Program]:
        step = loaded[MODEL] if ONE_ROW not in loaded else ByRows(loaded[ONE_ROW], loaded[MODEL])
        return {p: step for p in manifest.programs}


class ByRows:
    """``one`` for calls of at most ONE_ROW_MAX token rows (tokens [R, T], R x T), ``many`` for the rest: one
    program compiled two ways, taking the same inputs (the same signature, probed alike at load)."""

    def __init__(self, one: Program, many: Program):
        self.one, self.many = one, many

    def __call__(self, *flat: torch.Tensor) -> torch.Tensor:
        tokens = flat[0]  # [R, T]
        return (self.one if tokens.numel() <= ONE_ROW_MAX else self.many)(*flat)

    def fresh(self) -> ByRows:
        return ByRows(self.one.fresh(), self.many.fresh())


AOTI_PACKED = AotiPackedBackend(
    "aoti-packed", "AOTInductor with frozen, prepacked weights and CPU GEMM templates (fastest decode, slowest "
    "compile); one program serves prefill and decode", native_code=True, packs_weights=True, one_program=True,
    no_compile_cache=True)
