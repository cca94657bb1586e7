"""Preflight: every check before any process starts, on the config and on this machine.

`launcher.config.spec.validated_spec` reads the config into a validated RunSpec (every value, the
case, the layer's rules; with a replayed snapshot, the case it holds; the tolerances). This adds
what only the machine can tell, or the comparators: that the snapshot's files fit the case (and
its manifest's sha256), that a snapshot to save has a place to go, that every comparator takes
its tolerances, that the backend has a device for every rank of this node, that node 0's
rendezvous port is free, and that the implementation can be imported. `python -m launcher` and
`launcher.torchrun` both start here; every refusal is a ConfigError naming the key, the value
and the rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra.utils import get_object
from omegaconf import DictConfig

from layers.contract.config import ConfigError

from launcher.config.spec import RunSpec, validated_spec
from launcher.run import devices
from launcher.store import snapshot, snapshot_case
from launcher.verify.build import build_comparator


def preflight(cfg: DictConfig, output_dir: str, overrides: Sequence[str] | None = None) -> RunSpec:
    """The validated RunSpec of a composed config, checked against this machine. `overrides`:
    the run's override strings (what the user gave explicitly; None: every key as composed)."""
    spec = validated_spec(cfg, output_dir, overrides=overrides, describe_snapshot=snapshot_case.describe)
    if spec.golden_data:
        snapshot.check(spec.golden_data, spec.layer.tensor_specs(spec.case), spec.case.group_size)
    if spec.save_data and spec.node_rank == 0:  # rank 0, on node 0, writes it
        snapshot.check_save_target(spec.save_data, spec.save_overwrite, spec.golden_data)
    for check in spec.layer.checks(spec.case):  # a tolerance a comparator refuses, before launch
        try:
            build_comparator(spec.tolerances.apply(check)[0], mapping_shape=(spec.case.group_size, spec.case.local_t),
                             leading_rank_axis=True)
        except ValueError as e:
            raise ConfigError(f"tolerance of {check.output}: {e}") from e
    backend = devices.resolve_backend(spec.backend)
    devices.check_devices(backend, spec.local_ranks)
    if spec.nnodes > 1 and spec.node_rank == 0:
        devices.check_port_free(spec.master_addr, spec.master_port)
    try:
        get_object(spec.impl["_target_"])
    except Exception as e:  # ImportError, AttributeError, ...: all mean "cannot find it"
        reason = " ".join(str(e).split())
        raise ConfigError(f"impl._target_={spec.impl['_target_']!r} cannot be imported: {reason}") from e
    return spec
