"""The x86 instruction-set extensions a compiled program needs, and whether this CPU has them.

Inductor compiles an artifact's native code (``aoti``, ``aoti-packed``) with ``-march=native`` and its vector ISA's
flags (``-mavx512f ... -mamx-tile``), so the library may execute any extension of the exporting CPU. Loaded on a
CPU without one, its first call dies of an illegal instruction (SIGILL): no message, no traceback. The manifest
therefore records the extensions the compiler was allowed to use (``Manifest.cpu_features``, named as Linux's
``/proc/cpuinfo`` names them) and ``kvtrace.load`` refuses, in one line, a CPU that lacks any.

What is recorded: the extensions the C++ compiler enables under Inductor's flags (asked of the compiler:
``g++ <flags> -Q --help=target``), or, when the compiler does not say (clang), every extension of this CPU (a
superset: never too few). Only compute extensions are listed (``GCC_TO_CPUINFO``): the ones generated code or
intrinsics execute. Not recorded (None, not checked): non-x86 machines and machines without ``/proc/cpuinfo``.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import re
import subprocess
from pathlib import Path

__all__ = ["GCC_TO_CPUINFO", "compiled_features", "cpu_flags", "fingerprint", "missing_features"]

# gcc's -m option (without "-m") -> the /proc/cpuinfo flag of the same extension
GCC_TO_CPUINFO = {
    "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "popcnt": "popcnt",
    "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm",
    "movbe": "movbe", "adx": "adx", "aes": "aes", "pclmul": "pclmulqdq", "sha": "sha_ni", "gfni": "gfni",
    "vaes": "vaes", "vpclmulqdq": "vpclmulqdq",
    "avx512f": "avx512f", "avx512dq": "avx512dq", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2",
    "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "avxvnni": "avx_vnni", "avxifma": "avx_ifma",
    "avxvnniint8": "avx_vnni_int8", "avxneconvert": "avx_ne_convert",
    "amx-tile": "amx_tile", "amx-bf16": "amx_bf16", "amx-int8": "amx_int8", "amx-fp16": "amx_fp16",
}
_X86 = {"x86_64", "amd64", "i386", "i686"}


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This CPU's flags as ``/proc/cpuinfo`` lists them; None off x86 Linux (nothing to compare)."""
    if platform.machine().lower() not in _X86:
        return None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    m = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return frozenset(m.group(1).split()) if m else None


def _inductor_flags() -> tuple[str, list[str]]:
    """(compiler, its target flags) as Inductor compiles a CPU library here: ``-march`` and the vector ISA's."""
    from torch._inductor import cpp_builder
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    compiler = cpp_builder.get_cpp_compiler()
    flags = [f"-{f}" for f in cpp_builder._get_cpu_arch_cflags(compiler)]
    return compiler, flags + pick_vec_isa().build_arch_flags().split()


def _enabled_by(compiler: str, flags: list[str]) -> frozenset[str] | None:
    """The extensions ``compiler`` enables under ``flags`` (cpuinfo names), None when it cannot say (not gcc)."""
    try:
        out = subprocess.run([compiler, *flags, "-Q", "--help=target"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    on = {m.group(1) for m in re.finditer(r"^\s+-m(\S+)\s+\[enabled\]", out, re.MULTILINE)}
    return frozenset(GCC_TO_CPUINFO[o] for o in on if o in GCC_TO_CPUINFO) if on else None


def compiled_features() -> tuple[str, ...] | None:
    """The extensions a library Inductor compiles here may execute (sorted cpuinfo names), for the manifest."""
    here = cpu_flags()
    if here is None:
        return None
    try:
        enabled = _enabled_by(*_inductor_flags())
    except Exception:
        enabled = None
    if enabled is None:
        enabled = frozenset(GCC_TO_CPUINFO.values()) & here
    return tuple(sorted(enabled))


def missing_features(recorded: tuple[str, ...] | list[str] | None) -> list[str]:
    """The recorded extensions this CPU lacks ([] when none, or when either side is unknown)."""
    here = cpu_flags()
    if recorded is None or here is None:
        return []
    return sorted(set(recorded) - here)


def fingerprint() -> str:
    """A short digest of this CPU's compute extensions (the artifact cache keys native-code entries on it, so
    machines sharing one cache each build for their own CPU); "unknown" where they cannot be read."""
    here = cpu_flags()
    if here is None:
        return "unknown"
    return hashlib.sha256(" ".join(sorted(here & set(GCC_TO_CPUINFO.values()))).encode()).hexdigest()[:12]
