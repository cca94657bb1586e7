"""The words result.json's verdicts are read by, importable without torch or the layers (what
`python -m launcher.compare` and a sweep's summary read a finished run with):

DIAGNOSTIC, the key that makes a check a measurement (`tolerance.<tensor>.diagnostic=true`,
and the flag its verdict carries); `fails_the_run`, whether a verdict decides the run;
`run_passes`, the one rule of a run's `passed` (the ranks' broadcast verdict and result.json's); and
CHECKS, the integrity checks' names in the order `launcher.verify.integrity` runs them.
"""

from __future__ import annotations

DIAGNOSTIC = "diagnostic"

CHECKS = ("written_rows", "stale_values", "finite", "cap", "concentration")


def fails_the_run(verdict: dict) -> bool:
    """A verdict that decides the run: failed, and not made diagnostic."""
    return not verdict["passed"] and not verdict.get(DIAGNOSTIC)


def run_passes(verdicts: list[dict], integrity_checks: list[dict]) -> bool | None:
    """The one rule of a run's `passed`: no reference verdict fails the run (a diagnostic one
    never does) and every integrity check passed. None where no check counts (every verdict
    diagnostic, no integrity check): UNCHECKED, which never reads as passed."""
    if not integrity_checks and all(v.get(DIAGNOSTIC) for v in verdicts):
        return None
    return not any(fails_the_run(v) for v in verdicts) and all(c["passed"] for c in integrity_checks)
