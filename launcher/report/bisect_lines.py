"""A bisect report's text (`launcher.run.bisect` makes the report on the ranks): the verdict,
the failing check's detail, one line per stage. Reads the JSON-ready report only (no torch)."""

from __future__ import annotations

from typing import Any

_MODE_TEXT = {
    "isolated": "the stage re-run by the golden on the implementation's own inputs",
    "chain": "against the golden chain (the implementation did not expose this stage's inputs)",
}


def render(report: dict[str, Any]) -> str:
    """The report's text: the verdict, the failing check's detail, one line per stage."""
    if report["diverged"]:
        ranks = ", ".join(str(r) for r in report["ranks"])
        lines = [
            f"bisect: first divergence at stage '{report['stage']}' on rank {report['rank']} (ranks {ranks}), "
            f"tensor {report['tensor']}: {report['label']}, {_MODE_TEXT[report['mode']]}",
            *([report["detail"]] if report["detail"] else []),
        ]
    else:
        lines = ["bisect: no stage diverges in the staged re-run (the failure did not reproduce: a fault the "
                 "worker injected, a nondeterministic implementation, or inputs that differ from the fixture)"]
    lines.append(f"  {'stage':<18} {'result':<8} {'modes':<22} max |diff| to the golden chain, by rank")
    for row in report["stages"]:
        result = {True: "pass", False: "FAIL", None: "-"}[row["passed"]]
        modes = ",".join(sorted(set(row["modes"])))
        dists = []
        for cell in row["per_rank"]:
            chains = [t["chain"] for t in cell["tensors"] if t.get("chain")]
            if not chains:
                dists.append("-")
            elif all(c.get("bitwise") for c in chains):
                dists.append("0")
            else:
                dists.append(f"{max(c.get('max_abs_diff', float('nan')) for c in chains):.3g}")
        fails = f"  failing ranks {row['failed_ranks']}" if row["failed_ranks"] else ""
        lines.append(f"  {row['stage']:<18} {result:<8} {modes:<22} {' '.join(dists)}{fails}")
    return "\n".join(lines)
