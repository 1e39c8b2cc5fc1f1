"""The exported backend's serialization: the program's graph only (weights travel once, in the artifact's weights),
also on a torch whose serializer lacks the switches that skip the rest (2.11, the GPU image's: it raised TypeError)."""

from __future__ import annotations

import torch

from kvtrace.backends.exported import EXPORTED


class _Lin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _ep() -> torch.export.ExportedProgram:
    return torch.export.export(_Lin().eval(), (torch.randn(2, 8),))


def test_compile_leaves_the_weights_out_of_the_program():
    blobs = EXPORTED.compile({"decode": _ep()}, torch.float32)
    assert list(blobs) == ["programs/decode.json"] and len(blobs["programs/decode.json"]) > 0


def test_compile_on_a_serializer_without_the_switches(monkeypatch):
    import torch._export.serde.serialize as serde

    real, seen = serde.serialize, []

    def old_serialize(exported_program, opset_version=None, pickle_protocol=2):  # torch 2.11's signature
        seen.append(exported_program)
        return real(exported_program, opset_version=opset_version, pickle_protocol=pickle_protocol)

    monkeypatch.setattr(serde, "serialize", old_serialize)
    ep = _ep()
    blobs = EXPORTED.compile({"prefill": ep}, torch.float32)
    assert seen == [ep] and list(blobs) == ["programs/prefill.json"]
