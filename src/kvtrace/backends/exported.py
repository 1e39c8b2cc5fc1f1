"""Backend "exported": torch.export programs serialized as JSON, weights kept outside them.

Members: ``programs/<name>.json`` per ProgramSpec (serialized without weights, constants or example
inputs). Such a program is data: a graph of torch operators (torch's verifier refuses any other call
target). Loading deserializes each graph over the artifact's weights and checks the graph's own
placeholders against the manifest: the weights it reads (names, shapes, dtypes), its user inputs
(tokens, positions, declared inputs, cache buffers, against the CacheSpec) and its logits (vocab_size).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace._errors import ArtifactError
from kvtrace.backends.base import Backend, Program

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from kvtrace.spec.manifest import Manifest

__all__ = ["EXPORTED", "ExportedBackend"]


def _member(name: str) -> str:
    return f"programs/{name}.json"


class ExportedBackend(Backend):
    @property
    def compile_label(self) -> str:
        return "serializing programs"

    def compile(self, eps: dict[str, torch.export.ExportedProgram], dtype: torch.dtype) -> dict[str, bytes]:
        import inspect

        from torch._export.serde.serialize import serialize

        # the program's graph only (``.exported_program``): weights travel once, in the artifact's weights. A torch
        # without these switches (2.11, the GPU image's) also serializes the state dict, which is dropped here
        params = inspect.signature(serialize).parameters
        skip = {k: False for k in ("serialize_state_dict", "serialize_constants", "serialize_example_inputs")
                if k in params}
        return {_member(name): serialize(ep, **skip).exported_program for name, ep in eps.items()}

    def members(self, programs: Iterable[str]) -> set[str]:
        return {_member(p) for p in programs}

    def load(self, path: Path, manifest: Manifest, blobs: Mapping[str, Any],
             weights: dict[str, torch.Tensor], device: torch.device | None = None) -> dict[str, Program]:
        return {p: _program(path, p, blobs[_member(p)], weights, manifest) for p in manifest.programs}


EXPORTED = ExportedBackend("exported", "portable torch.export programs (data, no native code)")


def _program(path: Path, name: str, blob: bytes, weights: dict[str, torch.Tensor], manifest: Manifest) -> Program:
    import torch
    from torch._export.serde.serialize import SerializedArtifact, deserialize
    from torch.export.graph_signature import InputKind

    from kvtrace.spec.manifest import clip, compare_inputs, describe, expected_inputs, short

    try:
        graph = json.loads(blob)
        names = _program_weight_names(graph)
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration, RecursionError) as e:
        raise ArtifactError(f"{path}: programs/{name}.json is not a serialized program ({clip(str(e), 120)}); "
                            "the file is corrupt, re-export it") from e
    lacking = sorted(n for kind in names.values() for n in kind if n not in weights)
    if lacking:
        raise ArtifactError(f"{path}: program {name} reads weight(s) {short(lacking)} that weights.safetensors "
                            "does not hold; the artifact is inconsistent, re-export it")
    state_dict: dict[str, torch.Tensor] = {n: weights[n] for n in names["buffers"]}
    state_dict.update({n: torch.nn.Parameter(weights[n], requires_grad=False) for n in names["params"]})
    constants = {n: weights[n] for n in names["constants"]}
    ep = deserialize(SerializedArtifact(blob, state_dict, constants, b""))
    # the graph's own placeholders are the truth: weights, then inputs and cache, then the logits
    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user: list[tuple[tuple[int | str, ...], str]] = []
    for spec in ep.graph_signature.input_specs:
        val = nodes[spec.arg.name].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ArtifactError(f"{path}: program {name} takes a non-tensor input {spec.arg.name}; re-export it")
        shape = tuple(d if isinstance(d, int) else str(d) for d in val.shape)
        if spec.kind == InputKind.USER_INPUT:
            user.append((shape, str(val.dtype).removeprefix("torch.")))
        elif spec.target in weights:
            w = weights[spec.target]
            if tuple(w.shape) != shape or w.dtype != val.dtype:
                raise ArtifactError(f"{path}: program {name} reads weight {spec.target} as "
                                    f"{str(val.dtype).removeprefix('torch.')} {list(shape)}, but weights.safetensors "
                                    f"holds {describe(w)}; the artifact is inconsistent, re-export it")
    compare_inputs(path, f"program {name}", expected_inputs(manifest, manifest.programs[name]), user)
    (logits,) = ep.graph_signature.user_outputs
    out = next(n for n in ep.graph.nodes if n.name == logits).meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[-1] != manifest.vocab_size:
        raise ArtifactError(f"{path}: program {name} returns {tuple(getattr(out, 'shape', ()))} logits, the manifest "
                            f"declares vocab_size {manifest.vocab_size}; the artifact is inconsistent, re-export it")
    return ep.module()


def _program_weight_names(graph: dict[str, Any]) -> dict[str, list[str]]:
    """Which weights a serialized program's signature expects (parameters/buffers vs constants)."""
    out: dict[str, list[str]] = {"params": [], "buffers": [], "constants": []}
    for spec in graph["graph_module"]["signature"]["input_specs"]:
        kind, body = next(iter(spec.items()))
        if kind == "parameter":
            out["params"].append(body["parameter_name"])
        elif kind == "buffer":  # non-persistent buffers travel with the constants
            out["buffers" if body.get("persistent", True) else "constants"].append(body["buffer_name"])
        elif kind == "tensor_constant":
            out["constants"].append(body["tensor_constant_name"])
    return out
