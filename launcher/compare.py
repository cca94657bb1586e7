"""`python -m launcher.compare BASELINE CANDIDATE`: regression tracking between two runs or sweeps.

Each argument is a run folder (with result.json) or a sweep folder (with summary.json or
sweep.json). Jobs are matched by case, whatever implementation ran them, and compared:
verdicts, each tensor's max |diff|, benchmark medians (`launcher.report.regressions`).

Exit status: 0 no regression, 1 a regression, 2 an error: a folder or result that cannot be
read (a result.json of another schema_version included), a threshold that is not a finite
number, or two folders without a single job in common (nothing compared is no verdict).
Only a regression exits 1: anything the tool did not foresee exits 2 too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from launcher.report.regressions import CompareError, Thresholds, compare, load, render

EXIT_SAME, EXIT_REGRESSED, EXIT_BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    defaults = Thresholds()
    p = argparse.ArgumentParser(prog="python -m launcher.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("baseline", help="run folder or sweep folder of the baseline")
    p.add_argument("candidate", help="run folder or sweep folder of the candidate")
    p.add_argument("--error-factor", type=float, default=defaults.error_factor,
                   help="a tensor's max |diff| may grow by this factor (default %(default)s)")
    p.add_argument("--error-floor", type=float, default=defaults.error_floor,
                   help="errors below this count as it (default %(default)s)")
    p.add_argument("--slower", type=float, default=defaults.slower,
                   help="a benchmark median may be this fraction slower (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (for CI)")
    return p


def _finite(value):
    """JSON without NaN (which strict parsers refuse): a non-finite error is the string 'nan'."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    limits = (args.error_factor, args.error_floor, args.slower)
    # NaN passes every comparison and inf hides every growth: both would make the gate vacuous.
    if not all(map(math.isfinite, limits)) or args.error_factor < 1 or args.error_floor < 0 or args.slower < 0:
        print("error: --error-factor must be a finite number >= 1, --error-floor and --slower finite "
              "numbers >= 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    thresholds = Thresholds(error_factor=args.error_factor, error_floor=args.error_floor, slower=args.slower)
    try:
        baseline, candidate = load(args.baseline), load(args.candidate)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    report = compare(baseline, candidate, thresholds)
    if not report["matched"]:
        print(f"error: no job of {args.candidate} ({len(candidate)}) has the case of a job of {args.baseline} "
              f"({len(baseline)}): nothing was compared", file=sys.stderr)
        return EXIT_BAD_INPUT
    report.update(baseline=args.baseline, candidate=args.candidate)
    print(json.dumps(_finite(report), indent=1) if args.json else render(report))
    return EXIT_REGRESSED if report["regressed"] else EXIT_SAME


def run(argv: list[str]) -> int:
    """`main`, with an unforeseen exception reported as an error (exit 2), never as exit 1,
    which says a regression was found."""
    try:
        return main(argv)
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
