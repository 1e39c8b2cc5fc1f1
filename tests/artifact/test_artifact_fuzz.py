"""Fuzz (#12 item 7): whatever bytes or manifest fields an artifact file holds, ``kvtrace.load`` and a
prefill raise only errors of kvtrace's hierarchy (KvtraceError) — never another exception, never a crash.

Bounded: a tiny ``exported`` artifact, a few hundred examples, ~30-60 s on 2 busy cores.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtrace
from conftest import tiny_model
from kvtrace._errors import KvtraceError

# KVTRACE_FUZZ_EXAMPLES=N: a longer, random (not derandomized) search, e.g. before a release
_LONG = int(os.environ.get("KVTRACE_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_LONG or 250, deadline=None, derandomize=not _LONG,
                suppress_health_check=[HealthCheck.too_slow], database=None)


class Tiny(tuple):
    """(a scratch file, the tiny artifact's bytes, its manifest); a short repr in failure reports."""

    def __repr__(self) -> str:
        return f"Tiny({self[0]}, {len(self[1])} bytes)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    d = tmp_path_factory.mktemp("fuzz")
    path = kvtrace.export(tiny_model("llama", num_hidden_layers=1), d / "tiny.kvt", max_seq_len=8)
    with zipfile.ZipFile(path) as zf:
        manifest = json.loads(zf.read("manifest.json"))
    return Tiny((d / "case.kvt", path.read_bytes(), manifest))


def attempt(scratch: Path, data: bytes, huge_pages: bool = False) -> str:
    """Load ``data`` (the weights in huge pages with ``huge_pages``) and prefill three tokens; only KvtraceError
    may come out."""
    scratch.write_bytes(data)
    try:
        art = kvtrace.load(scratch, huge_pages=huge_pages)
        art.session().prefill(torch.tensor([[1, 2, 3]]))
    except KvtraceError as e:
        assert "\n" not in str(e), f"a multi-line error message: {e!r}"
        return type(e).__name__
    return "loaded"


def with_manifest(data: bytes, manifest_text: str, scratch: Path) -> bytes:
    src = scratch.with_suffix(".src")
    src.write_bytes(data)
    out = scratch.with_suffix(".out")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, manifest_text if info.filename == "manifest.json" else zin.read(info))
    return out.read_bytes()


def _paths(v: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*prefix, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*prefix, i))
    return out


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 100) | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _mutate(manifest: dict[str, Any], path: tuple, how: str, value: Any) -> dict[str, Any]:
    d = json.loads(json.dumps(manifest))
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    old = parent[key]
    if how == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif how == "nudge" and isinstance(old, int) and not isinstance(old, bool):
        parent[key] = old + (value if isinstance(value, int) and not isinstance(value, bool) else 1)
    else:
        parent[key] = value
    return d


@FUZZ
@given(data=st.data())
def test_fuzzed_bytes_raise_only_kvtrace_errors(tiny, data):
    scratch, blob, _ = tiny
    n = len(blob)
    # bias some offsets towards the zip directory at the end (where a flip changes how members are read)
    offset = st.one_of(st.integers(0, n - 1), st.integers(max(0, n - 2048), n - 1))
    flips = data.draw(st.lists(st.tuples(offset, st.integers(0, 255)), min_size=1, max_size=6), label="flips")
    buf = bytearray(blob)
    for i, b in flips:
        buf[i] = b
    if data.draw(st.booleans(), label="truncate"):
        buf = buf[: data.draw(st.integers(0, n - 1), label="length")]
    huge = data.draw(st.booleans(), label="huge_pages")  # the weights read into an advised buffer (artifact.hugepages)
    attempt(scratch, bytes(buf), huge)  # a flip in a timestamp may still load: only the error type is asserted


@FUZZ
@given(data=st.data())
def test_fuzzed_manifest_fields_raise_only_kvtrace_errors(tiny, data):
    scratch, blob, manifest = tiny
    path = data.draw(st.sampled_from(_paths(manifest)), label="path")
    how = data.draw(st.sampled_from(["set", "nudge", "delete"]), label="how")
    value = data.draw(st.integers(-2, 16) if how == "nudge" else JSON, label="value")
    mutated = _mutate(manifest, path, how, value)
    attempt(scratch, with_manifest(blob, json.dumps(mutated), scratch), data.draw(st.booleans(), label="huge_pages"))


@FUZZ
@given(text=st.one_of(st.text(max_size=64), st.binary(max_size=64).map(lambda b: b.decode("latin-1"))))
def test_fuzzed_manifest_text_raises_only_kvtrace_errors(tiny, text):
    scratch, blob, _ = tiny
    assert attempt(scratch, with_manifest(blob, text, scratch)) != "loaded"


@pytest.mark.parametrize(("path", "value"), [
    (("weights", "output.weight", "dtype"), []),  # found by the fuzzer: an unhashable dtype raised TypeError
    (("signatures", "prefill", 0, "dtype"), {}),
    (("programs", "prefill", "inputs"), [{"name": "x", "shape": [[1]], "dtype": "float32"}]),
    (("cache_spec", "layers", 0, "kind"), ["full"]),
    (("members", "weights.safetensors", "size"), 1 << 62),
])
def test_known_manifest_cases_raise_only_kvtrace_errors(tiny, path, value):
    scratch, blob, manifest = tiny
    assert attempt(scratch, with_manifest(blob, json.dumps(_mutate(manifest, path, "set", value)), scratch)) != "loaded"
