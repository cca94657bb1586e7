"""Runs that are neither PASS nor FAIL: an implementation that breaks its contract by changing a
pure input in place, and a reference that is not finite where it must be (exit 2, naming the
rank, the tensor and what to check)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module

from launcher.config.spec import run_spec
from launcher.run.worker import GoldenNotFinite, check_reference_finite
from layers.contract.checks import PoolCheck

from .. import defects


def test_an_impl_that_changes_its_pure_inputs_is_a_contract_error(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", impl=defects.CorruptPureInputs)
    assert run.exit_code == 2, run
    err = run.result["error"]
    assert (err["rank"], err["phase"]) == (1, "layer"), run
    assert "ImplContractError: rank 1: impl changed its pure input(s) wq_a, swa_slot_mapping in place" in run.report


def test_an_moe_impl_that_changes_its_pure_inputs_is_a_contract_error(tp_run):
    run = tp_run(layer="moe", ep=2, model="tiny", impl=defects.MoeCorruptsItsInputs)
    assert run.exit_code == 2, run
    err = run.result["error"]
    assert (err["rank"], err["phase"]) == (1, "layer"), run
    assert "ImplContractError: rank 1: impl changed its pure input(s) x_hc, input_ids in place" in run.report


def _spec(*overrides: str):
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    return run_spec(cfg, "/nonexistent")


def test_a_nonfinite_computed_golden_names_the_config():
    spec = _spec("layer=swa", "model=tiny", "tp=2", "model.decode_batch=32", "seed=5")
    layer = spec.layer
    inputs, wo = layer.rank_inputs_and_full_o(spec.case, 1)
    golden = layer.golden(spec.case, {**{n: t.clone() for n, t in inputs.items()}, "wo_a": wo[0], "wo_b": wo[1]})
    check_reference_finite(spec, spec.case, layer, "golden", golden, inputs, rank=1)  # a sound golden passes
    pool = next(c for c in layer.checks(spec.case) if isinstance(c, PoolCheck))
    unmapped = torch.ones(golden[pool.output].view(-1, golden[pool.output].shape[-1]).shape[0], dtype=torch.bool)
    unmapped[inputs[pool.mapping][inputs[pool.mapping] >= 0]] = False
    golden[pool.output].view(-1, golden[pool.output].shape[-1])[unmapped.nonzero()[0]] = float("-inf")
    check_reference_finite(spec, spec.case, layer, "golden", golden, inputs, rank=1)  # unmapped rows may hold sentinels
    golden["x_out"][2, 1, :3] = float("nan")
    with pytest.raises(GoldenNotFinite) as e:
        check_reference_finite(spec, spec.case, layer, "golden", golden, inputs, rank=1)
    assert str(e.value) == (
        "rank 1: the golden computed for layer=swa model=tiny model.decode_batch=32 scope=full tp=2 local_t=128 seed=5 "
        "start_pos=None holds 3 non-finite value(s) in x_out where it must be finite: a reference error, "
        "not the implementation's")
    with pytest.raises(GoldenNotFinite, match="^rank 1: the golden read from the golden cache for layer=swa "):
        check_reference_finite(spec, spec.case, layer, "golden", golden, inputs, rank=1, cached=True)
