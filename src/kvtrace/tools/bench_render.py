"""kvtrace bench's tables and plot: a ``run_bench`` result as a rich Table, Markdown text or a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtrace._errors import UsageError

__all__ = ["COLUMNS", "plot", "render", "render_markdown"]


COLUMNS = ("backend", "dtype", "quant", "kv", "prompt", "compile s", "prefill ms", "decode tok/s", "x hf-eager", "of bound",
           "GB/s", "MB/token", "artifact MiB", "peak RSS MiB", "recompiles", "tokens = eager", "measured in")
_HEAD = 5  # backend, dtype, quant, kv, prompt: shown for an error row too


def _rows(data: dict[str, Any]) -> list[tuple[list[str], str]]:
    """(cells, error) per result, cells in ``COLUMNS`` order (blank but the first ``_HEAD`` for an error)."""
    out = []
    for r in data["results"]:
        head = [r["backend"], r["dtype"], r.get("quant", "none"), r.get("kv_dtype", "auto"), str(r["prompt_len"])]
        if r["error"]:
            out.append((head + [""] * (len(COLUMNS) - _HEAD), r["error"]))
            continue
        lo, hi = r["decode_tok_s_range"]
        out.append(([
            *head, f"{r['compile_s']:.1f}", f"{r['prefill_ms']:.1f}", f"{r['decode_tok_s']:.1f} ({lo:.1f}-{hi:.1f})",
            f"{r['vs_hf_eager']:.2f}" if r["vs_hf_eager"] else "",
            f"{r['bound_fraction']:.2f}" if r["bound_fraction"] is not None else "",
            f"{r['bandwidth_gb_s']:.1f}" if r.get("bandwidth_gb_s") else "",
            f"{r['bytes_per_token'] / 1e6:.0f}" if r.get("bytes_per_token") else "",
            f"{r['artifact_mib']:.0f}" if r.get("artifact_mib") is not None else "–", f"{r['peak_rss_mib']:.0f}",
            str(r["recompiles"]), "yes" if r["tokens_match_eager"] else f"no (at {r['first_mismatch']})",
            r.get("measured_in", "this process"),
        ], ""))
    return out


def _title(data: dict[str, Any]) -> str:
    device = data.get("device", "cpu")
    if device.startswith("cuda"):
        return (f"kvtrace bench on {device} (device-copy bandwidth {data['bandwidth_gb_s']} GB/s at the start, read + "
                "written; each row's bound uses the bandwidth measured around it)")
    return (f"kvtrace bench (read bandwidth {data['bandwidth_gb_s']} GB/s at the start, {data['threads']} threads; each "
            "row's bound uses the bandwidth measured around it)")


def render(data: dict[str, Any]) -> Any:
    """A rich Table (for a terminal)."""
    from rich.table import Table

    t = Table(title=_title(data))
    for col in COLUMNS:
        t.add_column(col)
    for cells, error in _rows(data):
        if error:
            cells = [*cells[:_HEAD], "", "", f"[red]{error[:60]}[/red]", *cells[_HEAD + 3:]]
        t.add_row(*cells)
    return t


def render_markdown(data: dict[str, Any]) -> str:
    """The same table as Markdown text, full width: for logs and pipes, where a terminal table truncates."""
    lines = [_title(data), "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for cells, error in _rows(data):
        if error:
            cells = [*cells[:_HEAD], f"error: {error}".replace("|", "/"), *cells[_HEAD + 1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: str | Path) -> None:
    """PNG: decode tokens/s against context position, one line per backend and dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from e
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in data["results"]:
        if r["position_sweep"]:
            xs, ys = zip(*r["position_sweep"], strict=True)
            quant = '' if r.get('quant', 'none') == 'none' else f" {r['quant']}"
            kv = '' if r.get('kv_dtype', 'auto') == 'auto' else f" kv {r['kv_dtype']}"
            ax.plot(xs, ys, marker="o", label=f"{r['backend']} {r['dtype']}{quant}{kv}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context position")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"kvtrace bench ({data['threads']} threads, read bandwidth {data['bandwidth_gb_s']} GB/s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
