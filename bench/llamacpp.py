"""kvtrace against llama.cpp on the same GGUF, the same threads and prompt, in one run.

    .venv/bin/python bench/llamacpp.py [--threads 2] [--json docs/bench_llamacpp.json] [-- kvtrace bench args]

What it does, in order (each step printed):
  1. finds ``llama-bench`` and ``llama-quantize`` ($LLAMA_CPP_BIN, else builds them once from the llama.cpp
     sources vendored in the pinned ``llama-cpp-python`` sdist from PyPI, into ~/.cache/kvtrace/peers; needs
     cmake and a C++ compiler; ~4 min on 2 cores), CPU-native build (``GGML_NATIVE``), OpenMP threads;
  2. writes an F32 copy of the GGUF (``llama-quantize --allow-requantize ... F32``: the same weights,
     dequantized) for llama.cpp's float32 row, and copies requantized to each of ``--peer-formats`` (default
     Q4_0 and Q8_0: llama.cpp's int8-activation paths, the peers of kvtrace's 8da4w and int8 rows; requantized
     from the GGUF's blocks, so their numbers differ: they are there for speed);
  3. llama-bench: prefill of ``--prompt-len`` tokens, then ``--new-tokens`` decoded after a context of that
     many tokens (``-d``), for the GGUF as shipped and the F32 copy;
  4. ``kvtrace bench`` on the same GGUF (default rows: aoti and executorch, none / gguf), its JSON kept next to
     --json;
  5. llama-bench again, so the machine's drift during the run shows as llama.cpp's before/after spread.

Prints one Markdown table (decode tokens/s, prefill ms, each row's fraction of its own bandwidth bound, each
kvtrace row as a multiple of llama.cpp's row of the peer weight format) and writes everything to --json.
llama.cpp's bound: its file's bytes per token (every weight read once; the tied head is the embedding) at the
read bandwidth kvtrace bench's probe measures right before and after each llama-bench pass. llama.cpp keeps its K/V cache in float16 (its
default), kvtrace in the model's dtype. Machines differ a lot: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp build 0c1e570
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvtrace" / "peers"
ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")  # bench/perplexity.py uses the last


def say(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def tools() -> Path:
    """The directory holding llama-bench, llama-quantize and llama-perplexity (built once, then reused)."""
    if os.environ.get("LLAMA_CPP_BIN"):
        return Path(os.environ["LLAMA_CPP_BIN"])
    out = CACHE / SDIST.replace("==", "-") / "bin"
    if all((out / name).exists() for name in TOOLS):
        return out
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            sys.exit(f"building llama.cpp needs {tool} on PATH (apt-get install cmake g++), or set LLAMA_CPP_BIN "
                     f"to a directory with {', '.join(TOOLS)}")
    with tempfile.TemporaryDirectory() as tmp:
        say(f"downloading {SDIST} (sources only) from PyPI")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, SDIST], check=True)
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        say(f"building {', '.join(TOOLS)} (CPU-native, OpenMP)")
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS,
                        "-j", str(os.cpu_count() or 2)], check=True, stdout=subprocess.DEVNULL)
        out.mkdir(parents=True, exist_ok=True)
        for name in TOOLS:
            shutil.copy2(build / "bin" / name, out / name)
    return out


def default_gguf() -> Path:
    from kvtrace.sources.resolve import resolve_source  # the embedded default model's GGUF

    return resolve_source(None).path


# kvtrace's quantization -> the llama.cpp weight format it is measured against (same bits, same kind of scales)
PEERS = {"none": "F32", "int8": "Q8_0", "int4": "Q4_1", "8da4w": "Q4_0"}


def probe(threads: int) -> float:
    """Read bandwidth in GB/s, as ``kvtrace bench`` measures it next to each row."""
    import torch

    from kvtrace.tools.bench import measure_bandwidth

    torch.set_num_threads(threads)
    return measure_bandwidth()


def requantized(bin_dir: Path, gguf: Path, fmt: str) -> Path:
    """A copy of ``gguf`` in llama.cpp's ``fmt`` ("F32": the same weights dequantized), written once."""
    out = CACHE / f"{gguf.stem}.{fmt}.gguf"
    if not out.exists():
        say(f"writing {out.name} ({'the same weights, dequantized' if fmt == 'F32' else 'requantized'})")
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(out), fmt],
                       check=True, capture_output=True)
    return out


def llama_bench(bin_dir: Path, models: list[Path], threads: int, prompt: int, new: int, reps: int) -> list[dict]:
    """llama-bench's JSON rows: prefill of ``prompt`` tokens, and ``new`` tokens decoded after ``prompt``."""
    rows = []
    for extra in (["-p", str(prompt), "-n", "0"], ["-p", "0", "-n", str(new), "-d", str(prompt)]):
        cmd = [str(bin_dir / "llama-bench"), *(a for m in models for a in ("-m", str(m))), "-t", str(threads),
               "-r", str(reps), "-o", "json", *extra]
        res = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows += json.loads(res.stdout)
    return rows


