"""The integrity checks' false-positive rate: correct implementations over layers, dims and seeds.

Runs one sweep per layer (`python -m launcher -m ...`) of the default implementation and of
`tests.noisy.Dithered` (a correct implementation with rounding noise) at each `--rel`, then
prints one row per job: the reference verdict and bad points per tensor, every failing
integrity check, and the concentration check's figures (the tensor's bad fraction, each
unit kind's largest). A correct run with a failing integrity check is a false positive.

    python scripts/integrity_fp.py --layers swa,csa,hca,moe --models tiny,small --seeds 1,2,3
    python scripts/integrity_fp.py --layers csa --models flash --seeds 1 --extra local_t=64 --rels 0.002
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile


def sweep(layer: str, models: str, seeds: str, impl: str, rel: float | None, extra: list[str], out: str) -> list[dict]:
    group = "ep=2" if layer == "moe" else "tp=2"
    cmd = [sys.executable, "-m", "launcher", "-m", f"layer={layer}", group, f"model={models}", f"seed={seeds}",
           f"impl._target_={impl}", f"hydra.sweep.dir={out}", *extra]
    if rel is not None:
        cmd.append(f"+impl.rel={rel}")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode == 2:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    results = []
    for path in sorted(glob.glob(os.path.join(out, "*", "result.json")), key=lambda q: int(q.split(os.sep)[-2])):
        with open(path) as f:
            results.append(json.load(f))
    return results


def row(result: dict, impl: str) -> dict:
    c = result["case"]
    bad = {v["tensor"]: f"{v['figures'].get('n_bad')}/{v['figures'].get('numel')}" for v in result["verdicts"]}
    checks = result["integrity"]["checks"]
    conc = next((x["figures"] for x in checks if x["check"] == "concentration"), {})
    stale = sum(x["figures"]["n_bad"] for x in checks if x["check"] == "stale_values")
    return {"layer": c["layer"], "model": c["model"], "seed": c["seed"], "impl": impl,
            "reference": "PASS" if result["reference_passed"] else "FAIL",
            "integrity_failed": [f"{x['tensor']} {x['check']}" for x in checks if not x["passed"]],
            "bad": bad, "stale_values": stale, "tensor_fraction": conc.get("tensor_fraction"),
            "max_fraction": conc.get("max_fraction")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="swa,csa,hca,moe")
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--rels", default="0.001,0.002", help="Dithered noise levels (none: the default impl only)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every sweep, e.g. local_t=64")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layer in args.layers.split(","):
            rels = [float(r) for r in args.rels.split(",") if r]
            runs = [("layers.tp.TorchTP", None)] + [("tests.noisy.Dithered", r) for r in rels]
            for i, (impl, rel) in enumerate(runs):
                name = "default" if rel is None else f"dithered rel={rel:g}"
                out = os.path.join(tmp, f"{layer}{i}")
                for result in sweep(layer, args.models, args.seeds, impl, rel, args.extra, out):
                    r = row(result, name)
                    rows.append(r)
                    fr = r["max_fraction"] or {}
                    print(f"{r['layer']:4} {r['model']:6} seed={r['seed']:<3} {name:22} ref={r['reference']} "
                          f"bad={r['bad']} stale={r['stale_values']} tensor_frac={r['tensor_fraction'] or 0:.4f} "
                          f"max_frac={ {k: round(v, 3) for k, v in fr.items()} } "
                          f"integrity_failed={r['integrity_failed']}", flush=True)
    fp = [r for r in rows if r["reference"] == "PASS" and r["integrity_failed"]]
    print(f"{len(rows)} runs, {sum(r['reference'] == 'PASS' for r in rows)} passing the reference, "
          f"{len(fp)} of them failing an integrity check")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
