"""Hydra schemas of the run config and the model presets, registered in Hydra's ConfigStore
before any composition.

The model group's schema mirrors `layers.contract.config.ModelConfig` field for field (a frozen
dataclass cannot be a Hydra node, and derived sizes are properties, so they can never be
overridden); typos and wrong types fail at composition, and a top-level key the run config does
not have is refused before it (`top_level_names`, `launcher.config.overrides.unknown_top_level`). The model group's options (`model=tiny`,
...) are `layers.contract.config.PRESETS`, each stored as a node of that schema: the Python
table is their one source, and any field can still be overridden (`model.decode_batch=32`). Turning a composed config into plain
dataclasses is `launcher.config.spec.run_spec`'s job alone.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from layers.contract.config import PRESETS, ModelConfig

from launcher.config.resolvers import register_resolvers

_hints = typing.get_type_hints(ModelConfig)
ModelSchema = dataclasses.make_dataclass(
    "ModelSchema", [(f.name, _hints[f.name], field(default=MISSING)) for f in dataclasses.fields(ModelConfig)]
)
ModelSchema.__module__ = __name__  # found by pickle: a sweep's configs come back from the composing copies


@dataclass
class LayerSchema:
    name: str = MISSING


@dataclass
class ReportSchema:
    plots: bool = False  # PNG heat maps of where a failing tensor's errors are, next to result.json


@dataclass
class BenchSchema:
    rounds: int = 0  # timed rounds after the validated step (0: no benchmark)
    warmup: int = 0  # untimed rounds before them
    stages: bool = False  # time every stage of a stage-based implementation


@dataclass
class FaultSchema:
    kind: Optional[str] = None  # raise | exit | hang | nan | corrupt (launcher.run.faults)
    rank: int = 0
    stage: str = "layer"  # fixture | golden | save | layer | gather | bench | compare


@dataclass
class RunSchema:
    layer: LayerSchema = MISSING
    model: ModelSchema = MISSING  # typed here: a model YAML of one's own is checked without naming a schema
    tp: Optional[int] = None  # attention layers; null = 4
    ep: Optional[int] = None  # the MoE layer; null = 2
    attention: Optional[str] = None  # layer=block: swa | csa | hca (or by layer_id)
    dp: int = 1
    layer_id: Optional[int] = None  # MoE case keys (null: layer 0, every token active, random routing)
    num_tokens: Optional[int] = None
    balanced_routing: Optional[bool] = None
    local_t: Optional[int] = None
    seed: int = 20260819
    start_pos: Any = None
    impl: Any = None
    backend: str = "auto"
    timeout_s: Optional[float] = None
    start_method: str = "forkserver"
    threads_per_rank: Optional[int] = None
    fail_fast: bool = False  # in a multirun: skip every job after the first that did not pass
    warm_ranks: bool = True  # single node: a job that passed leaves its rank processes for the next
    report: ReportSchema = field(default_factory=ReportSchema)
    golden_data: Optional[str] = None
    save_data: Optional[str] = None
    save_overwrite: bool = False
    recompute_golden: bool = False
    golden_cache: Optional[str] = None
    golden_cache_max_gb: Optional[float] = 4.0  # the cache's size cap (LRU eviction); None = no cap
    fault: FaultSchema = field(default_factory=FaultSchema)
    nnodes: Optional[int] = None  # null: 1, or the Slurm step's (launcher.config.slurm)
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    nproc_per_node: Optional[int] = None
    scope: str = "full"
    bisect: bool = False
    golden: bool = True  # false: performance only, no golden and no comparison (verdict UNCHECKED)
    bench: BenchSchema = field(default_factory=BenchSchema)
    profile: bool = False  # torch.profiler traces of the benchmark rounds, one per rank
    integrity: bool = True  # integrity checks beside the reference comparators (launcher.verify.integrity)
    # Open to any key (`tolerance.x_out.diff_thd=4e-3` needs no `+`); launcher.config.tolerance
    # checks the names against the layers' checks instead.
    tolerance: Any = field(default_factory=lambda: DictConfig({}, flags={"struct": False}))


def top_level_names() -> frozenset[str]:
    """What a command-line override may name first: a key of the run config, a config group
    (the folders of the `configs` package, `+sweep` among them), or `hydra`."""
    groups = {p.name for p in importlib.resources.files("configs").iterdir() if p.is_dir() and p.name != "__pycache__"}
    return frozenset(f.name for f in dataclasses.fields(RunSchema)) | groups | {"hydra"}


def register() -> None:
    """Everything composition needs from Python: the schemas, the model presets and the resolvers."""
    register_resolvers()
    cs = ConfigStore.instance()
    # The layer and model nodes take their schemas from RunSchema's typed fields: no schema is a
    # group option, which completion and "available options" would offer (`model=model_schema`).
    cs.store(name="run_schema", node=RunSchema)
    for name, preset in PRESETS.items():
        cs.store(group="model", name=name, node=ModelSchema(**dataclasses.asdict(preset)))
