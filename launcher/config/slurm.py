"""The Slurm job step this process runs in: the node keys of a multi-node run, from `srun`'s environment.

Under `srun` every task has SLURM_STEP_ID, SLURM_PROCID, SLURM_NODEID and the step's node
count and node list (SLURM_STEP_NUM_NODES / SLURM_STEP_NODELIST, or the job's SLURM_NNODES /
SLURM_JOB_NODELIST where the step ones are absent). `python -m launcher`, run as one task per
node, takes nnodes, node_rank and master_addr (the list's first host) from them, and a
master port derived from SLURM_JOB_ID, so that jobs sharing a node do not collide;
`launcher.torchrun`, run as one task per rank, also its RANK, LOCAL_RANK and WORLD_SIZE.
Keys given on the command line win; one that contradicts the step is refused
(`launcher.config.spec`).

Node lists come compressed, as Slurm prints them: `node[01-03,07]`, `gpu-a[1-2]-b[3,5],login1`.
Tasks per node too: `8(x2),4` is 8 tasks on each of the first two nodes, then 4.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from layers.contract.config import ConfigError

# The port range the derived master ports come from: above torchrun's 29500, below the
# Linux ephemeral range (32768+).
PORT_BASE, PORT_SPAN = 29500, 3000


def _split_top_level(text: str) -> list[str]:
    """`a[1-2],b` -> ['a[1-2]', 'b']: commas outside brackets separate hosts."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _range_items(body: str) -> list[str]:
    """`01-03,07` -> ['01', '02', '03', '07'] (zero padding kept)."""
    items = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        if not hi:
            items.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ConfigError(f"Slurm node list range '[{body}]' is not lo-hi with lo <= hi")
        items += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return items


