"""The artifact: one file holding programs, weights (once), cache spec, manifest and tokenizer.

Layout (a zip archive; weights stored uncompressed, programs deflated: a serialized program is mostly
repetitive graph metadata and would otherwise outweigh a small model's weights; programs that embed the
weights (aoti-packed) stored, as inflating them would cost every load seconds: ``write.write_artifact``)::

    manifest.json            versioned Manifest (below), plain JSON: the root every other member is checked against
    weights.safetensors      every weight once, shared by all programs
    tokenizer.json           the `tokenizers` tokenizer (optional)
    programs/...             the backend's members (``Backend.members``), e.g. for the built-in ones:
    programs/prefill.json    backend "exported": torch.export program, serialized without weights
    programs/decode.json     (one file per program the manifest lists, e.g. also prefill_image.json)
    programs/aoti.pt2        backend "aoti": AOTInductor package with one model per compiled program (a
                             decode ``served_by`` prefill has none: prefill's model, T symbolic, runs it);
                             backend "aoti-packed": one model ("step", T symbolic) serving prefill and
                             decode (an int8 / int4 decoder's decode: a model of its own, "decode"), its weights
                             frozen and prepacked inside (weights.safetensors is empty)

Trust model. ``exported`` programs are data: a graph of torch operators (torch's verifier refuses any
other call target) over JSON and safetensors. ``aoti``/``aoti-packed`` programs are native code: loading
one dlopens a shared library from the file, so load only artifacts you built or whose SHA-256 you trust
(``load(path, expected_sha256=...)``, checked before anything is parsed). Either way nothing is unpickled:
the .pt2's members are checked against what kvtrace writes (no pickled weights, constants, custom objects
or exported programs, which torch's package loader would unpickle) and the one library is loaded directly.

What ``load`` checks before the first program call, each failure one ``ArtifactError`` (or ``UsageError``):
  * the device: the manifest's (``cpu`` or ``cuda``) against the one asked for and this machine's (a CUDA
    artifact without a GPU: one line, before any weight or library is read);
  * the zip directory: only the members the manifest lists (unknown ones refused), each of the declared
    size, under a ceiling and a compression-ratio bound, read through a bounded stream (no zip bomb);
  * the SHA-256 of every member (recorded at export) before the member is used (the stored weights member is
    read straight from the file, its local header checked as zipfile checks it, into one 64-byte aligned
    buffer whose views are the weights; a member the backend reads as a file, e.g. the AOTInductor package,
    is hashed as it is copied out to disk, chunk by chunk, and refused before anything opens it: see ``reader``);
  * the manifest's fields and types; the weights against the manifest's weight table (names, shapes,
    dtypes) and its aliases;
  * native code (aoti, aoti-packed): the CPU extensions its libraries may execute (``Manifest.cpu_features``,
    recorded at export: ``-march=native``) against this CPU's, so an artifact from a newer CPU is refused in one
    line instead of dying of SIGILL at its first call;
  * int4 weights: the CPU int4pack layout they were packed in (``QuantSpec.int4_layout``) against the one torch's
    int4 kernels read on this machine, which depends on the CPU capability torch dispatches;
  * every program against the CacheSpec and ProgramSpecs: exported graphs' placeholders (inputs, cache
    and weights) and logits; compiled libraries' constants (dtype and byte size, asked of the library
    itself) and one probe call with AOTInductor's runtime input checks on, which then stay on for every
    call (dtype, sizes and strides of every input), so an inconsistent artifact raises instead of
    reading or writing out of bounds.

Loading needs torch and kvtrace only: no transformers.

Modules: ``spec.manifest`` (the Manifest and its field checks), ``write`` (writing), ``reader`` (the
bounded reading and the checks before any program is built), the backends (``kvtrace.backends``: each
builds and checks its own programs); this one holds ``Artifact`` and ``load``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvtrace._errors import ArtifactError, UnsupportedError, UsageError
from kvtrace.artifact import hugepages, reader
from kvtrace.artifact.write import dedupe_weights, program_signature, write_artifact
from kvtrace.backends import registry
from kvtrace.runtime.chat import Conversation
from kvtrace.runtime.grammar import Constraint, Grammar
from kvtrace.runtime.graphs import Capturer
from kvtrace.runtime.session import ProgramSet, Session
from kvtrace.runtime.slots import SlotEngine, SlotSession
from kvtrace.spec.cache import CacheSpec
from kvtrace.spec.device import check_available, concrete
from kvtrace.spec.device import resolve as resolve_device
from kvtrace.spec.manifest import FORMAT, TOKENIZER, VERSION, WEIGHTS, Manifest, ModelInfo, clip

__all__ = ["FORMAT", "VERSION", "Artifact", "Manifest", "ModelInfo", "dedupe_weights", "load", "program_signature",
           "write_artifact"]


class Artifact:
    """A loaded artifact: manifest, weights, tokenizer and the two programs. Make sessions from it."""

    def __init__(self, path: Path, manifest: Manifest, programs: dict[str, Callable[..., torch.Tensor]],
                 tokenizer_json: str | None, keepalive: Any = None, device: torch.device | None = None,
                 huge_pages: bool = False):
        self.path = path
        self.manifest = manifest
        self._programs = programs
        self.tokenizer_json = tokenizer_json
        self._tokenizer: Any = None  # parsed on first use (``tokenizer``)
        self._keepalive = keepalive  # weights / temp dirs the programs reference
        self.device = device if device is not None else torch.device("cpu")  # where weights and programs run
        self.huge_pages = huge_pages  # program instances made later (``program_set``) collapsed into huge pages

    @property
    def cache_spec(self) -> CacheSpec:
        return self.manifest.cache_spec

    def session(self, device: str | torch.device | None = None, *, cuda_graphs: bool = False,
                capturer: Capturer | None = None) -> Session:
        """A new Session with its own cache, holding the declared initial values, on the artifact's device.

        ``device``: None (the device the artifact was loaded on, ``self.device``) or that same device; the
        programs and weights live there, so another is a UsageError (``kvtrace.load(path, device=...)``
        picks it). ``cuda_graphs``: decode replays CUDA graphs (``runtime.graphs``; CUDA artifacts only), or with
        ``capturer`` the same bookkeeping through it (``EagerCapturer``: no graphs, on any device)."""
        if self.manifest.programs["prefill"].slots:
            raise UsageError(
                f"{self.path} holds {self.cache_spec.batch_size} conversation slots (programs that address cache rows "
                "one by one, for serving): run it with artifact.slot_engine() or `kvtrace serve`, or export without "
                "--slots for a Session")
        want = resolve_device(device, default=str(self.device), what="session device")
        if want.type != self.device.type or want.index not in (None, self.device.index):
            raise UsageError(f"{self.path.name} was loaded on {self.device}, its weights and programs live there; "
                             f"a session on {device} needs kvtrace.load(path, device={str(device)!r})")
        return Session.of(self.program_set(), device=self.device, cuda_graphs=cuda_graphs, capturer=capturer)

    def program_set(self) -> ProgramSet:
        """This artifact's programs with what they declare: what a Session runs (``Session.swap`` takes it).
        Programs that hold their cache (``Backend.holds_state``) are a new instance each time, with its state."""
        m = self.manifest
        # (an in-memory "eager" artifact, artifact.tiered, runs its decoder's own programs: nothing to bind)
        with hugepages.collapsed(self.huge_pages and self.device.type == "cpu"):  # e.g. XNNPACK's packed weights
            programs, state = (registry.get(m.backend).bind(self._programs, m) if m.backend in registry.names()
                               else (self._programs, None))
        extra = {n: (spec, programs[n]) for n, spec in m.programs.items() if n not in ("prefill", "decode")}
        return ProgramSet(self.cache_spec, programs["prefill"], programs["decode"], extra=extra,
                          prefill_logits=m.programs["prefill"].logits, key_pos=m.programs["prefill"].key_pos,
                          vocab_size=m.vocab_size, identity=self.identity, label=m.backend, quant=m.quant,
                          state=state)

    def slot_engine(self, max_seq_len: int | None = None, prefill_chunk: int | None = None,
                    prefix_cache: bool = True) -> SlotEngine:
        """A SlotEngine over a new cache: one conversation per cache row of an artifact exported with ``slots``
        (a batch-1 artifact runs as one slot). ``max_seq_len``: per slot, at most the artifact's;
        ``prefill_chunk``: prompt tokens per prefill call (None: whole prompts); ``prefix_cache``: freed rows
        are kept for prompts that begin alike (False: reset when freed). See ``SlotEngine``."""
        self._check_slots_runnable()
        tok = self.tokenizer()
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        programs = {n: (self.manifest.programs[n], self._programs[n]) for n in ("prefill", "decode")}
        return SlotEngine(self.cache_spec, programs, vocab_size=self.manifest.vocab_size, max_seq_len=max_seq_len,
                          decode_text=decode, device=self.device, prefill_chunk=prefill_chunk,
                          prefix_cache=prefix_cache)

    def slot_session(self, slot: int | None = None) -> SlotSession:
        """One slot (default: the last) of a slots artifact driven like a Session, for step-by-step checks
        (``kvtrace verify --artifact``); serving uses ``slot_engine``."""
        self._check_slots_runnable()
        programs = {n: (self.manifest.programs[n], self._programs[n]) for n in ("prefill", "decode")}
        return SlotSession(self.cache_spec, programs, slot=slot, vocab_size=self.manifest.vocab_size,
                           device=self.device, quant=self.manifest.quant)

    def _check_slots_runnable(self) -> None:
        """Slot programs take the cache as inputs; programs that hold their own (an ExecuTorch .pte) cannot."""
        b = self.manifest.backend
        if b in registry.names() and registry.get(b).holds_state:
            raise UnsupportedError(f"{self.path.name}: {b} programs hold their own cache, so they cannot serve "
                                   "conversation slots; serve an aoti or exported artifact (or use art.session())")

    def grammar(self, constraint: Constraint, eos_ids: Sequence[int] | None = None) -> Grammar:
        """``constraint`` (structured output: ``kvtrace.Constraint``) compiled for this artifact's tokenizer, for
        ``generate``/``stream`` (``grammar=``) and ``SlotRequest``; ``eos_ids``: the stop ids the output may end
        with where the constraint allows (default: the manifest's). Needs llguidance (``kvtrace[grammar]``)."""
        if self.tokenizer_json is None:
            raise UsageError(f"{self.path} has no tokenizer, which structured output needs; export it from a model "
                             "source that has one")
        return Grammar(constraint, self.tokenizer_json, self.manifest.eos_ids if eos_ids is None else eos_ids)

    def conversation(self, system: str | None = None) -> Conversation:
        """A multi-turn chat over a new Session: each turn prefills only its new tokens (runtime/chat.py).
        Needs the artifact's tokenizer and chat template."""
        tok, m = self.tokenizer(), self.manifest
        if tok is None or m.chat_template is None:
            raise UsageError(f"{self.path} has no {'tokenizer' if tok is None else 'chat template'}, so it cannot "
                             "chat; export it from a model source that has one (or generate with --raw)")
        return Conversation(self.session(), tok, template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids,
                            system=system)

    @property
    def identity(self) -> str:
        """``artifact:<sha256 of the manifest>[:16]``: what a Session's snapshots are tied to (same file, same id)."""
        import hashlib

        return "artifact:" + hashlib.sha256(self.manifest.to_json().encode()).hexdigest()[:16]

    def tokenizer(self) -> Any:
        """The `tokenizers.Tokenizer` stored in the artifact (None if it has none), parsed once (~0.1 s for a
        49152-token vocabulary) and shared by every caller: treat it as read-only (no ``enable_padding`` etc.)."""
        if self.tokenizer_json is None:
            return None
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_str(self.tokenizer_json)
            except Exception as e:  # tokenizers raises its own exception type
                raise ArtifactError(f"{self.path}: tokenizer.json is not a readable tokenizer ({clip(str(e), 200)}); "
                                    "re-export the artifact") from e
        return self._tokenizer

    def __repr__(self) -> str:
        m = self.manifest
        on = "" if self.device.type == "cpu" else f", device={self.device}"
        return (f"Artifact({self.path.name}, {m.model_name or m.model_type}, backend={m.backend}{on}, "
                f"{m.cache_spec.describe()})")


def _check_cpu_features(path: Path, manifest: Manifest) -> None:
    """Native code compiled with ``-march=native`` may execute any extension of the exporting CPU; on a CPU without
    one its first call would die of an illegal instruction (SIGILL), with no message (``backends.cpu_isa``)."""
    from kvtrace.backends.cpu_isa import missing_features

    missing = missing_features(manifest.cpu_features)
    if missing:
        raise ArtifactError(
            f"{path}: its {manifest.backend} programs were compiled for a CPU with {', '.join(missing)}, which this "
            f"CPU lacks: their first call would die of an illegal instruction. Re-export it on this machine "
            "(cached artifacts are rebuilt by `kvtrace generate`), or build it for a baseline CPU "
            "(TORCHINDUCTOR_CPP_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 kvtrace export ...)")


def _check_int4_layout(path: Path, manifest: Manifest) -> None:
    """An int4 artifact's weights are packed in the layout of the CPU capability torch dispatched at export; torch's
    int4 matmul here reads its own (``models.quant.int4pack_layout``): another one would read scrambled weights."""
    recorded = manifest.quant.int4_layout if manifest.quant is not None else None
    if recorded is None:
        return
    from kvtrace.models.quant import int4pack_layout

    here = int4pack_layout()
    if here != recorded:
        raise ArtifactError(
            f"{path}: its int4 weights are packed in torch's CPU int4 layout {recorded!r}, but torch here dispatches "
            f"kernels that read layout {here!r} (CPU capability {torch.backends.cpu.get_cpu_capability()}): they "
            "would compute with scrambled weights. Re-export the artifact on this machine, or run it where torch "
            f"dispatches the {recorded!r} kernels (ATEN_CPU_CAPABILITY set alike)")


def load(path: str | os.PathLike[str], *, expected_sha256: str | None = None,
         device: str | torch.device | None = None, huge_pages: bool = False) -> Artifact:
    """Load an artifact written by ``kvtrace.export``. Imports neither transformers nor pickle.

    ``device``: where the weights go (once) and the programs run; None: the device type the programs were
    compiled for (``Manifest.device``; ``"cuda"`` is the current CUDA device), or ``"cuda:N"``. A device of
    another type, or a CUDA artifact on a machine without CUDA, is a one-line UsageError before anything is
    loaded.

    ``expected_sha256``: the SHA-256 (hex) of the whole file you trust; checked before anything in the
    file is parsed. Use it for every artifact of a native-code backend (``Backend.native_code``: aoti,
    aoti-packed) you did not build yourself: those contain native code, which loading runs. Every check ``load`` makes is listed in this module's
    docstring; each failure raises ``ArtifactError`` (``UsageError`` for a missing path or a directory).

    ``huge_pages``: hold the weights, and what each backend's runtime allocates for its programs, in
    transparent huge pages (Linux; best effort): faster decode of weights read once per token, slower load
    (``artifact.hugepages`` has the numbers).
    """
    path = Path(path)
    if expected_sha256 is not None and path.is_file():
        reader.check_file_hash(path, expected_sha256)
    owner = next((b for b in map(registry.get, registry.names()) if b.standalone and path.is_file()
                  and b.owns_file(path)), None)
    if owner is not None:  # a backend's own format (an ExecuTorch .pte): the manifest is inside it
        if device is not None and resolve_device(device, what="load device").type != "cpu":
            raise UsageError(f"{path} is a {owner.name} program; it runs on the CPU only, got device={str(device)!r}")
        # (huge pages: not for load_file's checking instance, dropped at once; each session's, in program_set)
        manifest, programs, tokenizer_json = owner.load_file(path)
        return Artifact(path, manifest, programs, tokenizer_json, huge_pages=huge_pages)
    # (weights going to a GPU are read into CPU memory only to be copied off: no huge pages for them)
    huge_weights = huge_pages and (device is None or resolve_device(device, what="load device").type == "cpu")
    manifest, blobs = reader.read_zip(path, huge_pages=huge_weights)
    dev = resolve_device(device, default=manifest.device, what="load device")
    if dev.type != manifest.device:
        raise UsageError(f"{path}: its programs were compiled for {manifest.device}, so they cannot run on {dev}; "
                         f"load it with device={manifest.device!r}, or re-export it with --device {dev.type}")
    check_available(dev, f"{path} (programs compiled for {manifest.device})")
    dev = concrete(dev)
    _check_cpu_features(path, manifest)
    _check_int4_layout(path, manifest)
    weights = reader.load_weights(path, blobs[WEIGHTS], manifest, dev)
    tokenizer_json = None
    if TOKENIZER in blobs:
        try:
            tokenizer_json = blobs[TOKENIZER].decode()
        except UnicodeDecodeError as e:
            raise ArtifactError(f"{path}: tokenizer.json is not UTF-8 text ({e}); re-export the artifact") from e
    reader.check_signatures(path, manifest)
    keepalive: list[Any] = [weights]
    try:
        with hugepages.collapsed(huge_pages and dev.type == "cpu"):  # what the backend's runtime allocates
            programs = registry.get(manifest.backend).load(path, manifest, blobs, weights, device=dev)
    except ArtifactError:
        raise
    except Exception as e:
        if manifest.torch_version != torch.__version__:
            hint = (f"The artifact was written by torch {manifest.torch_version[:40]}, this is torch "
                    f"{torch.__version__}; re-export it with this torch")
        else:
            hint = f"It was written by this torch ({torch.__version__}), so the file is corrupt; re-export it"
        raise ArtifactError(
            f"{path}: could not load the {manifest.backend} programs ({type(e).__name__}: {clip(str(e), 300)}). {hint}"
        ) from e
    return Artifact(path, manifest, programs, tokenizer_json, keepalive, device=dev, huge_pages=huge_pages)
