"""What decided a run's verdict: the one account the console, the run page, result.json, the
sweep's table and JUnit all show (docs/verdict.md).

`decision(result, word)` reads a result dict (`launcher.report.result`) whose verdict is `word`
and says:

* `verdict`: PASS / FAIL / UNCHECKED / ERROR / SKIP (`launcher.report.result.verdict`, which
  calls a run where no check counts UNCHECKED: `counts_nothing`);
* `reference`: the reference comparators' verdict over the checks that count: PASS, FAIL, or
  "off" where every reference check was made diagnostic;
* `integrity`: PASS, FAIL, "off" (integrity=false) or "none" (no integrity check applies: a
  focused scope's stage checks);
* `failed`: which checks decided a FAIL: `{"reference": [tensor, ...], "integrity": [check, ...]}`
  (an integrity check named `tensor check`, `group g tensor check` where dp > 1);
* `loosened`: each check this run judged more leniently than the default profile does, as a
  phrase: a tolerance parameter above its default (`x_out diff_thd=1e+06 (default 0.003)`), a
  check made diagnostic (`x_out diagnostic`, `x_out diagnostic (FAIL, not counted)` where it
  failed), `integrity=false`.

`line(decision)` is that account in one line, after `VERDICT: ` on the console, at the head of
the run page and in JUnit: `FAIL by integrity (kv_cache cap); reference PASS`,
`PASS; loosened: x_out diff_thd=1e+06 (default 0.003)`, `UNCHECKED: no check counts (...)`.
`account(decision)` is the same without its verdict word, as a sweep's row says it beside the word.
"""

from __future__ import annotations

from launcher.config.verdict_words import CHECKS, fails_the_run


def integrity_failures(result: dict) -> list[dict]:
    """The failing integrity checks of a run (against every reference; of every TP group, each
    named by its `group`, when there are several)."""
    def failing(entry: dict) -> list[dict]:
        return [c for c in entry.get("checks", []) + entry.get("recomputed_checks", []) if not c["passed"]]

    if "groups" in result:
        return [{**c, "group": g["group"]} for g in result["groups"] for c in failing(g.get("integrity") or {})]
    return failing(result.get("integrity") or {})


def check_name(check: dict) -> str:
    """`kv_cache written_rows`, `group 1 kv_cache written_rows` in a launch of several groups."""
    return ("" if check.get("group") is None else f"group {check['group']} ") + f"{check['tensor']} {check['check']}"


def check_names(checks: list[dict]) -> list[str]:
    """The integrity checks named in these entries, in `CHECKS` order, any other after them: a
    table shows whatever checks the run recorded."""
    return sorted({c["check"] for c in checks}, key=lambda n: (CHECKS.index(n) if n in CHECKS else len(CHECKS), n))


def compared(result: dict) -> bool:
    """A run whose verdicts this result holds: it ran, computed a golden (not golden=false) and
    compared here (not a node that took rank 0's verdict)."""
    return (result.get("status") == "ok" and not result.get("unchecked") and "compared_on_node" not in result
            and "verdicts" in result)


def counts_nothing(result: dict) -> bool:
    """A run that compared where no check counts: every reference check diagnostic, and no
    integrity check (integrity=false, or none applies). Its verdict is UNCHECKED, never PASS."""
    if not compared(result):
        return False
    return _reference(result)[0] == "off" and _integrity(result)[0] in ("off", "none")


def _sources(result: dict) -> list[dict]:
    """The run itself, or each of its TP or EP groups where there are several."""
    return result.get("groups") or [result]


