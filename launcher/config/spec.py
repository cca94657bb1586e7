"""The one reader of the run config: a composed Hydra config -> a validated, frozen `RunSpec`.

`run_spec` reads every key once and checks each value (naming the key, the value and the
rule) into a RunSpec and its `Case`; `validated_spec` takes the case a replayed snapshot fixes
(`launcher.config.replay`) and validates the case once: its TP rules (`Case.validate`), then
its layer's (`Layer.validate`). What only the machine can tell (devices, ports, the snapshot's files, an
importable implementation) is checked next by `launcher.run.preflight`. `config_case` is the same config's case for a run refused before a
RunSpec exists, each key read on its own.

RunSpec is plain dataclasses, picklable, no OmegaConf: it is what every rank receives.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from layers.contract.case import Case
from layers.contract.config import ConfigError, ModelConfig
from layers.contract.layer import Layer
from layers.registry import get_scope, validated

from launcher.config.faults import Fault
from launcher.config.faults import check_unset as check_fault_unset
from launcher.config.overrides import override_keys
from launcher.config.replay import SnapshotFacts, facts_entry, given_keys, replayed_case
from launcher.config.tolerance import Tolerances, read_tolerances

BACKENDS = ("auto", "gloo", "nccl", "hccl")
START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_IMPL = "layers.tp.TorchTP"


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs to run its part of one case, and how the launcher reports it
    (picklable, no OmegaConf)."""

    case: Case
    impl: dict  # a Hydra instantiate spec: {"_target_": ..., **kwargs}
    backend: str
    timeout_s: float
    start_method: str
    threads_per_rank: Optional[int]
    output_dir: str
    golden_data: Optional[str] = None  # replay: inputs and reference outputs from this snapshot
    save_data: Optional[str] = None  # write this run's inputs and golden outputs as a snapshot
    save_overwrite: bool = False  # save_data may replace the snapshot a folder holds
    snapshot: Optional[dict] = None  # replay: the case keys read from golden_data, with their files
    tolerances: Tolerances = Tolerances()  # what the tolerance config sets for this case's checks
    recompute_golden: bool = False  # with golden_data: also compare against a recomputed golden
    golden_cache: Optional[str] = None  # folder of cached goldens; None disables the cache
    fault: Optional[Fault] = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 (single node): the store binds a free port
    nproc_per_node: int = 0  # ranks on this node; 0 means tp / nnodes
    bisect: bool = False  # after a failing full run, locate the first divergent stage and rank
    report_plots: bool = False  # PNG heat maps of a failing tensor's errors (drawn by the launcher)

    @property
    def layer(self) -> Layer:
        """The layer (or focused scope) the case runs, this process's own instance."""
        return get_scope(self.case.layer, self.case.scope)

    @property
    def local_ranks(self) -> int:
        return self.nproc_per_node or self.case.tp // self.nnodes

    @property
    def rank_base(self) -> int:
        """Global rank of this node's first rank: node 0 holds rank 0, which compares."""
        return self.node_rank * self.local_ranks

    @property
    def deadline_s(self) -> float:
        """Wall-clock limit of one rank: a rank still running then dumps its stacks and exits."""
        return 2 * self.timeout_s

    def threads(self) -> int:
        """Per-rank intra-op threads: the node's cores shared by its ranks, never oversubscribed."""
        if self.threads_per_rank:
            return self.threads_per_rank
        return max(1, (os.cpu_count() or 1) // self.local_ranks)

    def case_entry(self) -> dict:
        """result.json's `case`: what ran, as the config names it."""
        c = self.case
        return {
            "layer": c.layer,
            "scope": c.scope,
            "model": c.model.name,
            "tp": c.tp,
            "local_t": c.local_t,
            "seed": c.seed,
            "start_pos": list(c.start_pos) if isinstance(c.start_pos, tuple) else c.start_pos,
            "backend": self.backend,
            "impl": self.impl.get("_target_"),
        }


def _start_pos(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (ListConfig, list, tuple)):
        items = list(value)
        if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            raise ConfigError(f"start_pos={list(items)} must be an integer or a non-empty list of integers")
        return tuple(items)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"start_pos={value!r} must be an integer or a list of integers")


