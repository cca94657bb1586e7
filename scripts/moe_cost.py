"""Cost of the MoE layer's per-rank golden and EP forward on real gloo ranks (moe.md §4, §13.4).

Forks `--ep` ranks on 127.0.0.1 (one EP group), and on each, with cores // ranks threads:
builds its fixture slice, runs the per-rank golden (the layer's stages with each all-to-all
by its reference over every rank's gathered inputs; x_next gathered to rank 0), then the EP
forward, gathers x_next to rank 0 and compares (bitwise, and the §8 comparator).
Prints each rank's stage wall times and peak RSS (`ru_maxrss`, MiB) after each stage.

    .venv/bin/python scripts/moe_cost.py --model flash --ep 2
    .venv/bin/python scripts/moe_cost.py --model tiny --ep 16 --layer-id 5 --num-tokens 100
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.run.forkserver import set_cpu_env  # noqa: E402

set_cpu_env()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from layers.moe import layer as moe  # noqa: E402
from layers.contract.case import MoECase  # noqa: E402
from layers.contract.config import PRESETS  # noqa: E402
from layers.contract.context import RankContext  # noqa: E402
from layers.distributed import wire  # noqa: E402
from layers.moe import fixture  # noqa: E402


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, world: int, port: int, out_dir: str, args: dict) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    case = MoECase(PRESETS[args["model"]], world, args["seed"], layer_id=args["layer_id"],
                   num_tokens=args["num_tokens"], balanced_routing=args["balanced"])
    ctx = RankContext(case, rank, torch.device("cpu"), dist.group.WORLD)
    stages: dict[str, dict] = {}
    clock = time.perf_counter()

    def done(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stages[name] = {"s": round(now - clock, 3), "peak_rss_mib": round(_rss_mib(), 1)}
        clock = now

    done("start")
    tensors = fixture.rank_inputs(case, rank)
    done("fixture")
    golden = wire.gather(moe.LAYER.rank_golden(ctx, {n: x.clone() for n, x in tensors.items()})["x_next"],
                         rank, world, ctx.group)
    done("golden")
    x_next = moe.LAYER.forward(ctx, tensors)["x_next"]
    done("forward")
    got = wire.gather(x_next, rank, world, ctx.group)
    done("gather")
    result = {"rank": rank, "threads": torch.get_num_threads(), "stages": stages}
    if rank == 0:
        from launcher.verify import build_comparator

        verdict = build_comparator(moe.checks(case)[0], mapping_shape=(), leading_rank_axis=True).evaluate(got, golden)
        result.update(bitwise=bool(torch.equal(got, golden)), passed=verdict.passed,
                      n_bad=verdict.figures["n_bad"], max_abs_diff=verdict.figures.get("max_abs_diff"))
        done("compare")
        result["stages"] = stages
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash", choices=sorted(PRESETS))
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--seed", type=int, default=20260819)
    ap.add_argument("--layer-id", type=int, default=0)
    ap.add_argument("--num-tokens", type=int, default=None)
    ap.add_argument("--balanced", action="store_true")
    a = ap.parse_args()
    args = {"model": a.model, "seed": a.seed, "layer_id": a.layer_id, "num_tokens": a.num_tokens, "balanced": a.balanced}
    MoECase(PRESETS[a.model], a.ep, a.seed, a.layer_id, a.num_tokens, a.balanced).validate()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        wall = time.perf_counter()
        mp.start_processes(_rank, args=(a.ep, port, out_dir, args), nprocs=a.ep, join=True, start_method="fork")
        wall = time.perf_counter() - wall
        ranks = [json.loads((Path(out_dir) / f"{r}.json").read_text()) for r in range(a.ep)]
    print(f"moe model={a.model} ep={a.ep} layer_id={a.layer_id} num_tokens={a.num_tokens} balanced={a.balanced} "
          f"threads/rank={ranks[0]['threads']} wall={wall:.1f}s load={os.getloadavg()[0]:.1f}")
    names = list(ranks[0]["stages"])
    print("rank  " + "  ".join(f"{n} s/MiB" for n in names[1:]))
    for r in ranks:
        cells = [f"{r['stages'][n]['s']:.2f}/{r['stages'][n]['peak_rss_mib']:.0f}" for n in names[1:] if n in r["stages"]]
        print(f"{r['rank']:<5} " + "  ".join(cells))
    r0 = ranks[0]
    print(f"x_next: bitwise={r0['bitwise']} comparator={'PASS' if r0['passed'] else 'FAIL'} "
          f"n_bad={r0['n_bad']} max|diff|={r0['max_abs_diff']}")
    print("peak RSS per rank (MiB):", [round(max(s["peak_rss_mib"] for s in r["stages"].values())) for r in ranks])


if __name__ == "__main__":
    main()
