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
import functools
import importlib.resources
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from layers.contract.case import CASE_KEYS
from layers.contract.config import PRESETS, ModelConfig

from launcher.config.overrides import foreign_case_key, renamed_key, unknown_top_level
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
    kind: Optional[str] = None  # raise | exit | hang | nan | corrupt (launcher.run.fault_injection)
    rank: int = 0
    phase: str = "layer"  # the rank phase: fixture | golden | save | layer | gather | bench | compare


@dataclass
class RunSchema:
    """The keys every run has; a layer's case keys come with its config group (`layer_schemas`)."""

    layer: LayerSchema = MISSING
    model: ModelSchema = MISSING  # typed here: a model YAML of one's own is checked without naming a schema
    phase: str = "decode"  # decode | prefill (context-parallel, layers/prefill)
    cp: Optional[int] = None  # phase=prefill: CP size; null = 2
    cp_layout: str = "zigzag"  # phase=prefill: zigzag | contiguous
    prefix: int = 0  # phase=prefill: history rows in the KV cache before the step
    segment_lens: Any = None  # phase=prefill: 2*cp segment lengths; null = one window each
    dp: int = 1
    seed: int = 20260819
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


def _with_case_keys(name: str, keys: type) -> type:
    """RunSchema and one set of case keys (`layers.contract.case.CASE_KEYS`), every key's default
    left to the layer's config group."""
    hints = typing.get_type_hints(keys)
    schema = dataclasses.make_dataclass(
        f"{keys.__name__}RunSchema", [(f.name, hints[f.name], field(default=MISSING)) for f in dataclasses.fields(keys)],
        bases=(RunSchema,),
    )
    schema.__module__ = __name__  # found by pickle, as ModelSchema
    globals()[schema.__name__] = schema
    return schema


# The run config of a layer whose group names case keys `name` (`- /layer_keys/<name>` in
# configs/layer/<layer>.yaml): RunSchema with those keys, no other layer's.
LAYER_SCHEMAS = {name: _with_case_keys(name, keys) for name, keys in CASE_KEYS.items()}


def _configs():
    return importlib.resources.files("configs")


@functools.cache
def layer_groups() -> dict[str, dict]:
    """Each option of the layer group (configs/layer/<name>.yaml): its case-key set and its keys'
    defaults, as the file gives them."""
    groups = {}
    for path in sorted(_configs().joinpath("layer").iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml"):
            node = OmegaConf.to_container(OmegaConf.load(str(path)), resolve=False)
            key_set = next(str(d).rsplit("/", 1)[1] for d in node.pop("defaults") if str(d).startswith("/layer_keys/"))
            node.pop("layer")
            groups[path.name[: -len(".yaml")]] = {"key_set": key_set, "keys": node}
    return groups


@functools.cache
def default_layer() -> str:
    """The layer config.yaml's defaults list selects."""
    defaults = OmegaConf.load(str(_configs().joinpath("config.yaml"))).defaults
    return next(str(d["layer"]) for d in defaults if isinstance(d, DictConfig) and "layer" in d)


def layer_keys() -> dict[str, tuple[str, ...]]:
    """Each layer's case keys, by layer name."""
    return {name: tuple(group["keys"]) for name, group in layer_groups().items()}


def with_layer(cfg: DictConfig, name: str) -> DictConfig:
    """`cfg` composed for layer `name` instead of its own (a replayed snapshot's layer): its keys
    as they are where `name` takes them, the case keys `name` does not take dropped, and the
    ones `name` takes but `cfg` lacks at their defaults."""
    group = layer_groups()[name]
    foreign = {k for keys in layer_keys().values() for k in keys} - set(group["keys"])
    kept = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k not in foreign}
    merged = OmegaConf.merge(LAYER_SCHEMAS[group["key_set"]], group["keys"], kept)
    merged.layer.name = name
    return merged


def top_level_names() -> frozenset[str]:
    """What a command-line override may name first: a key of the run config or of a layer, a
    config group (the folders of the `configs` package, `+sweep` among them), or `hydra`."""
    groups = {p.name for p in _configs().iterdir() if p.is_dir() and p.name != "__pycache__"}
    case_keys = {f.name for keys in CASE_KEYS.values() for f in dataclasses.fields(keys)}
    return frozenset(f.name for f in dataclasses.fields(RunSchema)) | case_keys | groups | {"hydra"}


# Keys renamed: old -> new (`fault.stage` named a rank phase, `launcher.config.rank_phases`).
RENAMED_KEYS = {"fault.stage": "fault.phase"}


def refused_overrides(overrides: list[str]) -> str | None:
    """Why command-line overrides would not compose, in the user's words: a renamed key (with its
    new name), a key no config has (with the nearest), or a case key of a layer the run does not
    run; None: they compose."""
    return (renamed_key(overrides, RENAMED_KEYS)
            or unknown_top_level(overrides, top_level_names())
            or foreign_case_key(overrides, layer_keys(), default_layer()))


def register() -> None:
    """Everything composition needs from Python: the schemas, the model presets and the resolvers."""
    register_resolvers()
    cs = ConfigStore.instance()
    # The layer and model nodes take their schemas from RunSchema's typed fields: no schema is a
    # group option, which completion and "available options" would offer (`model=model_schema`).
    cs.store(name="run_schema", node=RunSchema)
    for name, schema in LAYER_SCHEMAS.items():
        cs.store(group="layer_keys", name=name, node=schema, package="_global_")
    for name, preset in PRESETS.items():
        cs.store(group="model", name=name, node=ModelSchema(**dataclasses.asdict(preset)))