def run_spec(cfg: DictConfig, output_dir: str) -> RunSpec:
    """Every key of a composed config read once and its value checked, into a RunSpec; raises
    ConfigError naming the key, its value and the rule. The case it holds is not validated yet:
    `validated_spec` does that, once.
    """
    model_fields = OmegaConf.to_container(cfg.model, resolve=True)
    model = ModelConfig(**model_fields)
    tp = int(cfg.tp)
    if tp < 1:
        raise ConfigError(f"tp={tp} must be >= 1")
    scope = str(cfg.scope)
    get_scope(str(cfg.layer.name), scope)  # an unknown layer or scope is a ConfigError here
    local_t = cfg.local_t if cfg.local_t is not None else _default_local_t(str(cfg.layer.name), scope, model, tp)
    if cfg.bisect and scope != "full":
        raise ConfigError(f"bisect=true locates a divergent stage of the full layer; it needs scope=full, not scope={scope}")
    case = Case(
        layer=str(cfg.layer.name),
        model=model,
        tp=tp,
        local_t=int(local_t),
        seed=int(cfg.seed),
        start_pos=_start_pos(cfg.start_pos),
        scope=scope,
    )
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"backend={cfg.backend!r} must be one of {', '.join(BACKENDS)}")
    if cfg.start_method not in START_METHODS:
        raise ConfigError(f"start_method={cfg.start_method!r} must be one of {', '.join(START_METHODS)}")
    timeout_s = default_timeout_s(model) if cfg.timeout_s is None else float(cfg.timeout_s)
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s={cfg.timeout_s} must be > 0")
    fault = None
    if cfg.fault.kind is not None:
        fault = Fault(kind=str(cfg.fault.kind), rank=int(cfg.fault.rank), stage=str(cfg.fault.stage))
        fault.check(tp, saves=bool(cfg.save_data))
    else:
        check_fault_unset(int(cfg.fault.rank), str(cfg.fault.stage), tp)
    if cfg.threads_per_rank is not None and cfg.threads_per_rank < 1:
        raise ConfigError(f"threads_per_rank={cfg.threads_per_rank} must be >= 1")
    if cfg.recompute_golden and not cfg.golden_data:
        raise ConfigError("recompute_golden=true needs golden_data=DIR (there is nothing else to recompute against)")
    if cfg.impl is None:
        impl = {"_target_": DEFAULT_IMPL}
    elif isinstance(cfg.impl, str):  # the shorthand impl=package.module.Name
        impl = {"_target_": cfg.impl}
    else:
        impl = OmegaConf.to_container(cfg.impl, resolve=True)
    if not isinstance(impl, dict) or "_target_" not in impl:
        raise ConfigError(f"impl={impl!r} must name a callable as impl._target_=package.module.Name")
    return RunSpec(
        case=case,
        impl=impl,
        backend=str(cfg.backend),
        timeout_s=timeout_s,
        start_method=str(cfg.start_method),
        threads_per_rank=cfg.threads_per_rank,
        output_dir=output_dir,
        golden_data=_path(cfg.golden_data),
        save_data=_path(cfg.save_data),
        save_overwrite=bool(cfg.save_overwrite),
        recompute_golden=bool(cfg.recompute_golden),
        golden_cache=_path(cfg.golden_cache),
        fault=fault,
        bisect=bool(cfg.bisect),
        report_plots=bool(cfg.report.plots),
        **_nodes(cfg, tp),
    )


