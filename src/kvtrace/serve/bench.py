"""``kvtrace bench --serve``: throughput and latency of ``kvtrace serve`` under 1, 2, 4, 8 concurrent clients.

The server runs in its own process (``python -m kvtrace.cli serve ARTIFACT``), as a user runs it, on the
model's slots artifact (``--slots`` = the most clients); the clients are asyncio HTTP streams in this process.
Each level runs C clients, each sending R requests one after another (closed loop); every request is a
streamed chat completion of exactly N new tokens (temperature 0, ``ignore_eos``), prompts differing by client.

Per level: aggregate tokens/s (the level's completion tokens / its wall time, prefills included); the
server's decode throughput (the tokens its decode steps produced / the time spent in them, from its /metrics:
what batching the decode steps buys, without the prefills that pause them) and the share of the wall time
spent in prefills; each
request's decode tokens/s (tokens after the first / first-to-last token time), p50/p95 time to first token
and inter-token latency, and mismatches: answers that differ from a solo Session run of the same prompt
(the batch-1 artifact, in this process, after the server has stopped). The baseline is ``kvtrace run`` on the
batch-1 artifact: its decode tokens/s, in fresh processes, before the server starts and again after it has
stopped (the median of both: these machines drift by 10 % within minutes, and the levels run in between).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtrace._errors import UsageError
from kvtrace.serve import SERVE_BACKEND

__all__ = ["PROMPTS", "LevelResult", "render_markdown", "run_serve_bench"]

PROMPTS = (
    "Who's the founder of Meta?",
    "Explain what a KV cache is in two sentences.",
    "Write a haiku about the sea.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List three uses of a hash map.",
    "How do plants make food?",
    "Give me a short tip for learning to cook.",
    "Why is the sky blue?",
)


@dataclass
class LevelResult:
    clients: int
    requests: int
    tokens: int
    seconds: float
    aggregate_tok_s: float
    vs_one_client: float = 0.0
    decode_tok_s_p50: float = 0.0  # per request
    ttft_ms_p50: float = 0.0
    ttft_ms_p95: float = 0.0
    itl_ms_p50: float = 0.0
    itl_ms_p95: float = 0.0
    decode_step_tok_s: float = 0.0  # the server's decode steps: rows decoded / seconds in decode steps
    decode_step_vs_one_client: float = 0.0
    mean_rows: float = 0.0  # active slots per decode step
    prefill_share: float = 0.0  # seconds in prefills / wall seconds
    mismatches: int = 0
    texts: dict[str, str] = field(default_factory=dict, repr=False)  # prompt -> answer (the first one seen)
    all_texts: list[tuple[str, str]] = field(default_factory=list, repr=False)


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def _request(client: Any, url: str, prompt: str, n: int) -> dict[str, Any]:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    parts: list[str] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise UsageError(f"the server answered {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for ch in obj.get("choices", ()):
                text = ch["delta"].get("content")
                if text:
                    times.append(time.perf_counter())
                    parts.append(text)
    itl = [b - a for a, b in itertools.pairwise(times)]
    decode = (tokens - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return {"prompt": prompt, "text": "".join(parts), "tokens": tokens, "ttft": times[0] - t0 if times else 0.0,
            "itl": itl, "decode_tok_s": decode}


async def _level(url: str, clients: int, per_client: int, n: int, prompts: Sequence[str]) -> LevelResult:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 2)) as client:
        async def one_client(i: int) -> list[dict[str, Any]]:
            return [await _request(client, url, prompts[(i * per_client + j) % len(prompts)], n)
                    for j in range(per_client)]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one_client(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    rs = [r for client in done for r in client]
    tokens = sum(r["tokens"] for r in rs)
    texts: dict[str, str] = {}
    for r in rs:
        texts.setdefault(r["prompt"], r["text"])
    return LevelResult(
        clients=clients, requests=len(rs), tokens=tokens, seconds=round(wall, 3),
        aggregate_tok_s=round(tokens / wall, 2),
        decode_tok_s_p50=round(_pct([r["decode_tok_s"] for r in rs], 0.5), 2),
        ttft_ms_p50=round(_pct([r["ttft"] for r in rs], 0.5) * 1e3, 1),
        ttft_ms_p95=round(_pct([r["ttft"] for r in rs], 0.95) * 1e3, 1),
        itl_ms_p50=round(_pct([x for r in rs for x in r["itl"]], 0.5) * 1e3, 1),
        itl_ms_p95=round(_pct([x for r in rs for x in r["itl"]], 0.95) * 1e3, 1),
        texts=texts, all_texts=[(r["prompt"], r["text"]) for r in rs])


_SUMS = ("decode_step_seconds_sum", "decode_batch_rows_sum", "decode_batch_rows_count", "prefill_seconds_sum")


def _server_sums(url: str) -> dict[str, float]:
    """The server's cumulative decode-step and prefill totals (Prometheus text of GET /metrics)."""
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.removeprefix("kvtrace_") in _SUMS:
            out[name.removeprefix("kvtrace_")] = float(value)
    missing = sorted(set(_SUMS) - set(out))
    if missing:
        raise UsageError(f"the server's /metrics lacks {missing}")
    return out


