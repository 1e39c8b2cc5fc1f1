"""kvtrace perplexity against llama.cpp's llama-perplexity: the same GGUF, the same text, the same chunks.

    .venv/bin/python bench/perplexity.py --text FILE [--ctx 512] [--chunks N] [--threads 2]
        [--quant none,gguf,int8,int4] [--kv-dtype auto,int8] [--peer-formats Q8_0,Q4_0] [--squash-whitespace]
        [--json OUT.json]

What it does, in order (each step printed):
  1. finds llama-perplexity and llama-quantize (bench/llamacpp.py builds them once from the pinned
     llama-cpp-python sdist);
  2. writes an F32 copy of the GGUF (its blocks dequantized: the weights kvtrace's float32 reference computes
     with) and a copy in each --peer-formats (requantized from the GGUF's blocks);
  3. llama-perplexity on the F32 copy, saving its logits (--kl-divergence-base), then on the GGUF as shipped and
     on each peer copy with --kl-divergence: each one's perplexity, mean / 99th percentile / max KL divergence
     and the share of positions with the same most likely token, against llama.cpp's F32;
  4. ``kvtrace perplexity`` on the same GGUF and text: eager float32 (the reference) and one artifact per
     --quant x --kv-dtype, each against eager float32;
  5. prints one Markdown table and writes everything (both tools' raw output included) to --json.

Both tools cut the text into chunks of --ctx tokens and score the second half of each (llama.cpp's method,
which ``kvtrace perplexity`` follows). The two references differ in implementation only (HF eager float32, llama.cpp
F32 on the same dequantized weights): their perplexities agreeing is the check that the two runs score the same
tokens the same way; the KL columns of each tool are against its own float32 reference. llama.cpp's quantized
formats also quantize activations (Q8 blocks) in their dot products; kvtrace's gguf row computes in float32.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp import SDIST, default_gguf, requantized, say, tools

FINAL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")
CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
KL_FIELDS = {  # llama-perplexity --kl-divergence's summary lines -> our names
    "ppl": re.compile(r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)"),
    "kl_mean": re.compile(r"Mean\s+KLD:\s*([\d.]+)"),
    "kl_p99": re.compile(r"99\.0%\s+KLD:\s*([\d.]+)"),
    "kl_max": re.compile(r"Maximum KLD:\s*([\d.]+)"),
    "top1_agree": re.compile(r"Same top p:\s*([\d.]+)"),
}


def llama_perplexity(bin_dir: Path, model: Path, text: Path, ctx: int, chunks: int | None, threads: int,
                     base: Path, kl: bool) -> dict:
    """One llama-perplexity run: the F32 base (``kl=False``, saving its logits to ``base``) or a quantized copy
    against it (``kl=True``); its numbers parsed from the log, which is kept too."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-c", str(ctx), "-t", str(threads),
           "--kl-divergence-base", str(base), *(["--chunks", str(chunks)] if chunks else [])]
    cmd += ["--kl-divergence"] if kl else ["-f", str(text)]  # the KL run reads the base's tokens from it
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = res.stdout + res.stderr
    if res.returncode != 0:
        sys.exit(f"llama-perplexity failed ({res.returncode}): {' '.join(cmd)}\n{log[-2000:]}")
    return {"model": model.name, "wall_s": round(wall, 2), **parse_log(log, kl, model.name), "log": log[-6000:]}


def parse_log(log: str, kl: bool, name: str = "the model") -> dict:
    """llama-perplexity's numbers: chunks and ctx; the base run's final PPL and its ±; a --kl-divergence run's
    PPL(Q) and ±, mean / 99th percentile / max KLD and "same top p" (as a fraction)."""
    out: dict = {}
    m = CHUNKS.search(log)
    if m:
        out["chunks"], out["ctx"] = int(m.group(1)), int(m.group(2))
    if kl:
        for key, rx in KL_FIELDS.items():
            m = rx.search(log)
            if m is None:
                sys.exit(f"no {key!r} in llama-perplexity's output of {name}:\n{log[-3000:]}")
            out[key] = float(m.group(1))
            if key == "ppl":
                out["ppl_err"] = float(m.group(2))
        out["top1_agree"] /= 100.0
    else:
        m = FINAL.search(log)
        if m is None:
            sys.exit(f"no final estimate in llama-perplexity's output of {name}:\n{log[-3000:]}")
        out["ppl"], out["ppl_err"] = float(m.group(1)), float(m.group(2))
    return out


