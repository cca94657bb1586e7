"""What every node of a multi-node run must agree on, checked on every rank at rendezvous
(`launcher.run.worker.rank_main`: every node, and every task under srun, composed its own
config; the rank processes of one launcher on one node all get its one spec).

Each node composes its own config from its own command line. Every RunSpec field shapes the
run (which tensors, which collectives, which verdict) unless it is named in `NODE_LOCAL`
(paths and this node's own processes and hardware), so a key added to the RunSpec is agreed
on by default. Two nodes that differ in one, e.g. `scope`, would enter different collectives
and blame each other's timeouts; they are refused instead, on every node, with one line
naming the key and both values.
"""

from __future__ import annotations

import dataclasses
import socket

import torch.distributed as dist

from launcher.config.spec import RunSpec
from launcher.store import snapshot

# Fields each node may set for itself: where it writes, how it reaches node 0, its cache, its
# threads, job slot and start method, its plots.
NODE_LOCAL = frozenset({"output_dir", "node_rank", "master_addr", "master_port", "golden_cache", "threads_per_rank",
                        "slot", "start_method", "report_plots", "warm_ranks"})
# Paths that may differ between nodes (each mounts its own); whether each is set must agree.
NODE_PATHS = frozenset({"golden_data", "save_data"})


class ConfigMismatch(RuntimeError):
    """The nodes of one run were started with different configs."""


def fingerprint(spec: RunSpec) -> dict:
    """What every node must agree on, by config key (the case's fields flattened)."""
    agreed = {"tool_version": snapshot.tool_version()}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name in NODE_LOCAL:
            continue
        if f.name == "case":
            agreed.update({g.name: getattr(value, g.name) for g in dataclasses.fields(value)})
            agreed["model"] = value.model.fields()
        elif f.name in NODE_PATHS:
            agreed[f"{f.name} set"] = value is not None
        else:
            agreed[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return agreed


def check_nodes_agree(spec: RunSpec) -> None:
    """At rendezvous: refuse, on every rank, a run whose nodes disagree on the config."""
    mine = {"node": spec.node_rank, "host": socket.gethostname(), "config": fingerprint(spec)}
    everyone = [None] * spec.world
    dist.all_gather_object(everyone, mine)
    ref = everyone[0]
    for other in everyone[1:]:
        diff = [k for k in ref["config"] if ref["config"][k] != other["config"].get(k)]
        if diff:
            k = diff[0]
            mine_k, theirs_k = ref["config"][k], other["config"].get(k)
            if isinstance(mine_k, dict) and isinstance(theirs_k, dict):  # the model: only its differing fields
                fields = [f for f in mine_k if mine_k[f] != theirs_k.get(f)]
                mine_k, theirs_k = {f: mine_k[f] for f in fields}, {f: theirs_k.get(f) for f in fields}
            raise ConfigMismatch(
                f"nodes disagree on {', '.join(diff)}: node {ref['node']} ({ref['host']}) has {k}={mine_k}, "
                f"node {other['node']} ({other['host']}) has {k}={theirs_k}"
            )
