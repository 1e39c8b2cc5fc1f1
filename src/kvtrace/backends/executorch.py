"""Backend "executorch": one ExecuTorch program (``.pte``) whose KV cache is initialized mutable state.

``kvtrace export SOURCE --backend executorch -o model.pte`` writes ``model.pte`` and, when the source has a
tokenizer and the output is named ``*.pte``, ``model.tokenizer.json`` next to it (the file ExecuTorch's runners take as ``tokenizer_path``;
the same tokenizer is also inside the .pte for kvtrace). Loading needs ``executorch`` and kvtrace only
(``pip install 'kvtrace[executorch]'``): no transformers, no torch.export deserialization.

The program, as ExecuTorch's LLM runner (``executorch.extension.llm.runner.TextLLMRunner``) expects it::

    forward(tokens [B, T] int64, input_pos [T] int64) -> logits [B, T or 1, V]   T symbolic in 1..max_seq_len
    prefill_image(tokens, input_pos, cross_attention_states, cross_attention_mask)   vision decoders only
    get_max_seq_len, get_max_context_len, get_vocab_size, get_bos_id, get_eos_ids, get_n_layers,
    use_kv_cache, use_sdpa_with_kv_cache, enable_dynamic_shape     constant metadata methods
    kvtrace_manifest, kvtrace_state, kvtrace_tokenizer              kvtrace's own records (JSON strings)

One method serves prefill and decode (``one_program``), as ExecuTorch's own exports do; kvtrace's Session
calls it for both. Positions are inputs; ``input_pos`` holds consecutive positions (the runner and the
Session pass ``start .. start+T-1``).

The cache. Every buffer of the CacheSpec is a mutable buffer of the program (``state_<i>``, in
``spec.buffers()`` order) holding its declared initial value: it is marked ``et_init_buffer`` by its name
from the CacheSpec — not by a name pattern — so the .pte serializes that value and the runtime starts
from it (unmarked, ExecuTorch treats a mutated buffer's initial contents as meaningless: the seed bug).
All methods share the buffers (ExecuTorch's ``share_mutable_buffers``) when there are several. Full
attention layers of decoders that route them through ``llama.cached_attention`` (``fused_attention``) are
served by ExecuTorch's own kernels (``models/fused.py``): ``llama::update_cache`` writes the call's K/V at
``input_pos[0]`` and ``llama::custom_sdpa`` attends over the live prefix only, both on a sequence-major
buffer ``[B, S, H_kv, D]``; every other buffer keeps the declared layout ``[B, H_kv, S, D]``. Linear
layers and the rest run in XNNPACK.

A Session gets its own program instance (``bind``: ExecuTorch allocates each loaded program's buffers)
and, as its state, views of that instance's buffers in the declared layout (``Method.get_attribute`` hands
them out without a copy): reset, rewind, snapshot, restore and verify read and write the program's own
cache, nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvtrace._errors import ArtifactError, CaptureError, UnsupportedError, UsageError
from kvtrace.backends import tempcopy
from kvtrace.backends.base import Backend, Program
from kvtrace.backends.executorch_graph import delegable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtrace.spec.cache import CacheSpec
    from kvtrace.spec.manifest import Manifest
    from kvtrace.spec.program import ProgramSpec

__all__ = ["EXECUTORCH", "EXTRA", "FORWARD", "ExecuTorchBackend", "is_pte", "metadata", "require"]

T = TypeVar("T")
EXTRA = "executorch"  # the pyproject extra that installs it
FORWARD = "forward"  # the method serving prefill and decode (ExecuTorch's runners call "forward")
MANIFEST_METHOD, STATE_METHOD, TOKENIZER_METHOD = "kvtrace_manifest", "kvtrace_state", "kvtrace_tokenizer"
TEMP_PREFIX = "kvtrace-pte-"  # + "<pid>-<random>": one load's private copy of the .pte (tempcopy.new_dir)
_MAGIC_OFFSET, _MAGIC = 4, b"ET12"  # the flatbuffer file identifier of an ExecuTorch program
SEQ_MAJOR = [0, 2, 1, 3]  # [B, S, H_kv, D] <-> [B, H_kv, S, D]


def is_pte(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an ExecuTorch program file (its file identifier; nothing imported)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_MAGIC_OFFSET + len(_MAGIC))
    except OSError:
        return False
    return head[_MAGIC_OFFSET:] == _MAGIC


def require(compiler: bool = True) -> None:
    """Import ExecuTorch, or raise UsageError naming the extra to install. ``compiler``: its exporter and the
    LLM custom ops' export-time registrations (``torch.ops.llama.*``); without it, only what running a .pte
    needs (``et_runtime``: seconds less to import)."""
    from kvtrace.backends import et_runtime  # torch: imported when a backend is used, not with kvtrace

    try:
        import executorch  # noqa: F401  (first: a submodule imported before would be found without its package)

        if compiler:
            from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
        et_runtime.runtime()
    except (ImportError, OSError) as e:  # OSError: the kernels' shared library does not load (ABI, dependency)
        raise UsageError(f"the executorch backend needs ExecuTorch ({e}); install it with "
                         f"pip install 'kvtrace[{EXTRA}]' (executorch 1.5.x, with torch 2.13)") from e


def metadata(manifest: Manifest, fused: bool) -> dict[str, Any]:
    """The constant methods ExecuTorch's LLM runners read (names as ``extension/llm/runner/constants.h`` and
    ``export_llm`` spell them)."""
    spec = manifest.cache_spec
    out: dict[str, Any] = {
        "get_max_seq_len": spec.max_seq_len,
        "get_max_context_len": spec.max_seq_len,
        "get_vocab_size": manifest.vocab_size,
        "get_n_layers": len(spec.layers),
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": fused,
        "enable_dynamic_shape": not manifest.programs["prefill"].single_token,
        "get_n_bos": 0,  # kvtrace's prompts (chat template or tokenizer) carry their own BOS
        "get_n_eos": 0,
    }
    if manifest.bos_id is not None:
        out["get_bos_id"] = int(manifest.bos_id)
    if manifest.eos_ids:
        out["get_eos_ids"] = [int(i) for i in manifest.eos_ids]
    return out


# --- capture: the decoder's method over its cache held as initialized buffers ---------------------------
def _stateful_module(method: torch.nn.Module, spec: CacheSpec, seq_major: tuple[bool, ...]) -> torch.nn.Module:
    """The module one program is captured from (its class is made here: this module imports no torch)."""
    import torch

    from kvtrace.models import fused

    class Stateful(torch.nn.Module):
        """``forward(tokens [B, T], input_pos [T], *inputs)``: ``method`` over the buffers ``state_<i>``."""

        def __init__(self) -> None:
            super().__init__()
            self.method = method  # the decoder (or its alias for one program): its weights, shared by name
            for i, (b, sm) in enumerate(zip(spec.buffers(), seq_major, strict=True)):
                t = b.allocate()  # the declared initial value
                self.register_buffer(f"state_{i}", t.permute(SEQ_MAJOR).contiguous() if sm else t)

        def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
            bufs = [getattr(self, f"state_{i}") for i in range(len(seq_major))]
            views = [b.permute(SEQ_MAJOR) if sm else b for b, sm in zip(bufs, seq_major, strict=True)]  # declared
            if not any(seq_major):
                return self.method(tokens, input_pos, *inputs, *views)
            # ExecuTorch's kernels take the call's first position as a size (its runners' convention);
            # positions stay an input: nothing about them is baked into the program.
            start = input_pos[0].item()
            torch._check_is_size(start)
            torch._check(start + tokens.shape[1] <= spec.max_seq_len)
            physical = {id(v): b for v, b, sm in zip(views, bufs, seq_major, strict=True) if sm}
            with fused.substituted(lambda *a: _custom_attention(start, physical, *a)):
                return self.method(tokens, input_pos, *inputs, *views)

    return Stateful()


def _custom_attention(start: Any, physical: dict[int, torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      scale: float | None) -> torch.Tensor | None:
    """ExecuTorch's fused cache write + SDPA over the live prefix, on the sequence-major buffers behind
    ``k_cache``/``v_cache`` (None for any other cache). q [B, H, T, D], k/v [B, H_kv, T, D] -> [B, H, T, D]."""
    import torch

    kc, vc = physical.get(id(k_cache)), physical.get(id(v_cache))  # [B, S, H_kv, D]
    if kc is None or vc is None:
        return None
    torch.ops.llama.update_cache(k.transpose(1, 2), kc, start)  # slots start .. start+T-1
    torch.ops.llama.update_cache(v.transpose(1, 2), vc, start)
    o = torch.ops.llama.custom_sdpa(q.transpose(1, 2), kc, vc, start, None, 0.0, True, scale)  # [B, T, H, D]
    return o.transpose(1, 2)


def _seq_major(decoder: torch.nn.Module, spec: CacheSpec) -> tuple[bool, ...]:
    """Per buffer: held sequence-major for ExecuTorch's kernels (full layers' K/V of a ``fused_attention``
    decoder in the cache's own dtype), or in the declared layout."""
    from kvtrace.spec.cache import LayerKind

    out = [False] * len(spec.buffers())
    if getattr(type(decoder), "fused_attention", False) and spec.kv_dtype is None and spec.max_seq_len > 1:
        for i, layer in enumerate(spec.layers):
            if layer.kind is LayerKind.FULL:
                out[2 * i] = out[2 * i + 1] = True
    return tuple(out)


