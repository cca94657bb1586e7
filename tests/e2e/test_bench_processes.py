"""scripts/bench_processes.py: every process of a launch counted by its role, and a rank forked
from the warm forkserver imports next to nothing of its own."""

from __future__ import annotations

import importlib
import sys

from ..conftest import REPO


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    return importlib.import_module("bench_processes")


def _record(pid, ppid, argv, born_with=0, imports=0, cpu=0.0):
    return {"pid": pid, "ppid": ppid, "argv": argv, "imports": imports, "born_with": born_with,
            "finder_calls": 0, "finder_hits": 0, "finder_cpu_s": 0.0, "cpu_s": cpu}


def test_each_process_gets_its_role(monkeypatch):
    bench = _bench(monkeypatch)
    main = ["/x/launcher/__main__.py", "-m", "+sweep=smoke"]
    rows = bench.summary([
        _record(10, 1, main, imports=1400, cpu=3.0),
        _record(11, 10, ["-c"], imports=45),  # the resource tracker
        _record(13, 10, main, born_with=1400),  # the composing copy, forked by the launcher
        _record(20, 12, main, born_with=1390, imports=2, cpu=0.5),  # ranks, forked by the forkserver (12)
        _record(21, 12, main, born_with=1390, imports=2, cpu=0.25),
    ])
    assert {role: row["processes"] for role, row in rows.items()} == {
        "launcher": 1, "forked copy": 1, "rank": 2, "helper": 1}
    assert rows["rank"]["imports"] == 4 and rows["rank"]["CPU s"] == 0.75
    assert rows["rank"]["forkserver imports"] == 1390 and rows["launcher"]["imports"] == 1400


def test_a_rank_imports_nothing_the_forkserver_did_not(monkeypatch, tmp_path):
    # The forkserver preloads what a rank needs (`launcher.run.forkserver.PRELOAD`): a rank's
    # own imports are multiprocessing's few for its own children, never torch or a layer.
    bench = _bench(monkeypatch)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    records = bench.traced(sys.executable, ["layer=swa", "tp=2", "model=tiny", "golden_cache=null"],
                           "hydra.run.dir", str(tmp_path))
    rows = bench.summary(records)
    assert rows["launcher"]["processes"] == 1 and rows["rank"]["processes"] == 2, records
    assert rows["rank"]["imports"] <= 2 * 3, records
    assert rows["rank"]["forkserver imports"] > 1000  # torch and the layers, imported once by the server
