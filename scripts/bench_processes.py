"""What a launch costs outside the ranks' compute, counted rather than timed: the processes it
starts, the modules each imports itself, and the imports an editable install's finder answers.

For one tiny swa tp=8 run and `-m +sweep=smoke` (six tiny jobs), both `golden_cache=null`, each
started as `python -m launcher` from `--cwd` by each of `--pythons` (e.g. an editable and a
plain install's venvs), every Python process of the launch records at its end (a
`sitecustomize` on PYTHONPATH, which names no package of the project):

* its role: the launcher, a forked copy of it (a sweep's composing copy), a rank (forked by
  the forkserver, which itself ends by a signal and records nothing: its imports are the ones
  its ranks were born with), a helper (multiprocessing's resource tracker);
* the modules it imported itself (after it was forked, for a forked process);
* the calls into the editable install's finder (`__editable__..._finder`, which setuptools
  appends to `sys.meta_path`), those it answered, and the CPU inside it;
* its own CPU (`getrusage`, all its threads).

Counts do not depend on the machine's load, so two installs or two folders compare in one run
of this script even on a busy machine; the CPU columns are there to show where time could go.

    python scripts/bench_processes.py --cwd /tmp/elsewhere --pythons EDITABLE/bin/python,PLAIN/bin/python
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

# The tracer every process of the launch runs at start-up (site imports `sitecustomize`).
_SITECUSTOMIZE = r'''
import json, os, resource, sys, time

_out = os.environ["BENCH_PROCESSES_DIR"]
_state = {"own": [], "born_with": 0, "calls": 0, "hits": 0, "finder_s": 0.0, "dumped": False}


def _imported(event, args):
    if event == "import":
        _state["own"].append(args[0])


def _forked():
    _state.update(born_with=_state["born_with"] + len(_state["own"]), own=[], calls=0, hits=0, finder_s=0.0)


def _counting(find_spec):
    def counted(fullname, path=None, target=None):
        t0 = time.process_time()
        try:
            spec = find_spec(fullname, path, target)
        finally:
            _state["calls"] += 1
            _state["finder_s"] += time.process_time() - t0
        _state["hits"] += spec is not None
        return spec
    return counted


for _finder in sys.meta_path:
    if "__editable__" in getattr(_finder, "__module__", ""):
        _finder.find_spec = _counting(_finder.find_spec)


def _record():
    if _state["dumped"]:
        return
    _state["dumped"] = True
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "imports": len(_state["own"]),
              "born_with": _state["born_with"], "finder_calls": _state["calls"], "finder_hits": _state["hits"],
              "finder_cpu_s": _state["finder_s"], "cpu_s": usage.ru_utime + usage.ru_stime}
    with open(os.path.join(_out, f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)


def _exit(code, _real=os._exit):  # the launcher and the ranks end with os._exit
    try:
        _record()
    finally:
        _real(code)


sys.addaudithook(_imported)
os.register_at_fork(after_in_child=_forked)
os._exit = _exit
import atexit
atexit.register(_record)
'''

ONE_RUN = ["layer=swa", "tp=8", "model=tiny", "golden_cache=null"]
SWEEP = ["-m", "+sweep=smoke", "golden_cache=null"]
SIDES = {"one run": (ONE_RUN, "hydra.run.dir"), "sweep": (SWEEP, "hydra.sweep.dir")}
ROLES = ("launcher", "forked copy", "rank", "helper")


def _role(record: dict, launcher: dict) -> str:
    if record["pid"] == launcher["pid"]:
        return "launcher"
    if record["argv"] == launcher["argv"]:  # forked from the launcher, or from the forkserver it started
        return "forked copy" if record["ppid"] == launcher["pid"] else "rank"
    return "helper"


def traced(python: str, args: list[str], out_key: str, cwd: str) -> list[dict]:
    """The records of every process of one `python -m launcher ARGS` run in `cwd`."""
    site, records, results = (tempfile.mkdtemp(prefix=p) for p in ("site-", "records-", "results-"))
    try:
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(_SITECUSTOMIZE)
        env = dict(os.environ, BENCH_PROCESSES_DIR=records,
                   PYTHONPATH=os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.run([python, "-m", "launcher", *args, f"{out_key}={results}"], cwd=cwd, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{python} -m launcher {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        found = []
        for path in glob.glob(os.path.join(records, "*.json")):
            with open(path) as f:
                found.append(json.load(f))
        return found
    finally:
        for folder in (site, records, results):
            shutil.rmtree(folder, ignore_errors=True)


def summary(records: list[dict]) -> dict[str, dict]:
    """Per role: processes, their own imports, the finder's calls / hits / CPU, their CPU; and
    the imports the ranks were born with (the forkserver's)."""
    launcher = next(r for r in records if r["born_with"] == 0 and r["argv"][0] != "-c")
    rows = {role: collections.Counter() for role in ROLES}
    for r in records:
        row = rows[_role(r, launcher)]
        row["processes"] += 1
        row["imports"] += r["imports"]
        row["finder calls"] += r["finder_calls"]
        row["finder hits"] += r["finder_hits"]
        row["finder ms"] += 1e3 * r["finder_cpu_s"]
        row["CPU s"] += r["cpu_s"]
        if row is rows["rank"]:
            row["forkserver imports"] = max(row["forkserver imports"], r["born_with"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cwd", default=os.getcwd(), help="the folder the launcher starts in (default: this one)")
    ap.add_argument("--pythons", default=sys.executable, help="comma-separated interpreters (default: this one)")
    args = ap.parse_args()
    print(f"from {args.cwd}; per role, summed over its processes")
    columns = ("processes", "imports", "finder calls", "finder hits", "finder ms", "CPU s")
    for python in args.pythons.split(","):
        print(f"\n{python}:")
        print(f"  {'':8s} {'role':12s}" + "".join(f"{c:>13s}" for c in columns))
        for side, (cmd, key) in SIDES.items():
            rows = summary(traced(python, cmd, key, args.cwd))
            for role in ROLES:
                row = rows[role]
                cells = "".join(f"{row[c]:13.1f}" if c.endswith(("ms", " s")) else f"{row[c]:13d}" for c in columns)
                print(f"  {side:8s} {role:12s}{cells}")
            print(f"  {side:8s} the ranks were born with {rows['rank']['forkserver imports']} modules "
                  f"(the forkserver's imports)")


if __name__ == "__main__":
    main()