# --- the backend ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExecuTorchBackend(Backend):
    # False only to plant the seed's fault in tests: the buffers' declared initial values are not serialized
    initialize_state: bool = True

    @property
    def compile_label(self) -> str:
        return f"lowering to ExecuTorch with XNNPACK ({self.name})"

    def compiled(self, programs: Mapping[str, T], signed: Collection[str] | None = None) -> dict[str, T]:
        # prefill's program (T symbolic) is "forward" and serves decode too; others (prefill_image) by name
        return {FORWARD: programs["prefill"], **{n: p for n, p in programs.items() if n not in ("prefill", "decode")}}

    def quant_activations(self, scheme: str) -> str | None:
        # 8da4w as ExecuTorch's own exports compute it: XNNPACK's dynamically quantized GEMMs (each activation row
        # int8 with a zero point, int4 weights; the int8 head per row). XNNPACK has no weight-only int8 / int4 GEMM
        # and the portable kernels no GGUF blocks
        return "int8-asym" if scheme == "8da4w" else None

    def check_dtype(self, dtype: torch.dtype) -> None:
        import torch

        if dtype == torch.bfloat16:
            # a bf16 .pte exports and verifies, but every matmul falls out of XNNPACK into ExecuTorch's portable
            # kernels (SmolLM2, stop 43: 3.3 tokens/s against 33 for the float32 .pte in the same hour)
            raise UnsupportedError("backend 'executorch' has no fast bfloat16 path: XNNPACK (ExecuTorch 1.5) delegates "
                                   "no bf16 matmul, so each would run in ExecuTorch's portable kernels, ~10x slower "
                                   "than float32; export with dtype float32, or --quant 8da4w for fewer bytes")

    def program_specs(self, programs: tuple[ProgramSpec, ...], decoder: torch.nn.Module) -> tuple[ProgramSpec, ...]:
        """Without ``key_pos``: ExecuTorch's runners pass tokens and positions only, and the fused kernels
        attend to the live prefix from the first position; ``forward_live`` programs become ``forward``."""
        require()
        return tuple(dataclasses.replace(p, key_pos=False, method="forward" if p.method == "forward_live" else p.method)
                     for p in programs)

    def capture(self, decoder: torch.nn.Module,
                programs: tuple[ProgramSpec, ...]) -> dict[str, torch.export.ExportedProgram]:
        import torch
        from torch.export import Dim

        from kvtrace.capture.export import _dynamic_shapes, _example_input, method_module
        from kvtrace.capture.preserve import preserved

        spec = decoder.cache_spec
        seq_major = _seq_major(decoder, spec)
        eps = {}
        for p in programs:
            t = 1 if p.single_token or spec.max_seq_len < 2 else min(3, spec.max_seq_len)
            args = (torch.zeros(spec.batch_size, t, dtype=torch.int64), torch.arange(t),
                    *(_example_input(i, spec.batch_size, t, torch.device("cpu")) for i in p.inputs))
            module = _stateful_module(method_module(decoder, p), spec, seq_major)
            shapes = (_dynamic_shapes(module, args, p, Dim("T", min=1, max=spec.max_seq_len), None)
                      if t > 1 else None)
            with torch.no_grad(), preserved(decoder, what=f"the model ({type(decoder).__name__})"):
                eps[p.name] = torch.export.export(module, args, dynamic_shapes=shapes, strict=False)
        return eps

    def members(self, programs: Iterable[str]) -> set[str]:
        return set()  # never inside a kvtrace zip: the .pte is the file

    # --- export -----------------------------------------------------------------------------------------
    def export_file(self, path: Path, manifest: Manifest, eps: dict[str, torch.export.ExportedProgram],
                    dtype: torch.dtype, tokenizer_json: str | None) -> Path:
        require()
        from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
        from executorch.exir.passes import MemoryPlanningPass

        from kvtrace.spec.cache import LayerKind

        spec = manifest.cache_spec
        state = [{"name": b.name, "fqn": f"state_{i}", "seq_major": _is_seq_major(ep_shape(eps, i), b.shape)}
                 for i, b in enumerate(spec.buffers())]
        fused = any(s["seq_major"] for s in state)
        consts = {**metadata(manifest, fused), MANIFEST_METHOD: manifest.to_json(), STATE_METHOD: json.dumps(state)}
        if tokenizer_json is not None:
            consts[TOKENIZER_METHOD] = tokenizer_json
        rings = any(layer.kind is LayerKind.SLIDING for layer in spec.layers)
        eps = {name: delegable(ep, rotate_half=not rings) for name, ep in eps.items()}  # kept whole in XNNPACK
        with _lean_xnnpack_passes():
            edge = to_edge_transform_and_lower(
                eps, partitioner=[_partitioner()], constant_methods=consts,
                # as ExecuTorch's LLM exports: no dim-order ops, no IR re-verification after every pass
                compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True))
        fqns = {s["fqn"] for s in state}
        # Every buffer, all-zero K/V included, is marked initialized and its declared value serialized: a runtime is
        # free to hand a program unzeroed planned memory (the seed report's on-device failure), so the file carries
        # the state the CacheSpec declares rather than relying on an allocator's zeros.
        for name in eps:
            ep = edge.exported_program(name)
            to_buffer = ep.graph_signature.inputs_to_buffers
            marked = set()
            for node in ep.graph.nodes:  # the CacheSpec's buffers, by the name each was registered under
                if node.op == "placeholder" and to_buffer.get(node.target) in fqns:
                    node.meta["et_init_buffer"] = self.initialize_state
                    marked.add(to_buffer[node.target])
            if marked != fqns:
                raise CaptureError(f"ExecuTorch program {name} lacks cache buffers {sorted(fqns - marked)} of the "
                                   "CacheSpec; every program must take the whole cache")
            stray = set(ep.graph_signature.buffers_to_mutate.values()) - fqns
            if stray:  # ExecuTorch would serialize no initial value for it: the seed bug, for a buffer not declared
                raise CaptureError(f"ExecuTorch program {name} writes buffers {sorted(stray)} that the CacheSpec does "
                                   "not declare, so their initial values would be lost; a decoder's mutable state "
                                   "must be its cache")
        config = ExecutorchBackendConfig(
            emit_mutable_buffer_names=True,  # Method.get_attribute(name): the Session's views of its cache
            run_reinplace_pass=True,  # a functional index_put on a buffer written in place, not copied
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=len(eps) > 1),
        )
        with warnings.catch_warnings():
            # ExecuTorch warns, for any mutated buffer, that it assumes "a meaningless initial state ... unless a pass
            # which sets meta["et_init_buffer"]" ran: here every one is a CacheSpec buffer marked above (checked)
            warnings.filterwarnings("ignore", message="Mutation on a buffer in the model is detected",
                                    category=UserWarning)
            program = edge.to_executorch(config)
        pieces = _share_duplicate_segments(_with_shared_initial_values(program, config))
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, *pieces)
        if tokenizer_json is not None and path.suffix == ".pte":  # for ExecuTorch's runners; any other name
            _write_atomic(tokenizer_path(path), tokenizer_json.encode())  # (kvtrace's caches) carries it inside only
        return path

    # --- load -------------------------------------------------------------------------------------------
    def owns_file(self, path: Path) -> bool:
        return is_pte(path)

    def load_file(self, path: Path) -> tuple[Manifest, dict[str, Program], str | None]:
        require(compiler=False)
        tempcopy.remove_stale_dirs(TEMP_PREFIX)
        pte = _Pte(path)
        manifest, tokenizer_json = pte.read_records()
        if manifest.backend not in _registered_names():
            raise ArtifactError(f"{path}: written by kvtrace's {manifest.backend!r} backend, which is not registered "
                                "here; re-export it with --backend executorch")
        pte.check(manifest)
        pte.done_checking()
        return manifest, {p: pte for p in manifest.programs}, tokenizer_json

    def bind(self, programs: dict[str, Program],
             manifest: Manifest) -> tuple[dict[str, Program], list[torch.Tensor] | None]:
        pte = next(iter(programs.values()))
        assert isinstance(pte, _Pte), "executorch programs come from load_file"
        return pte.instance(manifest)