def _verdicts(source: dict) -> list[dict]:
    return (source.get("verdicts") or []) + (source.get("recomputed_verdicts") or [])


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def loosened(result: dict) -> list[str]:
    """The checks judged more leniently than the default profile judges them (see the module)."""
    tolerance = result.get("tolerance") or {}
    out = []
    for tensor, changed in (tolerance.get("overridden") or {}).items():
        # Every tolerance parameter (atol, rtol, max_error_ratio, diff_thd, pct_thd,
        # max_diff_hd) loosens its check as it grows.
        out += [f"{tensor} {param}={_number(c['value'])} (default {_number(c['default'])})"
                for param, c in changed.items() if c["value"] > c["default"]]
    failing = {v["tensor"] for s in _sources(result) for v in _verdicts(s) if v.get("diagnostic") and not v["passed"]}
    out += [f"{t} diagnostic" + (" (FAIL, not counted)" if t in failing else "")
            for t in tolerance.get("diagnostic") or []]
    if "integrity" in result and not result["integrity"]["enabled"]:
        out.append("integrity=false")
    return out


def _reference(result: dict) -> tuple[str, list[str]]:
    """The reference verdict and its failing tensors (`group g tensor` where dp > 1)."""
    counted = [(s.get("group") if "groups" in result else None, v)
               for s in _sources(result) for v in _verdicts(s) if not v.get("diagnostic")]
    if not counted:
        return "off", []
    failed = [("" if g is None else f"group {g} ") + v["tensor"] for g, v in counted if fails_the_run(v)]
    return ("FAIL" if failed else "PASS"), list(dict.fromkeys(failed))


def reference_verdict(result: dict) -> str:
    """PASS or FAIL over the reference checks that count; "off" where every one is diagnostic."""
    return _reference(result)[0]


def _integrity(result: dict) -> tuple[str, list[str]]:
    entry = result.get("integrity") or {}
    if not entry.get("enabled"):
        return "off", []
    if not any((s.get("integrity") or {}).get("checks") for s in _sources(result)):
        return "none", []
    failed = [check_name(c) for c in integrity_failures(result)]
    return ("FAIL" if failed else "PASS"), list(dict.fromkeys(failed))


def decision(result: dict, word: str) -> dict:
    """result.json's `decision` for a run whose verdict is `word` (see the module); for a run
    that compared nothing (an error, a refusal, a skip, a performance run, a node that did not
    compare), the verdict alone."""
    if not compared(result):
        return {"verdict": word}
    reference, ref_failed = _reference(result)
    integrity, int_failed = _integrity(result)
    return {"verdict": word, "reference": reference, "integrity": integrity,
            "failed": {"reference": ref_failed, "integrity": int_failed}, "loosened": loosened(result)}


def _clauses(d: dict) -> tuple[str, list[str]]:
    """The FAIL's `by ...` clause (or ""), and the clauses after it."""
    if d["verdict"] == "UNCHECKED":
        return "", ["no check counts (" + "; ".join(d["loosened"]) + ")"]
    by = [f"{kind} ({', '.join(names)})" for kind, names in d["failed"].items() if names]
    rest = []
    if by:  # the other verdict beside the one that decided: a FAIL by integrity says the reference passed
        rest += [f"{kind} {d[kind]}" for kind in ("reference", "integrity")
                 if not d["failed"][kind] and d[kind] != "none"]
    elif d["reference"] == "off":  # a PASS decided by the integrity checks alone
        rest.append("reference off")
    if d["loosened"]:
        rest.append("loosened: " + ", ".join(d["loosened"]))
    return ("by " + " and ".join(by) if by else ""), rest


def account(d: dict) -> str:
    """A `decision` without its verdict word: what a sweep's row says beside the word."""
    if "reference" not in d:
        return ""
    by, rest = _clauses(d)
    return "; ".join(([by] if by else []) + rest)


def line(d: dict) -> str:
    """A `decision` in one line (see the module); the verdict word alone where nothing was compared."""
    if "reference" not in d:
        return d["verdict"]
    by, rest = _clauses(d)
    if d["verdict"] == "UNCHECKED":
        return "UNCHECKED: " + "; ".join(rest)
    return "; ".join([d["verdict"] + (f" {by}" if by else "")] + rest)


__all__ = ["decision", "line", "account", "loosened", "compared", "counts_nothing", "reference_verdict",
           "integrity_failures", "check_name", "check_names"]