def _add_server_side(lv: LevelResult, before: dict[str, float], after: dict[str, float]) -> None:
    d = {k: after[k] - before[k] for k in _SUMS}
    if d["decode_step_seconds_sum"] > 0:
        lv.decode_step_tok_s = round(d["decode_batch_rows_sum"] / d["decode_step_seconds_sum"], 2)
    if d["decode_batch_rows_count"] > 0:
        lv.mean_rows = round(d["decode_batch_rows_sum"] / d["decode_batch_rows_count"], 2)
    lv.prefill_share = round(d["prefill_seconds_sum"] / lv.seconds, 3) if lv.seconds else 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise UsageError(f"the server exited with code {proc.returncode} before it answered /health")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise UsageError(f"the server did not answer {url}/health within {timeout:.0f}s")


def _stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a server process (it answers what is in flight "shutting down"), SIGKILL it after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _run_baseline(path: Path, prompt: str, max_len: int, runs: int, env: dict[str, str],
                  extra: Sequence[str] = ()) -> list[float]:
    """``kvtrace run`` decode tokens/s, one fresh process per run (``extra``: more of its flags)."""
    out = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-m", "kvtrace.cli", "run", str(path), "--prompt", prompt,
                               "--max-len", str(max_len), "--json", "--quiet", *extra], capture_output=True, text=True,
                              check=False, env=env)
        if proc.returncode != 0:
            raise UsageError(f"kvtrace run failed: {proc.stderr.strip()[-300:]}")
        out.append(float(json.loads(proc.stdout.strip().splitlines()[-1])["decode_tokens_per_s"]))
    return out


