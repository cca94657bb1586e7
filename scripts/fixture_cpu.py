"""A rank's fixture CPU, its O weights drawn whole by every rank against a share per rank
exchanged over the group (`launcher.run.rank_data.rank_inputs` with and without the rank's
context), on real gloo ranks, the two alternated in the same processes.

    python scripts/fixture_cpu.py                        # csa, flash, tp=2, local_t=64
    python scripts/fixture_cpu.py --layer hca --tp 4 --repeats 5

Each figure is the rank process's own CPU (user + system, every thread) over one call, the
rank's replicated weights drawn afresh each time; the median over `--repeats` per rank and way.
Every tensor's sha256 and the full O weights' are checked equal between the two ways.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launcher.run.rank_data import rank_inputs  # noqa: E402
from layers.contract.case import Case  # noqa: E402
from layers.contract.config import FLASH, TINY  # noqa: E402
from layers.contract.context import RankContext  # noqa: E402
from layers.contract.tensors import tensor_sha256  # noqa: E402
from layers.fixtures.kept import forget_kept_weights  # noqa: E402
from layers.registry import get_layer  # noqa: E402

WAYS = ("whole", "shared")  # every rank draws the O weights whole / a share per rank, exchanged


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Spec:
    """What `rank_inputs` reads of a RunSpec: no cache, a computed golden."""

    golden_cache, golden_data, golden = None, None, True


def _rank(rank: int, args, init: str, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=args.tp)
    layer = get_layer(args.layer)
    case = Case(args.layer, FLASH if args.model == "flash" else TINY, args.tp, args.local_t, args.seed)
    ctx = RankContext(case=case, rank=rank, device=torch.device("cpu"), group=dist.group.WORLD)
    cpu, digests = {w: [] for w in WAYS}, {}
    for _ in range(args.repeats):
        for way in WAYS:
            forget_kept_weights()
            dist.barrier()
            t0 = _cpu()
            made = rank_inputs(_Spec, layer, case, rank, [], stores_group=False, ctx=ctx if way == "shared" else None)
            cpu[way].append(_cpu() - t0)
            digests[way] = {**{n: tensor_sha256(t) for n, t in made.tensors.items()},
                            "full wo_a": tensor_sha256(made.wo_full[0]), "full wo_b": tensor_sha256(made.wo_full[1])}
            del made
    Path(out, f"{rank}.json").write_text(json.dumps({"cpu": cpu, "same_bits": digests["whole"] == digests["shared"]}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="csa", choices=("swa", "csa", "hca"))
    p.add_argument("--model", default="flash", choices=("flash", "tiny"))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--local-t", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (the launcher's cores // ranks)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{os.path.join(out, 'rendezvous')}"
        mp.spawn(_rank, args=(args, init, out), nprocs=args.tp)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(args.tp)]
    print(f"{args.layer} {args.model} tp={args.tp} local_t={args.local_t}, {args.threads} thread(s) per rank, "
          f"load average {os.getloadavg()[0]:.1f}")
    for r, fig in enumerate(ranks):
        whole, shared = (statistics.median(fig["cpu"][w]) for w in WAYS)
        print(f"rank {r}: fixture CPU-s whole {whole:.3f}, shared {shared:.3f}, ratio {shared / whole:.2f} "
              f"(runs {fig['cpu']}); same bits: {fig['same_bits']}")
    if not all(fig["same_bits"] for fig in ranks):
        sys.exit("the two ways drew different bits")


if __name__ == "__main__":
    main()
