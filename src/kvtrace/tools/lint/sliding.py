"""Lint's sliding-window phase: a cache whose window got baked, or that grows unbounded.

Run when the model's config declares sliding-attention layers (``layer_types`` / ``sliding_window``): on a
``DynamicCache(config=model.config)`` (transformers' own sliding layers, holding the last W - 1 tokens) the
phase crosses the window token by token and then wraps it with an extend longer than the window::

    prefill max(2, W - 2) tokens   decode 1 token x 3 (positions W - 2, W - 1, W: the crossing)
    extend by W + 1 tokens         decode 1 token      extend by 3 tokens      decode 1 token

every call checked against eager like the main scenario (``_Runner``), and reports, as kind ``sliding``:

* a program captured again for a size class of (T, P) and sliding regime the phase already has one for, or
  more programs than ``expected_programs``: something in the capture (the model's code or the jit) treated
  the window, or the past length relative to it, as a constant, so crossing it needed another program
  (zero recompiles across the window is the rule). The phase's calls reach, for a window W >= 4 (the
  regimes of ``kvtrace.runtime.jit_call.sliding_regime``; S = min(P, W - 1) the stored tail)::

      fresh T >= 2, filling (P + T < W - 1)   the prefill of max(2, W - 2) tokens (W = 4: T = 2 < 3)
      T = 1, reaching (P + T = W - 1)          the decode at P = W - 2
      T = 1, crossing (P < W <= P + T)         the decode at P = W - 1
      T = 1, full (P >= W)                     the decodes at P = W and later
      T >= 2, full                             the two extends

  five programs, one per (regime x size class), symbolic in every length within it (``expected_programs``);
* a sliding layer of eager's cache or of the caller's cache after the jitted call holding anything but
  the last ``min(P, W - 1)`` tokens: the cache grows unbounded (logits can still match eager's; only the
  cache contents show it: the transformers bug this check exists for).
"""

from __future__ import annotations

from typing import Any

from kvtrace.spec import config as hfconfig
from kvtrace.tools.lint import jit_view
from kvtrace.tools.lint.report import Finding

__all__ = ["expected_programs", "sliding_phase", "sliding_recapture_lengths", "sliding_steps", "windows"]


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


def _classes(config: Any) -> list[tuple[bool, tuple[int, int], str]]:
    """Per call of the phase: (fresh cache, size classes of (T, P), sliding regime): what keys its program."""
    wins = windows(config)
    if not wins:
        return []
    per_layer = tuple(wins.get(i, 0) for i in range(max(wins) + 1))
    out, past = [], 0
    for n, _ in sliding_steps(min(wins.values())):
        out.append((past == 0, (min(n, 2), min(past, 2)), jit_view.regime(n, past, per_layer)))
        past += n
    return out


def expected_programs(config: Any) -> int:
    """Programs the phase must capture: one per (fresh or filled cache, size classes, regime) its calls reach
    (5 for one window W >= 4, see the module docstring); 0 without sliding layers."""
    return len(set(_classes(config)))


def sliding_recapture_lengths(key: Any, target: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """For the graph comparison of a program of ``key`` (a key with sliding layers): the (T, P) jit captured it
    with, and another pair of its regime and size classes nearest ``target`` (T, P), differing in every
    length that has room to; None when the regime holds no other pair."""
    first = jit_view.sliding_example_lengths(key)
    other = None if first is None else jit_view.sliding_example_lengths(key, target, avoid=first)
    return None if first is None or other is None else (first, other)


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
    seen: dict[Any, Any] = {}  # (cache kind, size classes, regime) -> the first program key captured for them
    captures = run.jm.stats.captures
    flagged: set[str] = set()  # whose cache was already reported
    cache: Any = DynamicCache(config=config)
    past = 0
    for j, (n, desc) in enumerate(sliding_steps(window)):
        where = f"call {first_call + j + 1} of the lint scenario ({desc})"
        cache, keys = run.call(n, past, desc, cache, where)
        past += n
        for key in keys:
            first = seen.setdefault((key.cache, key.sizes, key.regime), key)
            if first is not key:
                findings.append(Finding(
                    "sliding",
                    f"another {key.cache.value} program was captured for T/P size class {key.sizes} in the "
                    f"{key.regime or 'same'} regime at position {past - n}: the sliding window ({window}) or the past "
                    f"length relative to it got baked into the first one", where))
        for who, c in (("eager's", run.eager_cache), ("the caller's", cache)):
            found = _unbounded(who, c, wins, past, where) if who not in flagged else None
            if found is not None:  # the first call it shows in; later ones only repeat it
                flagged.add(who)
                findings.append(found)
    captured, expected = run.jm.stats.captures - captures, expected_programs(config)
    if captured > expected:
        findings.append(Finding(
            "sliding", f"{captured} programs captured over the sliding-window phase; expected {expected} (one per "
            "regime of the window and size class of T and P, whatever the lengths within it)", "kvtrace.jit stats"))
    return findings
