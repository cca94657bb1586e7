"""Preflight: every check before any process starts, on the config and on this machine.

`launcher.config.spec.validated_spec` reads the config into a validated RunSpec (every value, the
case, the layer's rules; with a replayed snapshot, its local_t). This adds what only the
machine can tell: that the snapshot's files fit the case, that the backend has a device for
every rank of this node, that node 0's rendezvous port is free, and that the implementation can
be imported. `python -m launcher` and `launcher.torchrun` both start here; every refusal is a
ConfigError naming the key, the value and the rule.
"""

from __future__ import annotations

import os

from hydra.utils import get_object
from omegaconf import DictConfig

from layers.contract.config import ConfigError

from launcher.config.spec import RunSpec, validated_spec
from launcher.run import devices
from launcher.store import snapshot


def preflight(cfg: DictConfig, output_dir: str) -> RunSpec:
    """The validated RunSpec of a composed config, checked against this machine."""
    spec = validated_spec(cfg, output_dir, snapshot_local_t=snapshot.fixed_local_t)
    if spec.golden_data:
        snapshot.check(spec.golden_data, spec.layer.tensor_specs(spec.case), spec.case.group_size)
    backend = devices.resolve_backend(spec.backend)
    devices.check_devices(backend, spec.local_ranks)
    # A rank of an external launcher (RANK set) finds the port held by that launcher's store.
    if spec.nnodes > 1 and spec.node_rank == 0 and "RANK" not in os.environ:
        devices.check_port_free(spec.master_addr, spec.master_port)
    try:
        get_object(spec.impl["_target_"])
    except Exception as e:  # ImportError, AttributeError, ...: all mean "cannot find it"
        reason = " ".join(str(e).split())
        raise ConfigError(f"impl._target_={spec.impl['_target_']!r} cannot be imported: {reason}") from e
    return spec
