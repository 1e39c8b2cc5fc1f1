"""kvtrace lint: will a model capture cleanly under ``kvtrace.jit``, for every length, without side effects?

``lint(model)`` drives ``kvtrace.jit(model, backend="eager")`` through a fixed scenario that changes
every length within the programs a correct model needs: one per cache kind (fresh or filled
DynamicCache) and size class of T and P (1, or >= 2: torch.export specialises size 1, see
``kvtrace.runtime.jit.CallKey.sizes``)::

    call 1  prefill 5 tokens on a fresh DynamicCache      -> captures the "dynamic-fresh" program (T>=2)
    call 2  decode 1 token at position 5                   -> captures the "dynamic" program (T=1)
    call 3  prefill 9 tokens on another fresh DynamicCache -> must reuse program 1
    call 4  extend by 3 tokens at position 9               -> captures the "dynamic" program (T>=2)
    call 5  prefill 1 token on a fresh DynamicCache        -> captures the "dynamic-fresh" program (T=1)
    call 6  decode 1 token at position 1                   -> captures the "dynamic" program (T=1, P=1)

and reports, as ``Finding(kind, message, where)``:

* ``recapture``      a call captured a program beyond those (EXPECTED_PROGRAMS), or jit had to pin a length;
* ``specialization`` a guard or a constant shape in a captured program refuses a sequence length or
                     position it must accept (any T and P of its size class and sliding regime; checked against
                     the program's placeholders, range constraints and runtime asserts, and the guards
                     torch.export logged, with the source line that added them), or the graph's
                     structure changes with the length;
* ``baked-constant`` a literal in the graph (or a lifted constant tensor) that changes when the same
                     program is captured with other example lengths: a length or position baked in;
* ``sliding``        (models with sliding-window layers, after the scenario: a phase on
                     ``DynamicCache(config=model.config)`` that crosses and then wraps the window) crossing
                     the window captured another program than one per sliding regime and size class
                     (``sliding.expected_programs``; the window or the past length relative to it got
                     baked), or a sliding layer of eager's or the caller's cache holds more (or other) than
                     the last ``min(P, W - 1)`` tokens: it grows unbounded;
* ``mutation``       the call left the caller's cache, inputs or model different from what eager leaves
                     (or, when it failed, different from before the call);
* ``mismatch``       the logits differ from eager's beyond the dtype's tolerance;
* ``error``          a call raised (e.g. a captured program refused a length it had guarded on).

``where`` is as precise as the engine allows: the source line that added a guard, the FX node name
and the innermost frame of its ``stack_trace``, or the call of the scenario.

Modules: ``report`` (KINDS, SCENARIO, EXPECTED_PROGRAMS, Finding, LintReport), ``scenario`` (``lint``,
``run_cli_lint``: the scenario driver), ``guards`` (what torch.export logged; guards and shapes against the
lengths a program must accept), ``graph_diff`` (a program captured again with other lengths, compared),
``mutation`` (the caller's cache, inputs and model against eager's), ``sliding`` (the sliding-window
phase), ``jit_view`` (the only module that
reads ``kvtrace.runtime.jit`` internals; its docstring lists them).
"""

from __future__ import annotations

from kvtrace.tools.lint.report import EXPECTED_PROGRAMS, KINDS, SCENARIO, Finding, LintReport
from kvtrace.tools.lint.scenario import lint, run_cli_lint

__all__ = ["EXPECTED_PROGRAMS", "KINDS", "SCENARIO", "Finding", "LintReport", "lint", "run_cli_lint"]