def expand_nodelist(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list, in order: `node[01-03,07]` -> node01 node02 node03 node07."""
    hosts = []
    for host in _split_top_level(nodelist.strip()):
        pieces = re.split(r"\[([^\]]*)\]", host)  # text, range, text, range, ..., text
        if any(ch in p for p in pieces[::2] for ch in "[]"):
            raise ConfigError(f"Slurm node list '{nodelist}' has unbalanced brackets")
        choices = [[p] if i % 2 == 0 else _range_items(p) for i, p in enumerate(pieces)]
        hosts += ["".join(c) for c in itertools.product(*choices)]
    return hosts


def tasks_per_node(text: str) -> list[int]:
    """`8(x2),4` -> [8, 8, 4]: Slurm's tasks-per-node list, one entry per node."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ConfigError(f"Slurm tasks per node '{text}' is not of the form 8(x2),4")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


@dataclass(frozen=True)
class SlurmStep:
    """The job step as this task sees it."""

    nnodes: int
    node_rank: int  # SLURM_NODEID: this node's index in the step
    hosts: tuple[str, ...]
    tasks_here: int  # tasks of the step on this node
    procid: int  # SLURM_PROCID: this task's index in the step
    ntasks: int
    localid: int  # SLURM_LOCALID: this task's index on its node
    job_id: str | None

    @property
    def master_addr(self) -> str:
        return self.hosts[0]

    @property
    def master_port(self) -> int:
        """One port per Slurm job (every node derives the same one)."""
        return PORT_BASE + (int(self.job_id) % PORT_SPAN if self.job_id and self.job_id.isdigit() else 0)

    def describe(self) -> str:
        return f"Slurm step of {self.nnodes} nodes ({','.join(self.hosts[:4])}{',...' if len(self.hosts) > 4 else ''})"


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    return next(((n, env[n]) for n in names if env.get(n)), None)


def slurm_step(env: Mapping[str, str]) -> SlurmStep | None:
    """The step this task of `srun` runs in; None outside one. srun sets SLURM_STEP_ID; a batch
    script run by sbatch has the job's variables but runs on the first node alone, so there
    a launcher stays a single-node run unless told otherwise."""
    if not {"SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NODEID"} <= env.keys():
        return None
    nodes = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    nodelist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodes is None or nodelist is None:
        raise ConfigError("under srun (SLURM_PROCID is set) but SLURM_NNODES or SLURM_JOB_NODELIST is missing: "
                          "cannot tell the step's nodes")
    hosts = tuple(expand_nodelist(nodelist[1]))
    nnodes, node_rank = int(nodes[1]), int(env["SLURM_NODEID"])
    if len(hosts) != nnodes:
        raise ConfigError(f"{nodelist[0]}={nodelist[1]} names {len(hosts)} hosts but {nodes[0]}={nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"SLURM_NODEID={node_rank} is outside the step's {nnodes} nodes")
    per_node = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    ntasks = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if per_node is not None:
        tasks_here = tasks_per_node(per_node[1])[node_rank]
    elif env.get("SLURM_NTASKS_PER_NODE"):
        tasks_here = int(env["SLURM_NTASKS_PER_NODE"])
    else:
        tasks_here = int(ntasks[1]) // nnodes if ntasks else 1
    return SlurmStep(nnodes=nnodes, node_rank=node_rank, hosts=hosts, tasks_here=tasks_here,
                     procid=int(env["SLURM_PROCID"]), ntasks=int(ntasks[1]) if ntasks else nnodes * tasks_here,
                     localid=int(env.get("SLURM_LOCALID", 0)), job_id=env.get("SLURM_JOB_ID"))


def node_keys(cfg, step: SlurmStep | None, *, task_is_rank: bool) -> dict:
    """nnodes, node_rank, master_addr and master_port: the keys given, else the step's, else the
    single-node defaults. A given nnodes or node_rank that contradicts the step is refused; a
    given master_addr or master_port is taken as it is (a host may have several names).

    `task_is_rank`: this task is one rank of an external launcher (`launcher.torchrun`), not a
    launcher that starts its node's ranks itself, which must be the node's only task.
    """
    given = {k: cfg[k] for k in ("nnodes", "node_rank", "master_addr", "master_port") if cfg[k] is not None}
    if step is None or (step.nnodes == 1 and "nnodes" not in given and not task_is_rank):
        # Outside Slurm, or a one-node step: the keys as given, loopback by default.
        return {"nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": None, **given}
    for key, value in (("nnodes", step.nnodes), ("node_rank", step.node_rank)):
        if key in given and int(given[key]) != value:
            raise ConfigError(f"{key}={given[key]} disagrees with the {step.describe()}, where this node's {key} is "
                              f"{value}: leave {key} out under srun, or run the step it names")
    if step.tasks_here > 1 and not task_is_rank:
        raise ConfigError(f"srun started {step.tasks_here} tasks on this node, but python -m launcher starts the "
                          f"node's ranks itself: run one task per node (srun --ntasks-per-node=1), or use "
                          f"python -m launcher.torchrun for one task per rank")
    return {"nnodes": step.nnodes, "node_rank": step.node_rank, "master_addr": step.master_addr,
            "master_port": step.master_port if step.nnodes > 1 or task_is_rank else None, **given}


def node_output_dir(output_dir: str, env: Mapping[str, str]) -> str:
    """Where this node's launcher writes its logs and result: the nodes of a Slurm job share
    the job's output folder, so node k > 0 keeps to `node<k>/` and node 0's result, the
    compared one, is the job's."""
    try:
        step = slurm_step(env)
    except ConfigError:  # the launcher's preflight refuses such an environment itself
        return output_dir
    if step is None or step.nnodes == 1 or step.node_rank == 0:
        return output_dir
    return os.path.join(output_dir, f"node{step.node_rank}")


def rank_env(step: SlurmStep, master_addr: str, master_port: int) -> dict[str, str]:
    """The torchrun-style environment of a task that is one rank (`launcher.torchrun` under srun)."""
    return {"RANK": str(step.procid), "WORLD_SIZE": str(step.ntasks), "LOCAL_RANK": str(step.localid),
            "LOCAL_WORLD_SIZE": str(step.tasks_here), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
            "GROUP_RANK": str(step.node_rank)}
