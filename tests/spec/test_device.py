"""spec.device: naming a device, and the one-line refusal of a GPU this machine does not have."""

from __future__ import annotations

import pytest
import torch

from kvtrace._errors import UsageError
from kvtrace.spec import device as dev


def test_resolve_names_cpu_cuda_and_meta():
    assert dev.resolve(None) == torch.device("cpu")
    assert dev.resolve(None, default="cuda") == torch.device("cuda")
    assert dev.resolve("cuda:1") == torch.device("cuda", 1)
    assert dev.resolve(torch.device("meta")).type == "meta"
    assert dev.device_type("cuda:3") == "cuda"


@pytest.mark.parametrize("bad", ["gpu", "tpu", "cuda:x", 3.5])
def test_resolve_refuses_other_names(bad):
    with pytest.raises(UsageError, match="must be one of"):
        dev.resolve(bad)


def test_check_available_refuses_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dev.check_available(torch.device("cpu"), "anything")  # the CPU is always there
    with pytest.raises(UsageError, match="needs a CUDA GPU, but this machine has none") as e:
        dev.check_available(torch.device("cuda"), "export to device cuda")
    assert "\n" not in str(e.value) and "export to device cuda" in str(e.value)


def test_check_available_names_the_devices_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match=r"has 1 CUDA device\(s\)"):
        dev.check_available(torch.device("cuda", 2), "load")


def test_concrete_gives_cuda_its_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert dev.concrete(torch.device("cuda")) == torch.device("cuda", 0)
    assert dev.concrete(torch.device("cpu")) == torch.device("cpu")
