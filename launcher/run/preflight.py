"""Preflight: every check before any process starts, on the config and on this machine.

`launcher.config.spec.validated_spec` reads the config into a validated RunSpec (every value, the
case, the layer's rules; with a replayed snapshot, the case it holds; the tolerances). This adds
what only the machine can tell, or the comparators: that the snapshot's files fit the case (and
its manifest's sha256), that a snapshot to save has a place to go, that the golden cache's
folder is the harness's (`launcher.store.cache_dir.claim`), that every comparator takes its
tolerances, that the backend has a device for every rank of this node (of its job slot, in
a sweep whose jobs run side by side), that node 0's rendezvous port is free, and that the
implementation can be imported. `python -m launcher` and `launcher.torchrun` both start here;
every refusal is a ConfigError naming the key, the value and the rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import pkgutil
from collections.abc import Sequence

from omegaconf import DictConfig

from layers.contract.config import ConfigError

from launcher.config.job_slot import JobSlot
from launcher.config.spec import RunSpec, validated_spec
from launcher.run import devices, golden_guard
from launcher.store import cache_dir, snapshot, snapshot_case
from launcher.verify.build import build_comparator


def preflight(cfg: DictConfig, output_dir: str, overrides: Sequence[str] | None = None,
              slot: JobSlot | None = None) -> RunSpec:
    """The validated RunSpec of a composed config, checked against this machine. `overrides`:
    the run's override strings (what the user gave explicitly; None: every key as composed);
    `slot`: the share of this node a sweep job running beside others holds."""
    spec = validated_spec(cfg, output_dir, overrides=overrides, describe_snapshot=snapshot_case.describe)
    spec = dataclasses.replace(spec, slot=slot)
    if spec.golden_data:
        snapshot.check(spec.golden_data, spec.layer.tensor_specs(spec.case), spec.case.group_size)
    if spec.golden_cache:
        with contextlib.suppress(OSError):  # unwritable: each rank's store says so, and the run goes on
            cache_dir.claim(spec.golden_cache)  # a folder that is not the harness's is refused
    if spec.save_data and spec.node_rank == 0:  # rank 0, on node 0, writes it
        snapshot.check_save_target(spec.save_data, spec.save_overwrite, spec.golden_data,
                                   spec.layer.tensor_specs(spec.case))
    for check in spec.layer.checks(spec.case):  # a tolerance a comparator refuses, before launch
        try:
            build_comparator(spec.tolerances.apply(check)[0], mapping_shape=(spec.case.group_size, spec.case.local_t),
                             leading_rank_axis=True)
        except ValueError as e:
            raise ConfigError(f"tolerance of {check.output}: {e}") from e
    backend = devices.resolve_backend(spec.backend)
    devices.check_devices(backend, spec.local_ranks, slot)
    # A rank of an external launcher (RANK set) finds the port held by that launcher's store.
    if spec.nnodes > 1 and spec.node_rank == 0 and "RANK" not in os.environ:
        devices.check_port_free(spec.master_addr, spec.master_port)
    elif spec.nnodes > 1:  # every rank of an external launcher's node checks, one launcher per node claims
        devices.wait_for_node0(spec.master_addr, spec.master_port, spec.timeout_s,
                               None if "RANK" in os.environ else spec.node_rank)
    # Before the implementation is first imported here, where a rank keeps this process's note:
    # one forked from it (start_method=fork), or this process itself (an external launcher's
    # rank). The forkserver's ranks have their own.
    if spec.start_method == "fork" or "RANK" in os.environ:
        golden_guard.record()
    return dataclasses.replace(spec, impl=implementation(spec.impl))


def implementation(impl: dict) -> dict:
    """The `impl` spec checked, and completed by the rule for what `impl._target_` names:

    * a class: instantiated once per rank with the other keys of `impl` as constructor
      arguments; the instance is called as `instance(ctx, tensors)`;
    * a function (any other callable): it is the implementation itself, called as
      `function(ctx, tensors, **other keys)` (Hydra's `_partial_`; `impl._partial_=false` makes
      it a factory instead, called once with the other keys to build the implementation).

    Refused with one line: a target that cannot be imported, is not callable, or whose
    signature cannot take those calls.
    """
    target = impl["_target_"]
    try:
        # Not hydra.utils.get_object: it also logs the error, which would then show twice.
        obj = pkgutil.resolve_name(target)
    except Exception as e:  # ImportError, AttributeError, ValueError, ...: all mean "cannot find it"
        raise ConfigError(f"impl._target_={target!r} cannot be imported: {type(e).__name__}: "
                          f"{' '.join(str(e).split())}") from e
    kwargs = {k: v for k, v in impl.items() if not k.startswith("_")}
    keys = "".join(f", {k}=..." for k in kwargs)
    if inspect.isclass(obj):
        _check_call(obj, (), kwargs, f"impl._target_={target!r}: the class cannot be built as {obj.__name__}({keys[2:]})")
        call = next((vars(c)["__call__"] for c in obj.__mro__ if "__call__" in vars(c)), None)
        if call is None:
            raise ConfigError(f"impl._target_={target!r} is a class whose instances cannot be called as impl(ctx, tensors)")
        _check_call(call, (None, None, None), {}, f"impl._target_={target!r}: its instances cannot be called as impl(ctx, tensors)")
        return impl
    if not callable(obj):
        raise ConfigError(f"impl._target_={target!r} is a {type(obj).__name__}, not a class or a function")
    if impl.get("_partial_") is False:  # a factory: called once with the other keys
        _check_call(obj, (), kwargs, f"impl._target_={target!r} (a factory, impl._partial_=false) cannot be called as ({keys[2:]})")
        return impl
    _check_call(obj, (None, None), kwargs, f"impl._target_={target!r} is a function that cannot be called as (ctx, tensors{keys})")
    return {**impl, "_partial_": True}


def _check_call(fn, args: tuple, kwargs: dict, refusal: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"{refusal}: {e}") from e