def peer_rows(raw: list[dict], bandwidth: float) -> dict[str, dict]:
    """By weight format ("Q4_1", "F32"): prefill ms and decode tokens/s (mean, min-max of llama-bench's samples),
    and decode's fraction of the bound: the file's bytes every token at ``bandwidth`` GB/s."""
    out: dict[str, dict] = {}
    for r in raw:
        fmt = r["model_type"].split()[-1]
        row = out.setdefault(fmt, {"model_type": r["model_type"], "model_mib": round(r["model_size"] / 2**20, 1),
                                   "bandwidth_gb_s": round(bandwidth, 2)})
        ts = r["samples_ts"]
        if r["n_gen"]:
            row.update(decode_tok_s=r["avg_ts"], decode_tok_s_range=[min(ts), max(ts)],
                       bound_fraction=round(r["model_size"] * r["avg_ts"] / (bandwidth * 1e9), 3))
        else:
            row.update(prefill_ms=1e3 * r["n_prompt"] / r["avg_ts"],
                       prefill_ms_range=[1e3 * r["n_prompt"] / max(ts), 1e3 * r["n_prompt"] / min(ts)])
    return out


def table(kv: dict, before: dict[str, dict], after: dict[str, dict], fmt_of: dict[str, str]) -> str:
    lines = ["| runtime | weights | prefill ms | decode tok/s (min-max) | of bound | GB/s | x llama.cpp, peer weights |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in (("llama.cpp (before)", before), ("llama.cpp (after)", after)):
        for fmt, r in rows.items():
            lo, hi = r["decode_tok_s_range"]
            lines.append(f"| {name} | {fmt} | {r['prefill_ms']:.1f} | {r['decode_tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
                         f"{r['bound_fraction']:.2f} | {r['bandwidth_gb_s']:.1f} | - |")
    for r in kv["results"]:
        if r.get("error") or r["backend"] == "hf-eager":
            continue
        fmt = fmt_of.get(r["quant"], "")
        peers = [p[fmt]["decode_tok_s"] for p in (before, after) if fmt in p]
        ratio = f"{r['decode_tok_s'] / (sum(peers) / len(peers)):.2f}" if peers else "-"
        lo, hi = r["decode_tok_s_range"]
        bound = f"{r['bound_fraction']:.2f}" if r.get("bound_fraction") is not None else "-"
        lines.append(f"| kvtrace {r['backend']} | {r['quant']} ({r['dtype']}) | {r['prefill_ms']:.1f} | "
                     f"{r['decode_tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | {bound} | {r.get('bandwidth_gb_s') or 0:.1f} | "
                     f"{ratio}{f' ({fmt})' if peers else ''} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="default: the embedded SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=37)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5, help="llama-bench repetitions per row")
    ap.add_argument("--backends", default="aoti,executorch")
    ap.add_argument("--quant", default="none,gguf")
    ap.add_argument("--peer-formats", default="Q4_0,Q8_0",
                    help="llama.cpp formats to requantize the GGUF to, one llama.cpp row each (besides the GGUF's own "
                         "and F32); '' for none")
    ap.add_argument("--json", type=Path, default=Path("bench_llamacpp.json"))
    args = ap.parse_args()

    bin_dir = tools()
    gguf = args.gguf or default_gguf()
    extra = [f.strip() for f in args.peer_formats.split(",") if f.strip()]
    models = [gguf, *(requantized(bin_dir, gguf, fmt) for fmt in ("F32", *extra))]
    say("llama-bench (before)")
    bw = [probe(args.threads)]
    before_raw = llama_bench(bin_dir, models, args.threads, args.prompt_len, args.new_tokens, args.reps)
    bw.append(probe(args.threads))
    out = args.json.with_suffix(".kvtrace.json")  # kept: a failed run later must not lose the bench's rows
    cmd = [str(Path(sys.executable).parent / "kvtrace"), "bench", "--model", str(gguf), "--backends",
           args.backends, "--quant", args.quant, "--threads", str(args.threads), "--prompt-len",
           str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--json", str(out)]
    say(" ".join(cmd[1:]))
    # exit status 1 = some row failed (e.g. a backend that does not take a quantization): its row says why
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode not in (0, 1) or not out.exists():
        sys.exit(f"kvtrace bench failed: {' '.join(cmd)}")
    kv = json.loads(out.read_text())
    say("llama-bench (after)")
    bw.append(probe(args.threads))
    after_raw = llama_bench(bin_dir, models, args.threads, args.prompt_len, args.new_tokens, args.reps)
    bw.append(probe(args.threads))
    before, after = peer_rows(before_raw, (bw[0] + bw[1]) / 2), peer_rows(after_raw, (bw[2] + bw[3]) / 2)
    native = next(iter(before))  # the GGUF's own type, e.g. Q4_1
    text = table(kv, before, after, {**PEERS, "gguf": native})
    print(text)
    args.json.write_text(json.dumps({"command": " ".join(sys.argv), "llama_cpp": SDIST, "gguf": str(gguf),
                                     "llama_cpp_before": before, "llama_cpp_after": after, "probes_gb_s": bw, "kvtrace": kv,
                                     "llama_cpp_raw": before_raw + after_raw, "table": text}, indent=1))
    say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
