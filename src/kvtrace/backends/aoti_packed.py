"""Backend "aoti-packed": one AOTInductor program, T symbolic, serving prefill and decode, its weights
frozen into the library and prepacked for the CPU matmul kernels (bf16/fp16: also max-autotuned over
Inductor's GEMM templates; see ``aoti.inductor_options``). The artifact's weights.safetensors is empty.

Only for decoders whose programs are exactly prefill and decode, agreeing on their inputs, key_pos and
slots (one signature serves both); checked at export and again at load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kvtrace._errors import ArtifactError, UsageError
from kvtrace.backends.aoti import AotiBackend
from kvtrace.backends.base import Program

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtrace.spec.manifest import Manifest
    from kvtrace.spec.program import ProgramSpec

__all__ = ["AOTI_PACKED", "MODEL", "AotiPackedBackend"]

MODEL = "step"  # the one model of the package (its manifest signature's key too)
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

    def serve(self, loaded: dict[str, Program], manifest: Manifest) -> dict[str, Program]:
        return {p: loaded[MODEL] for p in manifest.programs}


AOTI_PACKED = AotiPackedBackend(
    "aoti-packed", "AOTInductor with frozen, prepacked weights and CPU GEMM templates (fastest decode, slowest "
    "compile); one program serves prefill and decode", native_code=True, packs_weights=True, one_program=True,
    no_compile_cache=True)