def run_serve_bench(model: str | None = None, *, clients: Sequence[int] = (1, 2, 4, 8), requests_per_client: int = 2,
                    new_tokens: int = 128, max_seq_len: int = 1024, backend: str = SERVE_BACKEND, baseline_runs: int = 3,
                    check: bool = True, threads: int | None = None, huge_pages: bool = False,
                    kv_dtype: str | None = None, quant: str | None = None,
                    progress: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Measure ``kvtrace serve`` (see the module docstring); returns a JSON-able dict with ``levels``.
    ``threads``: torch threads of the server and baseline processes (OMP_NUM_THREADS; None: torch's default);
    ``huge_pages``: both load the artifact with ``--huge-pages``; ``kv_dtype`` ("int8"): both artifacts (the
    served one and the batch-1 one of the baseline and the reference answers) hold that cache; ``quant`` ("int8",
    ...): both hold weights quantized so (``export``'s ``quant``)."""
    import contextlib

    import torch

    from kvtrace.artifact.store import cached_artifact

    progress = progress or (lambda what: contextlib.nullcontext())
    slots = max(clients)
    with progress("building the batch-1 and slots artifacts (cached)"):
        plain = cached_artifact(model, backend=backend, max_seq_len=max_seq_len, progress=None, kv_dtype=kv_dtype,
                                quant=quant)
        served = cached_artifact(model, backend=backend, max_seq_len=max_seq_len, slots=slots if slots > 1 else None,
                                 progress=None, kv_dtype=kv_dtype, quant=quant)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({} if threads is None else {"OMP_NUM_THREADS": str(threads)})}
    extra = ["--huge-pages"] if huge_pages else []
    def baseline() -> list[float]:
        return _run_baseline(plain.path, PROMPTS[0], max_len=min(max_seq_len, 64 + new_tokens), runs=baseline_runs,
                             env=env, extra=extra)

    with progress(f"baseline: kvtrace run x{baseline_runs} (fresh processes)"):
        base = baseline()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace.cli", "serve", str(served.path), "--port", str(port),
                             "--quiet", "--queue", str(4 * slots), *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    levels: list[LevelResult] = []
    try:
        with progress("starting kvtrace serve"):
            _wait_healthy(url, proc)
            asyncio.run(_level(url, 1, 1, 8, PROMPTS))  # warm-up
        for c in clients:
            with progress(f"{c} client(s) x {requests_per_client} request(s) of {new_tokens} tokens"):
                before = _server_sums(url)
                levels.append(asyncio.run(_level(url, c, requests_per_client, new_tokens, PROMPTS)))
                _add_server_side(levels[-1], before, _server_sums(url))
    finally:
        _stop_server(proc)
    with progress(f"baseline again: kvtrace run x{baseline_runs} (fresh processes)"):
        base += baseline()
    one = levels[0].aggregate_tok_s if levels else 0.0
    one_step = levels[0].decode_step_tok_s if levels else 0.0
    for lv in levels:
        lv.vs_one_client = round(lv.aggregate_tok_s / one, 2) if one else 0.0
        lv.decode_step_vs_one_client = round(lv.decode_step_tok_s / one_step, 2) if one_step else 0.0
    refs: dict[str, str] = {}
    from kvtrace.artifact.archive import load

    art = load(plain.path)  # after the levels: the batch-1 artifact, its cache spec and the reference answers
    served_cache = dataclasses.replace(art.cache_spec, batch_size=slots).nbytes()  # the server's cache: one row a slot
    if check:
        from kvtrace.runtime.generate import generate
        from kvtrace.sources.chat import encode_prompt

        with progress("solo runs of every prompt (the reference answers)"):
            tok, m = art.tokenizer(), art.manifest
            for p in {p for lv in levels for p, _ in lv.all_texts}:
                ids = encode_prompt(tok, p, chat=True, template=m.chat_template, bos_id=m.bos_id, eos_ids=m.eos_ids)
                refs[p] = generate(art.session(), ids, max_new_tokens=new_tokens,
                                   decode_text=lambda t: tok.decode(t, skip_special_tokens=True)).text
        for lv in levels:
            lv.mismatches = sum(text != refs[p] for p, text in lv.all_texts)
    baseline = statistics.median(base)
    return {
        "model": model or "smollm2-135m-instruct", "backend": backend, "slots": slots, "new_tokens": new_tokens,
        "requests_per_client": requests_per_client, "max_seq_len": max_seq_len,
        "threads": threads if threads is not None else torch.get_num_threads(), "huge_pages": huge_pages,
        "kv_dtype": kv_dtype, "quant": quant, "served_cache_mib": round(served_cache / 2**20, 3),
        "kvtrace_run_decode_tok_s": round(baseline, 2), "kvtrace_run_runs": [round(b, 2) for b in base],
        "single_client_decode_vs_run": round(levels[0].decode_tok_s_p50 / baseline, 3) if levels and baseline else None,
        "checked_against_solo": check,
        "levels": [{k: v for k, v in asdict(lv).items() if k not in ("texts", "all_texts")} for lv in levels],
    }


def render_markdown(data: dict[str, Any]) -> str:
    head = ("| clients | requests | tokens | wall s | aggregate tok/s | x 1 client | server decode tok/s (rows/step) "
            "| x 1 client | prefill share | decode tok/s per request (p50) "
            "| TTFT p50 / p95 ms | inter-token p50 / p95 ms | mismatches |")
    rows = [head, "|" + "---|" * 13]
    for lv in data["levels"]:
        rows.append(f"| {lv['clients']} | {lv['requests']} | {lv['tokens']} | {lv['seconds']:.1f} | "
                    f"{lv['aggregate_tok_s']:.1f} | {lv['vs_one_client']:.2f} | "
                    f"{lv['decode_step_tok_s']:.1f} ({lv['mean_rows']:.1f}) | {lv['decode_step_vs_one_client']:.2f} | "
                    f"{lv['prefill_share']:.2f} | {lv['decode_tok_s_p50']:.1f} | "
                    f"{lv['ttft_ms_p50']:.0f} / {lv['ttft_ms_p95']:.0f} | {lv['itl_ms_p50']:.1f} / "
                    f"{lv['itl_ms_p95']:.1f} | {lv['mismatches'] if data['checked_against_solo'] else '-'} |")
    rows.append("")
    rows.append(f"`kvtrace run` decode: {data['kvtrace_run_decode_tok_s']:.1f} tok/s (median of "
                f"{data['kvtrace_run_runs']}); one client through the server: "
                f"{data['single_client_decode_vs_run']}x of it. {data['model']}, {data['backend']}, "
                f"{data.get('quant') or 'unquantized'} weights, "
                f"{data['slots']} slots ({data.get('kv_dtype') or 'model-dtype'} KV cache, "
                f"{data.get('served_cache_mib', '?')} MiB), {data['new_tokens']} tokens per request, "
                f"{data['threads']} threads.")
    return "\n".join(rows)
