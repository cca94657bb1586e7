"""The words result.json's verdicts are read by, importable without torch or the layers (what
`python -m launcher.compare` and a sweep's summary read a finished run with):

DIAGNOSTIC, the key that makes a check a measurement (`tolerance.<tensor>.diagnostic=true`,
and the flag its verdict carries); `fails_the_run`, whether a verdict decides the run; and
CHECKS, the integrity checks' names in the order `launcher.verify.integrity` runs them.
"""

from __future__ import annotations

DIAGNOSTIC = "diagnostic"

CHECKS = ("written_rows", "stale_values", "finite", "cap", "concentration")


def fails_the_run(verdict: dict) -> bool:
    """A verdict that decides the run: failed, and not made diagnostic."""
    return not verdict["passed"] and not verdict.get(DIAGNOSTIC)
