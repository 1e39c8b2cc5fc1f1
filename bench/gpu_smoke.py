"""Probes for bench/gpu.py's ``smoke`` phase: can this machine's torch compile and load AOTInductor programs for
the device at all, and which of kvtrace's backends load there — each probe in its own process.

Why: on the one GPU run so far (H200, torch 2.11.0+cu130, stop 36), loading kvtrace's ``aoti`` artifact of the 1B
model died of SIGSEGV inside ``AOTIModelContainerRunnerCuda(...)`` (and, before that, inside the C-ABI constant
probe's ``AOTInductorModelContainerCreateWithDevice``): with kernels embedded or beside the library alike. A
segfault kills the process, so these probes run apart, concurrently, and each says ok, its error, or the signal it
died of with its last lines (faulthandler's stack). gpu.py picks the 1B run's backend from them (``--backend
auto``): ``aoti`` where it loads, else ``aoti-packed``, else ``exported``.

    torch-packaged    torch alone: a tiny MLP, aoti_compile_and_package with torch's defaults (weights in the .so)
    torch-external    the same with aot_inductor.package_constants_in_so=False and the weights handed in by
                      load_constants (what kvtrace's ``aoti`` does), through torch's own package loader
    kvtrace-aoti      kvtrace.export(tiny Llama, backend=aoti) for the device, kvtrace.load, one prefill + decode
    kvtrace-aoti-packed   the same with backend=aoti-packed (weights frozen into the library)
    kvtrace-aoti-wide     kvtrace-aoti at the 1B's widths (hidden 2048, vocab 128256), one layer: does a crash
                      depend on the model's size? (not used to pick the backend)

    python bench/gpu_smoke.py --device cuda              # all probes, one JSON line each
    python bench/gpu_smoke.py --device cpu --probe torch-external   # one, in this process (what a child runs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROBES = ("torch-packaged", "torch-external", "kvtrace-aoti", "kvtrace-aoti-packed", "kvtrace-aoti-wide")


def _torch_probe(device: str, external: bool, workdir: Path) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(device).eval()
    x = torch.randn(2, 64, device=device)
    with torch.no_grad():
        ref = model(x)
        ep = torch.export.export(model, (x,))
        opts = {"aot_inductor.package_constants_in_so": False} if external else {}
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(workdir / "m.pt2"),
                                                        inductor_configs=opts)
        loaded = torch._inductor.aoti_load_package(path)
        if external:
            loaded.load_constants(dict(model.state_dict()), check_full_update=True, user_managed=True)
        got = loaded(x)
    got = got[0] if isinstance(got, (list, tuple)) else got
    return {"max_abs": float((got - ref).abs().max())}


def _kvtrace_probe(device: str, backend: str, workdir: Path, wide: bool = False) -> dict[str, Any]:
    """gpu.py's own models: its tiny Llama, or (``wide``) the 1B shape with one layer."""
    import torch
    from gpu import build_model

    import kvtrace

    model = build_model(not wide, torch.device(device), 1 if wide else None)
    path = workdir / f"tiny-{backend}.kvt"
    t0 = time.perf_counter()
    kvtrace.export(model, path, max_seq_len=64, dtype="bfloat16", backend=backend, device=torch.device(device))
    export_s = time.perf_counter() - t0
    art = kvtrace.load(path, device=torch.device(device))
    s = art.session()
    ids = torch.arange(5, 12).unsqueeze(0)  # [1, 7]
    logits = s.prefill(ids)
    logits = s.decode(logits[:, -1:].argmax(-1))
    return {"export_s": round(export_s, 1), "position": int(s.position), "logits_finite": bool(logits.isfinite().all())}


def run_one(name: str, device: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"kvtrace-smoke-{name}-") as d:
        if name.startswith("torch-"):
            return _torch_probe(device, name == "torch-external", Path(d))
        if name == "kvtrace-aoti-wide":
            return _kvtrace_probe(device, "aoti", Path(d), wide=True)
        return _kvtrace_probe(device, name.removeprefix("kvtrace-"), Path(d))


def run_all(device: str, timeout_s: float = 240.0, probes: tuple[str, ...] = PROBES) -> list[dict[str, Any]]:
    """Every probe in a child process, all at once; one record each: probe, ok, seconds, and the child's result,
    or its error / the signal it died of with the last lines it wrote."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    procs = {n: subprocess.Popen([sys.executable, __file__, "--device", device, "--probe", n], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in probes}
    out = []
    for name, p in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
            out.append({"probe": name, "ok": False, "error": f"timed out after {timeout_s:.0f} s",
                        "tail": text[-600:]})
            continue
        rec: dict[str, Any] = {"probe": name, "seconds": round(time.perf_counter() - t0, 1)}
        result = [line for line in text.splitlines() if line.startswith('{"probe_result"')]
        if p.returncode == 0 and result:
            rec.update(ok=True, **json.loads(result[-1])["probe_result"])
        else:
            rec.update(ok=False, rc=p.returncode, signal=-p.returncode if p.returncode < 0 else None,
                       tail=_tail(text))
        out.append(rec)
    return out


def _tail(text: str, n: int = 900) -> str:
    """The last lines worth reading: faulthandler's current-thread stack if there is one, else the end."""
    i = text.rfind("Current thread")
    return (text[i:i + n] if i >= 0 else text[-n:]).strip()


def pick_backend(smoke: list[dict[str, Any]]) -> str:
    """The 1B run's backend: the first of aoti, aoti-packed whose tiny probe loaded and ran, else exported."""
    ok = {r["probe"] for r in smoke if r.get("ok")}
    for backend in ("aoti", "aoti-packed"):
        if f"kvtrace-{backend}" in ok:
            return backend
    return "exported"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--probe", choices=PROBES, help="run this one probe in this process")
    args = p.parse_args()
    if args.probe:
        res = run_one(args.probe, args.device)
        print(json.dumps({"probe_result": res}), flush=True)
        return 0
    for rec in run_all(args.device):
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
