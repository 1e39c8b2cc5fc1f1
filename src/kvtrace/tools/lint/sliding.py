"""Lint's sliding-window phase: a cache whose window got baked, or that grows unbounded.

Run when the model's config declares sliding-attention layers (``layer_types`` / ``sliding_window``): on a
``DynamicCache(config=model.config)`` (transformers' own sliding layers, holding the last W - 1 tokens) the
phase crosses the window token by token and then wraps it with an extend longer than the window::

    prefill max(2, W - 2) tokens   decode 1 token x 3 (positions W - 2, W - 1, W: the crossing)
    extend by W + 1 tokens         decode 1 token      extend by 3 tokens      decode 1 token

every call checked against eager like the main scenario (``_Runner``), and reports, as kind ``sliding``:

* a program captured again for a size class of (T, P) the phase already has one for: something in the
  capture (the model's code or the jit) treated the window, or the past length relative to it, as a
  constant, so crossing it needed another program (zero recompiles across the window is the rule);
* a sliding layer of eager's cache or of the caller's cache after the jitted call holding anything but
  the last ``min(P, W - 1)`` tokens: the cache grows unbounded (logits can still match eager's; only the
  cache contents show it: the transformers bug this check exists for).
"""

from __future__ import annotations

from typing import Any

from kvtrace.spec import config as hfconfig
from kvtrace.tools.lint.report import Finding

__all__ = ["sliding_phase", "sliding_steps", "windows"]


def windows(config: Any) -> dict[int, int]:
    """Model layer -> its sliding window W, for the layers the config declares sliding (empty: none)."""
    cfg = hfconfig.text_config(config)
    window = hfconfig.sliding_window(cfg)
    if not window:
        return {}
    return {i: window for i, t in enumerate(hfconfig.layer_types(cfg)) if t == hfconfig.SLIDING_ATTENTION}


def sliding_steps(window: int) -> list[tuple[int, str]]:
    """(new tokens, description) per call of the phase; the cache is fresh before the first."""
    p0 = max(2, window - 2)
    steps = [(p0, f"prefill {p0} tokens on a fresh DynamicCache(config=model.config) (sliding window {window})")]
    past = p0
    for n in (1, 1, 1, window + 1, 1, 3, 1):
        what = "decode 1 token" if n == 1 else f"extend by {n} tokens"
        note = " (crossing the window)" if past < window <= past + n else (" (wraps the window)" if n > window else "")
        steps.append((n, f"{what} at position {past}{note}"))
        past += n
    return steps


def _held(layer: Any) -> int | None:
    keys = getattr(layer, "keys", None)
    return None if keys is None or not hasattr(keys, "shape") or keys.dim() < 3 else int(keys.shape[-2])


def _unbounded(who: str, cache: Any, wins: dict[int, int], past: int, where: str) -> Finding | None:
    """One finding for the sliding layers of ``cache`` not holding the last min(P, W - 1) tokens, or None."""
    layers = getattr(cache, "layers", ())
    wrong = [(i, _held(layers[i]), min(past, w - 1), w) for i, w in wins.items() if i < len(layers)]
    wrong = [x for x in wrong if x[1] is not None and x[1] != x[2]]
    if not wrong:
        return None
    i, held, want, window = wrong[0]
    grows = " — the cache grows unbounded" if held > want else ""
    return Finding(
        "sliding",
        f"{who} cache layer{'s' if len(wrong) > 1 else ''} {', '.join(str(x[0]) for x in wrong)} "
        f"({type(layers[i]).__name__}) hold{'' if len(wrong) > 1 else 's'} {held} tokens at position {past}; a "
        f"sliding window of {window} keeps the last {want}{grows} (logits can still match: only the cache "
        f"contents show it)", where)


def sliding_phase(run: Any, config: Any, first_call: int) -> list[Finding]:
    """Run the phase with ``run`` (scenario's ``_Runner``) when ``config`` declares sliding layers; the
    sliding findings (the runner adds mutation / mismatch / error ones itself). ``first_call``: calls so far."""
    from transformers import DynamicCache

    wins = windows(config)
    if not wins:
        return []
    window = min(wins.values())
    findings: list[Finding] = []
    seen: dict[Any, Any] = {}  # size classes -> the first program key the phase captured for them
    flagged: set[str] = set()  # whose cache was already reported
    cache: Any = DynamicCache(config=config)
    past = 0
    for j, (n, desc) in enumerate(sliding_steps(window)):
        where = f"call {first_call + j + 1} of the lint scenario ({desc})"
        cache, keys = run.call(n, past, desc, cache, where)
        past += n
        for key in keys:
            first = seen.setdefault(key.sizes, key)
            if first is not key:
                findings.append(Finding(
                    "sliding",
                    f"another {key.cache.value} program was captured for T/P size class {key.sizes} at position "
                    f"{past - n}: the sliding window ({window}) or the past length relative to it got baked into the "
                    f"first one", where))
        for who, c in (("eager's", run.eager_cache), ("the caller's", cache)):
            found = _unbounded(who, c, wins, past, where) if who not in flagged else None
            if found is not None:  # the first call it shows in; later ones only repeat it
                flagged.add(who)
                findings.append(found)
    return findings
