"""Lint's vocabulary: the finding kinds, the scenario's shape, ``Finding`` and ``LintReport``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

__all__ = ["EXPECTED_PROGRAMS", "KINDS", "SCENARIO", "Finding", "LintReport"]

KINDS = ("recapture", "specialization", "baked-constant", "sliding", "mutation", "mismatch", "error")
# (prompt length, then tokens added to the filled cache): every length and start position differs.
# (prompt tokens, then new tokens): a decode, an extend, and the shortest lengths (T = 1, P = 1).
SCENARIO = ((5, 1), (9, 3), (1, 1))
# One program per cache kind and size class of (T, P) (kvtrace.runtime.jit.CallKey.sizes: torch.export specialises
# sizes 0 and 1): the scenario's classes are fresh T >= 2, fresh T = 1, decode T = 1 at P >= 2 and at P = 1,
# extend T >= 2 at P >= 2.
EXPECTED_PROGRAMS = len({(p == 0, min(t, 2), min(p, 2)) for prompt, more in SCENARIO
                         for t, p in ((prompt, 0), (more, prompt))})


@dataclass(frozen=True)
class Finding:
    kind: str  # one of KINDS
    message: str
    where: str = ""  # source line / FX node / scenario call it comes from

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}" + (f"\n    at {self.where}" if self.where else "")


@dataclass(frozen=True)
class LintReport:
    model: str
    calls: tuple[str, ...]  # the scenario, one description per call
    captures: int  # programs kvtrace.jit captured over the scenario
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    # programs the scenario must capture: EXPECTED_PROGRAMS, plus the sliding phase's (sliding.expected_programs)
    expected: int = EXPECTED_PROGRAMS

    @property
    def ok(self) -> bool:
        return not self.findings

    passed = ok

    def of_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def lines(self) -> list[str]:
        head = (f"kvtrace lint {self.model}: {len(self.calls)} calls, {self.captures} program(s) captured "
                f"(expected {self.expected}): ")
        if self.ok:
            return [head + "no findings"]
        return [head + f"{len(self.findings)} finding(s)", *(str(f) for f in self.findings)]

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "ok": self.ok, "calls": list(self.calls), "captures": self.captures,
                           "expected": self.expected, "findings": [dataclasses.asdict(f) for f in self.findings]}, indent=2)

