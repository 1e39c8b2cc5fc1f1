"""ExecuTorch's runtime without its compiler: what loading and running a ``.pte`` needs, imported lean.

ExecuTorch's Python runtime (``executorch.runtime``, ``portable_lib``) imports ``executorch.exir``, the
compiler (~2.6 s on these machines), and ``executorch.extension.llm.custom_ops`` imports Inductor's lowerings
(~4 s) to register the llama ops' export-time behaviour. Running a program needs neither: only the C++
runtime extension (``executorch.extension.pybindings._C``) and the shared library that registers the
``llama::`` kernels (``custom_sdpa``, ``update_cache``) with it. ``load_program`` imports those two (~0.02 s
after torch) and hands back the runtime's own program object: ``num_methods``/``get_method_name``,
``method_meta(name)``, ``load_method(name)`` -> a method called with a list of inputs (outputs cloned),
``get_attribute(fqn)`` for a mutable buffer (a view that owns nothing: keep the method alive while it is used).
Load each method of a program once: a method loaded again on the same program instance sets the mutable
buffers it shares with the first back to their initial values (a Session's cache wiped). ``load_method`` loads one with ExecuTorch's CPU-probe log lines
dropped where kvtrace runs quiet (the CLI without ``--debug``).

The extension module's name is private to ExecuTorch (``portable_lib`` re-exports it); the extra pins
``executorch~=1.5.1``; ``tests/backends/test_executorch.py`` checks that loading imports none of the compiler.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvtrace.sources.quiet import native_lines_dropped

__all__ = ["load_method", "load_program", "method_names", "runtime"]

_OPS_PACKAGE = "executorch.extension.llm.custom_ops"
# ExecuTorch's thread pool probes the CPU when a method first needs it (XNNPACK's init) and logs each step at
# Info level, five lines a process ("Failed to open midr file ...", "... # of cpus dont match"): not errors.
_CPU_PROBE = re.compile(r"\[cpuinfo_utils\.cpp:\d+\] ")


@functools.cache
def runtime() -> ModuleType:
    """The runtime extension with the llama kernels registered (imported once). ImportError if ExecuTorch is
    not installed."""
    from executorch.extension.pybindings import _C as rt  # after torch (imported above): it links libtorch

    spec = importlib.util.find_spec(_OPS_PACKAGE)
    libs = sorted(Path(spec.submodule_search_locations[0]).glob("*custom_ops_aot_lib.*")) if spec else []
    if len(libs) == 1:
        torch.ops.load_library(str(libs[0]))  # dlopen: once per process, however often it is asked
    else:  # a layout this module does not know: let ExecuTorch's own module find and load its library
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
    return rt


def load_program(path: str | Path) -> Any:
    """The runtime's program for the file at ``path`` (mapped, internal consistency verified)."""
    rt = runtime()
    return rt._load_program(str(path), enable_etdump=False, debug_buffer_size=0,
                            program_verification=rt.Verification.InternalConsistency)


def method_names(program: Any) -> set[str]:
    """The names of ``program``'s methods."""
    return {program.get_method_name(i) for i in range(program.num_methods())}


def load_method(program: Any, name: str) -> Any:
    """``program.load_method(name)``; ExecuTorch's CPU-probe log lines dropped while kvtrace runs quiet."""
    with native_lines_dropped(_CPU_PROBE):
        return program.load_method(name)
