"""The Backend protocol: a name, what the backend's programs are like, and the two things it does.

A backend turns captured programs into the files an artifact holds (``compile``, at export) and those
files back into callables (``load``, with its own consistency checks, before the first call). Every
other module asks the registry (``kvtrace.backends.registry``) for a ``Backend`` by name and reads its
capabilities instead of comparing names.

Capabilities (fixed per backend; ``tests/backends`` holds each one against what the backend does):
  * ``native_code``: loading dlopens a compiled library from the file (trust it: ``expected_sha256``);
  * ``packs_weights``: the weights are frozen into the program, so the artifact stores none;
  * ``one_program``: one program (T symbolic) serves prefill and decode, but where the backend compiles decode on
    its own for a decoder and says so in its ProgramSpecs (aoti-packed: a decoder mostly of int8 / int4 linears,
    ``aoti_packed.own_decode``); ``compiled`` maps the decoder's ProgramSpecs to the programs actually captured,
    compiled and signed (a backend may also share per decoder, saying so in the ProgramSpecs it captures:
    ``aoti``'s and ``aoti-packed``'s decode ``served_by`` prefill);
  * ``no_compile_cache``: compiled with Inductor's compile caches off (see ``aoti.EXPORT_NO_CACHE``);
  * ``holds_state``: the programs hold the cache themselves, as mutable buffers initialized from the
    CacheSpec; ``bind`` gives each Session its own program instance and the state tensors (views of those
    buffers) the Session resets, snapshots and verify reads; programs are called without cache arguments;
  * ``standalone``: the backend writes its own file format (e.g. ExecuTorch's ``.pte``), not a kvtrace zip:
    ``export_file`` writes it, ``owns_file`` recognizes it and ``load_file`` reads it (manifest inside).

Modules here import torch inside functions only: the registry (and the CLI's ``--backend`` choices)
must not pull in torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtrace.spec.manifest import Manifest
    from kvtrace.spec.program import ProgramSpec

__all__ = ["Backend", "FileMember"]

T = TypeVar("T")
Program = Callable[..., Any]  # (tokens, input_pos, [key_pos], *inputs, *cache) -> logits [B, T, V]; maybe .fresh()


class FileMember(Protocol):
    """An artifact member the backend reads as a file (``Backend.file_members``), not handed over as bytes."""

    def spill(self, dest: Path, *, again: bool = False) -> Path:
        """Copy the member to the new file ``dest`` and return it once its SHA-256 is the manifest's (ArtifactError
        otherwise, ``dest`` removed); ``again``: a copy made after load (a mismatch: the file changed since)."""
        ...


@dataclass(frozen=True)
class Backend:
    """One way of storing programs in an artifact. Subclasses implement ``compile``, ``members`` and
    ``load``; the rest has defaults for a backend with one program per ProgramSpec."""

    name: str
    summary: str  # one line for help texts: what this backend's programs are
    native_code: bool = False
    packs_weights: bool = False
    one_program: bool = False
    no_compile_cache: bool = False
    holds_state: bool = False
    standalone: bool = False

    # --- export ------------------------------------------------------------------------------------
    def compiled(self, programs: Mapping[str, T], signed: Collection[str] | None = None) -> dict[str, T]:
        """ProgramSpec name -> X, as compiled program name -> X: what gets captured, compiled and signed
        (the manifest's ``signatures`` keys). Default: one compiled program per ProgramSpec. ``signed``: at load,
        the names the manifest records signatures of (None at export), for a backend whose artifacts of an older
        kvtrace said less in their ProgramSpecs (``aoti_packed``)."""
        return dict(programs)

    def quant_activations(self, scheme: str) -> str | None:
        """What this backend's programs compute quantized weights of ``scheme`` with (``QuantSpec.activations``:
        the ACTIVATIONS of ``spec.quant``, or a mode of the backend's own kernels), or None where it does not offer
        the scheme. Default: every scheme, computed as the spec defines it."""
        from kvtrace.spec.quant import ACTIVATIONS

        return ACTIVATIONS.get(scheme)

    def check_programs(self, names: Sequence[str], model: str) -> None:
        """Raise UsageError, before any capture, if this backend cannot serve a decoder declaring ``names``."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise UnsupportedError, before the model is loaded, where this backend's programs in ``dtype`` would be
        wrong or far slower than the user would expect (a kernel library without that dtype). Default: any."""

    def program_specs(self, programs: tuple[ProgramSpec, ...], decoder: torch.nn.Module) -> tuple[ProgramSpec, ...]:
        """The ProgramSpecs this backend captures (and the manifest lists) for a decoder declaring ``programs``.
        Default: as declared."""
        return programs

    def capture(self, decoder: torch.nn.Module,
                programs: tuple[ProgramSpec, ...]) -> dict[str, torch.export.ExportedProgram] | None:
        """ProgramSpec name -> captured program, for a backend that captures its own way; None (the default):
        the standard capture, ``capture.export.capture_programs`` (the cache as inputs updated in place)."""
        return None

    @property
    def compile_label(self) -> str:
        """What ``compile`` does, for progress output."""
        return f"compiling programs ({self.name})"

    def compile(self, eps: dict[str, torch.export.ExportedProgram], dtype: torch.dtype) -> dict[str, bytes]:
        """Captured programs (keyed as ``compiled`` keys them) -> artifact member name -> bytes."""
        raise NotImplementedError

    # --- load --------------------------------------------------------------------------------------
    def members(self, programs: Iterable[str]) -> set[str]:
        """The artifact members holding the programs of an artifact whose manifest lists ``programs``."""
        raise NotImplementedError

    def check_manifest(self, path: Path, manifest: Manifest) -> None:
        """Backend-specific consistency of a manifest, checked before any member is parsed."""

    def file_members(self, programs: Iterable[str]) -> set[str]:
        """Those of ``members`` that ``load`` gets as a ``FileMember`` to copy out itself, not as bytes: large
        members a backend opens as files anyway (never whole in memory). Default: none."""
        return set()

    def load(self, path: Path, manifest: Manifest, blobs: Mapping[str, Any],
             weights: dict[str, torch.Tensor], device: torch.device | None = None) -> dict[str, Program]:
        """ProgramSpec name -> callable, from ``blobs`` (member name -> bytes, hash-checked; a ``FileMember`` for
        ``file_members``, hash-checked as it is copied out) and ``weights`` (checked against the manifest's weight
        table, already on ``device``: where the programs run, of the type ``manifest.device`` names; None: CPU).
        Raises ArtifactError when a program disagrees with the manifest.

        A program may also have ``fresh()``: another instance of itself with its own runtime state over the
        same weights (``aoti.CompiledProgram``); CUDA-graph capture takes one per graph when it exists. It copies
        its ``FileMember`` out again (checked again), so no program keeps a member's bytes alive."""
        raise NotImplementedError

    def bind(self, programs: dict[str, Program],
             manifest: Manifest) -> tuple[dict[str, Program], list[torch.Tensor] | None]:
        """What one new Session runs: (ProgramSpec name -> callable, its state tensors or None). Default: the
        loaded programs, shared by every session, and None (the Session allocates its own cache from the
        CacheSpec and passes it to every call); ``holds_state`` backends: a fresh program instance per session
        and views of its buffers."""
        return programs, None

    # --- standalone file formats (``standalone``) ---------------------------------------------------------
    def owns_file(self, path: Path) -> bool:
        """Whether ``path`` is a file of this backend's own format (read a few bytes, import nothing heavy)."""
        return False

    def export_file(self, path: Path, manifest: Manifest, eps: dict[str, torch.export.ExportedProgram],
                    dtype: torch.dtype, tokenizer_json: str | None) -> Path:
        """Compile captured programs (keyed as ``compiled`` keys them) and write the file, manifest inside."""
        raise NotImplementedError

    def load_file(self, path: Path) -> tuple[Manifest, dict[str, Program], str | None]:
        """(manifest, ProgramSpec name -> program for ``bind``, tokenizer JSON or None) of an owned file."""
        raise NotImplementedError