# XNNPACK's delegate runs every pass below on every partition (tens of partitions per model, each pass a
# re-trace); these rewrite patterns a decoder never has (convolutions, batch norm, bilinear upsampling,
# PReLU, quantized padding, an SDPA written out) and building their pattern graphs alone costs seconds.
_UNNEEDED_XNNPACK_PASSES = {"ConvertToUpsampleBilinear2d", "ConvertToSDPAPass", "FuseBatchNormPass",
                            "DecomposeBatchNorm", "InsertPadQDQPass", "Conv1dUnsqueezePass", "PReLUReshapePass"}


def _partitioner() -> Any:
    """XNNPACK's partitioner, naming the ops it keeps whole (linear, ...) already checked against this program.

    XNNPACK's own answer comes with a per-node check, which makes ExecuTorch decompose the program three times
    (functionalize, decompose around marked nodes, decompose the rest): each a re-trace of every node, a
    third of the lowering. Here an op is kept whole if every node of it passes that check (else decomposed
    everywhere), so ExecuTorch takes its path without the check: functionalize, then decompose once."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class Checked(XnnpackPartitioner):
        def ops_to_not_decompose(self, ep: Any) -> tuple[list[Any], None]:
            ops, check = super().ops_to_not_decompose(ep)
            if check is None:
                return ops, None
            nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
            return [op for op in ops if all(check(n) for n in nodes if n.target == op)], None

    return Checked()


def _pass_triggers() -> dict[str, Callable[[Any], bool]]:
    """XNNPACK passes that rewrite only nodes of certain kinds -> whether a node is of them: a pass runs on a
    partition only if one of its nodes is (otherwise it is a re-trace that changes nothing)."""
    from executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass import (
        ChannelsLastTaggedReshapePass,
    )
    from executorch.backends.xnnpack._passes.fuse_activation_pass import FuseActivationPass

    def name(node: Any) -> str:
        return getattr(node.target, "__name__", str(node.target))

    nhwc = set(ChannelsLastTaggedReshapePass.memory_sensitive_ops_nhwc)  # wrapped in layout conversions
    return {
        "ChannelsLastTaggedReshapePass": lambda n: n.target in nhwc,
        "RemoveRedundantCopyPass": lambda n: n.target in nhwc or "_to_copy" in name(n),  # its conversions' pairs
        "FuseActivationPass": lambda n: n.target in FuseActivationPass.FUSEABLE_ACTIVATIONS,
        "RemoveGetItemPass": lambda n: name(n) in ("aten.max_pool2d_with_indices.default", "aten.max.dim"),
        "DecomposeConcatenate": lambda n: name(n) == "aten.cat.default" and len(n.args[0]) > 5,
        "PropagateCustomMetaPass": lambda n: "quantize" in name(n),
        "DimOrderOpsRevertPass": lambda n: "dim_order" in name(n),
    }


@contextmanager
def _lean_xnnpack_passes() -> Iterator[None]:
    """XNNPACK's default pass list for one lowering, without ``_UNNEEDED_XNNPACK_PASSES`` and, per partition,
    without the passes of ``_pass_triggers`` none of whose nodes it has."""
    from executorch.backends.xnnpack import _passes

    manager = getattr(_passes, "XNNPACKPassManager", None)
    init = getattr(manager, "__init__", None)
    if init is None:  # another ExecuTorch layout: lower with its defaults
        yield
        return
    triggers = _pass_triggers()

    def lean(self: Any, exported_program: Any, passes: Any = None) -> None:
        init(self, exported_program, passes)
        if not passes:
            nodes = [n for n in exported_program.graph.nodes if n.op == "call_function"]
            self.passes = [p for p in self.passes if p.__name__ not in _UNNEEDED_XNNPACK_PASSES and (
                p.__name__ not in triggers or any(map(triggers[p.__name__], nodes)))]

    manager.__init__ = lean
    try:
        yield
    finally:
        manager.__init__ = init


# --- one copy of each declared initial value ----------------------------------------------------------------
def _with_shared_initial_values(manager: Any, config: Any) -> bytes:
    """The .pte of ``manager`` with each distinct initial value of a mutable buffer stored once.

    ExecuTorch shares equal constants but not the initial values of *named* mutable buffers (the emitter looks
    them up in the constants' table: ``emit_mutable_buffer_names``, which the Session needs), so a K/V cache of
    L layers carried 2L copies of the same zeros: 45 MiB of SmolLM2's 560 at 1024 positions. Every buffer keeps
    its own planned memory (``allocation_info``); what is shared is only the index of the bytes the runtime
    copies into it when a program is loaded (``data_buffer_idx`` into the mutable data segment), so each
    buffer still starts from its declared value, and buffers that declare different values keep their own.
    The file is serialized again from the emitted program with the duplicates dropped."""
    import hashlib

    from executorch.exir._serialize._serialize import serialize_for_executorch
    from executorch.exir.schema import Tensor

    out = manager._emitter_output
    data = out.mutable_data
    if not data or len(data) <= 2:  # index 0 is reserved (empty): nothing repeats in one value
        return manager.buffer
    kept, first, remap = [data[0]], {}, {0: 0}
    for i, buf in enumerate(data[1:], 1):
        key = hashlib.sha256(buf.storage).digest()
        if key not in first:
            first[key] = len(kept)
            kept.append(buf)
        remap[i] = first[key]
    if len(kept) == len(data):
        return manager.buffer
    for plan in out.program.execution_plan:
        for value in plan.values:
            t = value.val
            if isinstance(t, Tensor) and t.allocation_info is not None and t.data_buffer_idx:  # mutable, initialized
                t.data_buffer_idx = remap[t.data_buffer_idx]
    out.mutable_data = kept
    pte, _ = serialize_for_executorch(out, config, manager._data_serializer, manager._named_data)
    return bytes(pte)


# --- one copy of a tensor both a kernel and XNNPACK read ------------------------------------------------------
_PAGE = 4096  # segments after a dropped one move by whole pages: every segment keeps its alignment


def _share_duplicate_segments(blob: bytes) -> list[bytes | bytearray | memoryview]:
    """``blob`` with every XNNPACK weight segment that repeats a program constant pointed at that constant, as the
    pieces of the file to write in order (``[blob]`` itself when nothing repeats).

    A tied embedding is read twice: by the embedding lookup (a portable kernel: a constant of the program, in its
    constant segment) and by the vocabulary projection (XNNPACK: named data, its own segment). ExecuTorch
    stores both; here the named data's segment entry is pointed at the constant's bytes inside the constant
    segment and the duplicate bytes are dropped (the runtime reads a segment by offset and size, never its
    neighbours). The program's flatbuffer is patched in place (same size); the file otherwise stays as written.
    """
    import struct

    from executorch.exir._serialize._program import _ExtendedHeader, _get_extended_header

    eh = _get_extended_header(blob[:64])  # (it slices what it is given: not the whole file)
    if eh is None or eh.segment_data_size == 0:
        return [blob]
    program = _flatbuffer_program(blob)
    base, data = eh.segment_base_offset, memoryview(blob)
    segs = [program.Segments(i) for i in range(program.SegmentsLength())]
    spans = [(s.Offset(), s.Size()) for s in segs]
    cs = program.ConstantSegment()
    if cs is None or cs.OffsetsLength() == 0:
        return [blob]
    c_start, c_size = spans[cs.SegmentIndex()]
    starts = sorted({cs.Offsets(i) for i in range(cs.OffsetsLength())})
    chunks = {a: b - a for a, b in zip(starts, [*starts[1:], c_size], strict=True) if b > a}  # with padding
    named = {program.NamedData(i).SegmentIndex() for i in range(program.NamedDataLength())}
    other = {cs.SegmentIndex(), *_other_segments(program)}
    moved: dict[int, int] = {}  # segment index -> offset of the same bytes within the constant segment
    for j in sorted(named - other):
        off, size = spans[j]
        payload = blob[base + off: base + off + size]
        for a, padded in chunks.items():
            if size <= padded < size + _PAGE and blob[base + c_start + a: base + c_start + a + size] == payload:
                moved[j] = a
                break
    if not moved:
        return [blob]
    # Lay out the remaining segments: each moves back by the whole pages dropped before it.
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    dropped, shift, new_off = 0, {}, {}
    for i in order:
        off, size = spans[i]
        if i in moved:
            nxt = min((spans[k][0] for k in order if spans[k][0] > off), default=off + size)
            dropped += nxt - off
            continue
        shift[i] = dropped - dropped % _PAGE
        new_off[i] = off - shift[i]
    new_off.update({j: new_off[cs.SegmentIndex()] + a for j, a in moved.items()})  # where the constant now is
    end = max(new_off[i] + spans[i][1] for i in range(len(spans)) if i not in moved)
    head = bytearray(data[:base])  # the program (patched below); the segments are written from ``blob`` itself
    for i, seg in enumerate(segs):
        if new_off[i] == spans[i][0]:
            continue
        field = seg._tab.Offset(4)  # the uint64 "offset" of table DataSegment (absent when it was 0)
        if field == 0:
            return [blob]
        struct.pack_into("<Q", head, seg._tab.Pos + field, new_off[i])
    header = _ExtendedHeader(program_size=eh.program_size, segment_base_offset=base, segment_data_size=end).to_bytes()
    head[8: 8 + len(header)] = header
    # Pieces, not one new buffer: filling a fresh 540 MB bytearray cost 8.6 s of SmolLM2's export (first-touch
    # page faults on this VM), writing the same pieces to the file a fraction of that.
    pieces: list[bytes | bytearray | memoryview] = [head]
    at = 0
    for i in sorted(shift, key=lambda i: new_off[i]):
        off, size = spans[i]
        if new_off[i] > at:
            pieces.append(bytes(new_off[i] - at))  # the padding between segments, zeros as ExecuTorch writes it
        pieces.append(data[base + off: base + off + size])
        at = new_off[i] + size
    return pieces


def _flatbuffer_program(blob: bytes) -> Any:
    """ExecuTorch's generated flatbuffer reader over a .pte's program (its table classes wired up: the
    generated modules import each other's modules where they mean the classes)."""
    import importlib

    pkg = "executorch.exir._serialize.generated.executorch_flatbuffer."
    mods = {n: importlib.import_module(pkg + n) for n in (
        "Program", "DataSegment", "NamedData", "SubsegmentOffsets", "ExecutionPlan", "BackendDelegate",
        "BackendDelegateDataReference")}
    for mod in mods.values():
        for n, m in mods.items():
            if getattr(mod, n, None) is m:
                setattr(mod, n, getattr(m, n))
    return mods["Program"].Program.GetRootAs(blob, 0)


def _other_segments(program: Any) -> set[int]:
    """Segments read as something other than named data: delegate blobs and mutable initial values."""
    out = set()
    for i in range(program.MutableDataSegmentsLength()):
        out.add(program.MutableDataSegments(i).SegmentIndex())
    for e in range(program.ExecutionPlanLength()):
        plan = program.ExecutionPlan(e)
        for d in range(plan.DelegatesLength()):
            ref = plan.Delegates(d).Processed()
            if ref is not None and ref.Location() == 1:  # DataLocation.SEGMENT
                out.add(ref.Index())
    return out


def _registered_names() -> tuple[str, ...]:
    from kvtrace.backends import registry

    return registry.names()


def ep_shape(eps: dict[str, torch.export.ExportedProgram], i: int) -> tuple[int, ...]:
    """The shape of buffer ``state_<i>`` as the programs hold it."""
    ep = next(iter(eps.values()))
    return tuple(ep.state_dict[f"state_{i}"].shape)


def _is_seq_major(held: tuple[int, ...], declared: tuple[int, ...]) -> bool:
    if held == declared:
        return False
    if len(declared) == 4 and held == tuple(declared[d] for d in SEQ_MAJOR):
        return True
    raise CaptureError(f"a cache buffer is held as {list(held)}, declared {list(declared)}")


def tokenizer_path(pte: str | os.PathLike[str]) -> Path:
    """The tokenizer written next to a .pte: ``model.pte`` -> ``model.tokenizer.json``."""
    p = Path(pte)
    return p.with_name(f"{p.stem}.tokenizer.json")


def _write_atomic(path: Path, *pieces: bytes | bytearray | memoryview) -> None:
    """``pieces``, one after the other, as the file ``path`` (written whole or not at all)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _Pte:
    """A loaded .pte. It is copied at load to a private temp dir (``tempcopy``) and every program instance is loaded
    from that copy: ExecuTorch maps the file (its constants shared, not copied; the rest read when XNNPACK packs
    the weights), so no copy of it stays in this process's memory, and what the user does to their file
    afterwards (re-export it in place, truncate it) changes nothing that was checked at load or that runs. The
    copy goes when the last instance does (each runner holds this object), or with the process (the next load
    removes the dirs of dead ones). ``instance`` loads one program per Session (its own buffers)."""

    def __init__(self, path: Path):
        from kvtrace.backends import et_runtime

        self.path = path
        tmp = tempcopy.new_dir(TEMP_PREFIX)
        self._remove = weakref.finalize(self, shutil.rmtree, tmp, True)
        try:
            self.copy = tmp / "program.pte"
            with path.open("rb") as src:
                size = os.fstat(src.fileno()).st_size
                if tempcopy.copy_range(src, 0, size, self.copy, sync=False) != size:
                    raise ArtifactError(f"{path} shrank while it was being loaded; load it again once it is written")
            try:
                self.program = et_runtime.load_program(self.copy)  # the first instance: records and checks
                self.method_names = et_runtime.method_names(self.program)
            except Exception as e:
                raise ArtifactError(f"{path} is not a loadable ExecuTorch program ({type(e).__name__}: {e}); "
                                    "re-export it") from e
        except BaseException:
            self._remove()
            raise
        self.state: list[dict[str, Any]] = []

    def _const(self, name: str) -> Any:
        if name not in self.method_names:
            return None
        (value,) = self.program.load_method(name)([])
        return value

    def read_records(self) -> tuple[Manifest, str | None]:
        from kvtrace.spec.manifest import Manifest

        text = self._const(MANIFEST_METHOD)
        if not isinstance(text, str):
            raise ArtifactError(f"{self.path} is an ExecuTorch program without kvtrace's manifest (method "
                                f"{MANIFEST_METHOD}); run it with ExecuTorch's runners, or export it with "
                                "`kvtrace export --backend executorch`")
        manifest = Manifest.from_json(text)
        try:
            self.state = json.loads(self._const(STATE_METHOD) or "null")
        except (TypeError, ValueError) as e:
            raise ArtifactError(f"{self.path}: {STATE_METHOD} is not JSON ({e}); re-export it") from e
        tok = self._const(TOKENIZER_METHOD)
        return manifest, tok if isinstance(tok, str) else None

    def check(self, manifest: Manifest) -> None:
        """Methods, their inputs and logits, and every cache buffer against the manifest's specs."""
        from kvtrace.spec.manifest import compare_inputs, expected_inputs

        bufs = manifest.cache_spec.buffers()
        ok = isinstance(self.state, list) and len(self.state) == len(bufs) and all(
            isinstance(s, dict) and s.get("name") == b.name and isinstance(s.get("fqn"), str)
            and isinstance(s.get("seq_major"), bool) for s, b in zip(self.state, bufs, strict=False))
        if not ok:
            raise ArtifactError(f"{self.path}: its cache record ({STATE_METHOD}) does not list the CacheSpec's "
                                f"{len(bufs)} buffers; the file is inconsistent, re-export it")
        dtypes = _dtype_names()
        for name, program in EXECUTORCH.compiled(manifest.programs).items():
            if name not in self.method_names:
                raise ArtifactError(f"{self.path} has no method {name!r} (methods: {sorted(self.method_names)})"
                                    "; the file is inconsistent, re-export it")
            meta = self.program.method_meta(name)
            actual = [(tuple(info.sizes()), dtypes.get(info.dtype(), str(info.dtype())))
                      for info in map(meta.input_tensor_meta, range(meta.num_inputs()))]
            expected = expected_inputs(manifest, program, cache=False)
            compare_inputs(self.path, f"method {name}", expected, _loose(expected, actual))
            out = meta.output_tensor_meta(0).sizes()
            if meta.num_outputs() != 1 or out[-1] != manifest.vocab_size:
                raise ArtifactError(f"{self.path}: method {name} returns {list(out)} logits, the manifest declares "
                                    f"vocab_size {manifest.vocab_size}; the file is inconsistent, re-export it")

    def done_checking(self) -> None:
        """The first instance read the records and answered the checks; sessions load their own (``instance``)."""
        self.program = None

    def instance(self, manifest: Manifest) -> tuple[dict[str, Program], list[torch.Tensor]]:
        """A fresh program (its own buffers, holding their initial values) -> callables and state views."""
        from kvtrace.backends import et_runtime

        program = et_runtime.load_program(self.copy)
        methods = {name: et_runtime.load_method(program, name) for name in EXECUTORCH.compiled(manifest.programs)}
        first = next(iter(methods.values()))
        state = []
        for s, b in zip(self.state, manifest.cache_spec.buffers(), strict=True):
            t = first.get_attribute(s["fqn"])  # the buffer itself, no copy
            view = t.permute(SEQ_MAJOR) if s["seq_major"] else t
            if tuple(view.shape) != b.shape or view.dtype != b.torch_dtype:
                raise ArtifactError(f"{self.path}: cache buffer {b.name} is {view.dtype} {list(view.shape)} in the "
                                    f"program, the CacheSpec declares {b.dtype} {list(b.shape)}; re-export it")
            state.append(view)
        runners = {name: _runner(m, (program, self)) for name, m in methods.items()}
        served = {p: runners[FORWARD if p in ("prefill", "decode") else p] for p in manifest.programs}
        return served, state


def _loose(expected: list[tuple[str, tuple[Any, ...], str]],
           actual: list[tuple[tuple[Any, ...], str]]) -> list[tuple[tuple[Any, ...], str]]:
    """ExecuTorch reports a dynamic size by its upper bound: where the manifest says "T", accept any size."""
    out = []
    for (_, shape, _), (ashape, adtype) in zip(expected, actual, strict=False):
        if len(shape) == len(ashape):
            ashape = tuple("T" if e == "T" else a for e, a in zip(shape, ashape, strict=True))
        out.append((ashape, adtype))
    return out + list(actual[len(expected):])


def _dtype_names() -> dict[int, str]:
    """ExecuTorch's ScalarType codes (as torch's) -> dtype names."""
    return {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32", 7: "float64",
            11: "bool", 15: "bfloat16"}


def _runner(method: Any, keepalive: Any) -> Callable[..., torch.Tensor]:
    """A Decoder program over one method: (tokens, input_pos, *inputs) -> logits (the cache is inside)."""

    def run(*flat: torch.Tensor) -> torch.Tensor:
        (logits,) = method(list(flat))
        return logits

    run.program = keepalive  # the method owns its buffers (the state views own nothing: they live as long as it);
    # the program object and the _Pte, whose copy of the file is mapped, go with the last runner
    return run


EXECUTORCH = ExecuTorchBackend(
    "executorch", "an ExecuTorch .pte (XNNPACK; the cache as initialized mutable buffers; runs in ExecuTorch's "
    "LLM runner)", packs_weights=True, one_program=True, holds_state=True, standalone=True)