def validated_spec(cfg: DictConfig, output_dir: str, *, overrides: Sequence[str] | None = None,
                   describe_snapshot: Callable[[str], SnapshotFacts] | None = None) -> RunSpec:
    """The one reader's whole answer: `run_spec`, the case a replayed snapshot fixes, and the
    case validated once (its TP rules, then its layer's).

    `overrides`: the run's override strings, which say what the user gave explicitly (None:
    every key as composed) and whose tolerance entries win over a profile's. `describe_snapshot(golden_data)` reads what a snapshot says of its
    case (`launcher.store.snapshot_case.describe`): the config floor opens no snapshot itself.
    """
    spec = run_spec(cfg, output_dir)
    if spec.golden_data and describe_snapshot is not None:
        facts = describe_snapshot(spec.golden_data)
        case, read = replayed_case(spec.case, facts, given_keys(cfg, overrides), _default_local_t)
        spec = dataclasses.replace(spec, case=case, snapshot=facts_entry(facts, read), **_nodes(cfg, case.tp))
    validated(spec.case)  # the one validation of a case: its TP rules, then its layer's
    explicit = override_keys(overrides) if overrides is not None else frozenset()
    return dataclasses.replace(spec, tolerances=read_tolerances(cfg.get("tolerance"), spec.case, explicit))


def _nodes(cfg: DictConfig, tp: int) -> dict:
    nnodes, node_rank = int(cfg.nnodes), int(cfg.node_rank)
    if nnodes < 1:
        raise ConfigError(f"nnodes={nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"node_rank={node_rank} must be in [0, {nnodes}) for nnodes={nnodes}")
    nproc = int(cfg.nproc_per_node) if cfg.nproc_per_node is not None else (tp // nnodes if tp % nnodes == 0 else 0)
    if nproc < 1 or nproc * nnodes != tp:
        raise ConfigError(
            f"nproc_per_node={cfg.nproc_per_node if cfg.nproc_per_node is not None else 'tp/nnodes'} x nnodes={nnodes} "
            f"must equal tp={tp} (one rank per device on every node)"
        )
    port = cfg.master_port if cfg.master_port is not None else (0 if nnodes == 1 else 29500)
    if not 0 <= int(port) < 65536 or (nnodes > 1 and int(port) == 0):
        raise ConfigError(f"master_port={port} must be a TCP port in [1, 65535] for a multi-node run")
    return {"nnodes": nnodes, "node_rank": node_rank, "master_addr": str(cfg.master_addr),
            "master_port": int(port), "nproc_per_node": nproc}


def _default_local_t(layer: str, scope: str, model: ModelConfig, tp: int) -> int:
    """The rank capacity; the padding-guard scopes run one row below it (the reference's
    default), so that the poisoned and sentinel rows they check exist."""
    capacity = model.decode_tokens // tp
    if not get_scope(layer, scope).whole_requests and capacity > 1:
        return capacity - 1
    return capacity


def default_timeout_s(model: ModelConfig) -> float:
    """Collective timeout when none is given: a hang at small dims ends in well under a minute,
    while a flash-dims rank may legitimately wait on slower peers for a while."""
    return 20.0 if model.hidden_size <= 1024 else 300.0


def _path(value: Optional[str]) -> Optional[str]:
    return os.path.abspath(os.path.expanduser(str(value))) if value else None


# -- the case of a run refused before a RunSpec exists --------------------------------------------


def config_case(cfg) -> dict:
    """The case as the config states it, for a run refused before a RunSpec exists.

    Each key separately: one value that cannot be read (a bad interpolation) must not hide
    the others.
    """

    def get(read):
        try:
            v = read()
        except Exception:  # any unreadable value: the preflight message says why
            return None
        return list(v) if hasattr(v, "__len__") and not isinstance(v, str) else v

    return {
        "layer": get(lambda: cfg.layer.name),
        "scope": get(lambda: cfg.scope),
        "model": get(lambda: cfg.model.name),
        "tp": get(lambda: cfg.tp),
        "local_t": get(lambda: cfg.local_t),
        "seed": get(lambda: cfg.seed),
        "start_pos": get(lambda: cfg.start_pos),
        "backend": get(lambda: cfg.backend),
        "impl": get(lambda: cfg.impl["_target_"]),
    }