def kvtrace_perplexity(gguf: Path, text: Path, ctx: int, chunks: int | None, threads: int, quant: str, kv: str,
                       out: Path) -> dict:
    cmd = [str(Path(sys.executable).parent / "kvtrace"), "perplexity", str(gguf), "--text", str(text), "--ctx",
           str(ctx), "--quant", quant, "--kv-dtype", kv, "--json", str(out), *(["--chunks", str(chunks)] if chunks
                                                                                 else [])]
    say(" ".join(cmd[1:]))
    env = {**__import__("os").environ, "OMP_NUM_THREADS": str(threads)}
    if subprocess.run(cmd, env=env).returncode != 0 or not out.exists():
        sys.exit(f"kvtrace perplexity failed: {' '.join(cmd)}")
    return json.loads(out.read_text())


def table(lc: list[dict], kv: dict) -> str:
    lines = ["| tool | weights / program | ppl | vs own fp32 | mean KL | KL p99 | KL max | same top-1 |",
             "|---|---|---|---|---|---|---|---|"]
    base = lc[0]["ppl"]
    for r in lc:
        kl = ("— | — | — | —" if "kl_mean" not in r else
              f"{r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {r['kl_max']:.3f} | {r['top1_agree']:.2%}")
        lines.append(f"| llama.cpp | {r['model']} | {r['ppl']:.4f} ± {r['ppl_err']:.4f} | {r['ppl'] / base:.4f} | {kl} |")
    ref = kv["rows"][0]["ppl"]
    for r in kv["rows"]:
        kl = ("— | — | — | —" if r["kl_mean"] is None else
              f"{r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {r['kl_max']:.3f} | {r['top1_agree']:.2%}")
        lines.append(f"| kvtrace | {r['name']} | {r['ppl']:.4f} ± {r['ppl_err']:.4f} | {r['ppl'] / ref:.4f} | {kl} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, required=True, help="a UTF-8 text file (e.g. wikitext-2's wiki.test.raw)")
    ap.add_argument("--gguf", type=Path, help="default: the embedded SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None, help="default: every whole chunk of the text")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quant", default="none,gguf,int8,int4")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--peer-formats", default="Q8_0,Q4_0", help="llama.cpp formats to requantize to; '' for none")
    ap.add_argument("--squash-whitespace", action="store_true",
                    help="score the text with every run of whitespace replaced by one space (llama.cpp's tokenizer "
                         "splits some whitespace runs differently from the model's own: on GPL-3's indented text the two "
                         "tools' chunks then hold different tokens from the second chunk on)")
    ap.add_argument("--json", type=Path, default=Path("bench_perplexity.json"))
    args = ap.parse_args()
    if args.squash_whitespace:
        squashed = Path(tempfile.gettempdir()) / f"kvtrace-ppl-{args.text.stem}.squashed.txt"
        squashed.write_text(" ".join(args.text.read_text(encoding="utf-8").split()), encoding="utf-8")
        say(f"{args.text} with its whitespace squashed: {squashed}")
        args.text = squashed

    bin_dir = tools()
    gguf = args.gguf or default_gguf()
    peers = [f.strip() for f in args.peer_formats.split(",") if f.strip()]
    f32 = requantized(bin_dir, gguf, "F32")
    with tempfile.TemporaryDirectory(prefix="kvtrace-ppl-") as tmp:
        base = Path(tmp) / "f32.kld"
        say(f"llama-perplexity {f32.name} (the F32 base; its logits saved)")
        lc = [llama_perplexity(bin_dir, f32, args.text, args.ctx, args.chunks, args.threads, base, kl=False)]
        for model in (gguf, *(requantized(bin_dir, gguf, fmt) for fmt in peers)):
            say(f"llama-perplexity {model.name} --kl-divergence")
            lc.append(llama_perplexity(bin_dir, model, args.text, args.ctx, args.chunks, args.threads, base, kl=True))
    out = args.json.with_suffix(".kvtrace.json")
    kv = kvtrace_perplexity(gguf, args.text, args.ctx, args.chunks, args.threads, args.quant, args.kv_dtype, out)
    if lc[0].get("chunks") != kv["chunks"]:
        say(f"WARNING: llama.cpp scored {lc[0].get('chunks')} chunks, kvtrace {kv['chunks']}: the tokenizations differ")
    text = table(lc, kv)
    print(text)
    args.json.write_text(json.dumps({"command": " ".join(sys.argv), "llama_cpp": SDIST, "gguf": str(gguf),
                                     "text": str(args.text), "ctx": args.ctx, "llama_cpp_rows": lc, "kvtrace": kv,
                                     "table": text}, indent=1))
    say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
