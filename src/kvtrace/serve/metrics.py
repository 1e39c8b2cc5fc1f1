"""Prometheus text exposition (format 0.0.4) of the server's counters, gauges and histograms.

Small on purpose: a handful of series, updated from the model thread and the HTTP handlers under one lock,
rendered on ``GET /metrics``. Names are prefixed ``kvtrace_``.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import ClassVar

__all__ = ["LATENCY_BUCKETS", "Metrics"]

# seconds: prefill of a long prompt on a CPU takes a second or more; a decode step tens of milliseconds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket (+Inf only)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.n += 1


class Metrics:
    """The server's series. ``gauges``: name -> a callable read at render time (queue depth, active slots)."""

    HELP: ClassVar[dict[str, tuple[str, str]]] = {
        "requests_total": ("counter", "HTTP requests answered, by endpoint and status code"),
        "prompt_tokens_total": ("counter", "prompt tokens received (prefilled, or kept from a slot's cache)"),
        "prompt_tokens_cached_total": ("counter", "prompt tokens a slot's cache already held (the prefix cache): "
                                                  "not prefilled"),
        "completion_tokens_total": ("counter", "tokens generated"),
        "prefill_seconds": ("histogram", "time of one prefill call (a prompt, or one chunk of it with --prefill-chunk, into its slot)"),
        "decode_step_seconds": ("histogram", "time of one decode step (one token for every active slot)"),
        "time_to_first_token_seconds": ("histogram", "request received to first token"),
        "decode_batch_rows": ("histogram", "active slots decoded per step"),
    }

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]] | None = None, n_slots: int = 1):
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        rows = tuple(float(i) for i in range(1, n_slots + 1))
        self._hist = {"prefill_seconds": _Histogram(LATENCY_BUCKETS),
                      "decode_step_seconds": _Histogram(LATENCY_BUCKETS),
                      "time_to_first_token_seconds": _Histogram(LATENCY_BUCKETS),
                      "decode_batch_rows": _Histogram(rows)}
        self._gauges = dict(gauges or {})

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._hist[name].observe(value)

    def counter(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def histogram_count(self, name: str) -> int:
        with self._lock:
            return self._hist[name].n

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            counters = dict(self._counters)
            hists = {k: (h.buckets, list(h.counts), h.sum, h.n) for k, h in self._hist.items()}
        for name in ("requests_total", "prompt_tokens_total", "prompt_tokens_cached_total", "completion_tokens_total"):
            kind, text = self.HELP[name]
            lines += [f"# HELP kvtrace_{name} {text}", f"# TYPE kvtrace_{name} {kind}"]
            series = [(labels, v) for (n, labels), v in sorted(counters.items()) if n == name] or [((), 0.0)]
            for labels, v in series:
                lines.append(f"kvtrace_{name}{_labels(labels)} {_num(v)}")
        for name, (text, read) in self._gauges.items():
            lines += [f"# HELP kvtrace_{name} {text}", f"# TYPE kvtrace_{name} gauge", f"kvtrace_{name} {_num(read())}"]
        for name, (buckets, counts, total, n) in hists.items():
            kind, text = self.HELP[name]
            lines += [f"# HELP kvtrace_{name} {text}", f"# TYPE kvtrace_{name} histogram"]
            cum = 0
            for b, c in zip(buckets, counts, strict=False):
                cum += c
                lines.append(f'kvtrace_{name}_bucket{{le="{_num(b)}"}} {cum}')
            lines += [f'kvtrace_{name}_bucket{{le="+Inf"}} {n}', f"kvtrace_{name}_sum {_num(total)}",
                      f"kvtrace_{name}_count {n}"]
        return "\n".join(lines) + "\n"


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels) + "}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
