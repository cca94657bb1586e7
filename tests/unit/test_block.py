"""layer=block: its case rules, its config keys, and its golden as the two halves' goldens
composed (on one rank in process; on real gloo ranks, tp = 1 bit for bit)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module

import launcher.cli  # noqa: F401  (registers the schemas)
from launcher.config.schema import refused_overrides
from launcher.config.spec import run_spec
from layers.block.case import BlockCase, attention_of_layer, resolve_attention
from layers.block.stages import HAND_OFF, MOE_RESIDUAL
from layers.contract.config import TINY, ConfigError
from layers.contract.context import RankContext
from layers.registry import get_layer, validated
from layers.tp import TorchTP

from ..rank_harness import run_ranks

BLOCK = get_layer("block")


def _case(attention="csa", tp=1, ep=1, local_t=None, layer_id=None) -> BlockCase:
    kind, layer = resolve_attention(attention, layer_id)
    local_t = local_t if local_t is not None else min(TINY.decode_tokens // tp, TINY.moe_tokens)
    return BlockCase(TINY, kind, tp, ep, local_t, seed=7, layer_id=layer)


def _compose(*overrides: str):
    with initialize_config_module(config_module="configs", version_base=None):
        return compose(config_name="config", overrides=["layer=block", "model=tiny", *overrides])


# -- the case ----------------------------------------------------------------------------------
def test_layer_id_picks_the_attention_by_the_schedule():
    assert [attention_of_layer(i) for i in (0, 1, 2, 3, 10, 11, 42, 43)] == \
        ["swa", "swa", "csa", "hca", "csa", "hca", "csa", "swa"]
    assert resolve_attention("hca", None) == ("hca", 3)  # the kind's first layer
    assert resolve_attention(None, 10) == ("csa", 10)
    assert resolve_attention(None, None) == ("csa", 10)  # the reference decode_layer's default


@pytest.mark.parametrize("attention, layer_id, words", [
    ("mla", None, "must be one of"),
    ("swa", 10, "is a csa layer"),
    (None, 44, "must be in [0, 43]"),
])
def test_attention_and_layer_id_are_refused_early(attention, layer_id, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        resolve_attention(attention, layer_id)


@pytest.mark.parametrize("keys, words", [
    (dict(tp=4, ep=2), "must divide ep=2"),
    (dict(tp=3, ep=3), "must divide o_groups"),  # the attention's own TP rule
    (dict(tp=1, ep=2, local_t=136), "<= the MoE's 128 tokens"),
    (dict(tp=1, ep=32), "ep=32 must be in"),
])
def test_case_rules_name_the_key(keys, words):
    case = _case(**{k: v for k, v in keys.items() if k != "local_t"}, local_t=keys.get("local_t", 64))
    with pytest.raises(ConfigError, match=words):
        validated(case)


def test_config_keys():
    spec = run_spec(_compose("attention=hca", "tp=2", "ep=4"), "/x")
    assert spec.case == BlockCase(TINY, "hca", 2, 4, 64, 20260819, 3) and spec.world == 4
    assert run_spec(_compose("layer_id=10"), "/x").case.attention == "csa"
    assert run_spec(_compose("attention=swa"), "/x").case.tp == 1  # data-parallel attention by default
    for refused, words in (("dp=2", "leave dp out"), ("tp=3", "tp >= 1 dividing it")):
        with pytest.raises(ConfigError, match=words):
            run_spec(_compose("attention=swa", refused), "/x")
    assert "attention is a key of layer=block" in refused_overrides(["layer=swa", "attention=csa"])
    assert "num_tokens is a key of layer=moe" in refused_overrides(["layer=block", "num_tokens=5"])


def test_tensors_are_both_halves_with_the_moe_residual_renamed():
    case = _case("hca", tp=2, ep=4)
    specs = BLOCK.tensor_specs(case)
    assert "x_out" not in specs and specs["x_hc"].shape == (64, 4, TINY.hidden_size)
    assert specs[MOE_RESIDUAL].shape == (TINY.moe_tokens, 4, TINY.hidden_size)
    assert BLOCK.compared_names(case) == ("compress_state", "kv_cache", "cmp_kv", "x_next")
    inputs = BLOCK.rank_inputs(case, 3)  # TP group 1, its rank 1
    group1 = get_layer("hca").rank_inputs(case.attention_case(1), 1)
    assert torch.equal(inputs["x_hc"], group1["x_hc"]) and torch.equal(inputs["wo_b"], group1["wo_b"])
    assert not torch.equal(inputs["x_hc"], get_layer("hca").rank_inputs(case.attention_case(0), 1)["x_hc"])
    assert int(inputs["num_tokens"]) == 64  # the padding rows are never routed


# -- the golden: the halves' goldens composed --------------------------------------------------
def _single_rank(case):
    ctx = RankContext(case=case, rank=0, device=torch.device("cpu"))
    return ctx, BLOCK.rank_inputs(case, 0)


def _cloned(tensors):
    return {n: t.clone() for n, t in tensors.items()}


@pytest.mark.parametrize("attention", ["swa", "csa", "hca"])
def test_golden_is_the_attention_golden_then_the_moe_golden(attention):
    case = _case(attention, local_t=64)
    ctx, inputs = _single_rank(case)
    golden = BLOCK.rank_golden(ctx, _cloned(inputs))
    # By hand: the attention layer's golden with full O weights, its rows as the first MoE tokens.
    attn, moe = get_layer(attention), get_layer("moe")
    attn_in = {n: t.clone() for n, t in inputs.items() if n in attn.tensor_specs(case.attention_case(0))}
    attn_in["wo_a"], attn_in["wo_b"] = attn.full_o_weights(case.attention_case(0))
    attn_out = attn.golden(case.attention_case(0), attn_in)
    moe_in = {n: inputs[n] for n in moe.tensor_specs(case.moe_case()) if n not in ("x_hc", "x_next")}
    x_hc = inputs[MOE_RESIDUAL].clone()
    x_hc[:64] = attn_out["x_out"]
    moe_ctx = dataclasses.replace(ctx, case=case.moe_case())
    assert torch.equal(golden["x_next"], moe.rank_golden(moe_ctx, {**moe_in, "x_hc": x_hc})["x_next"])
    for name in BLOCK.compared_names(case)[:-1]:
        assert torch.equal(golden[name], attn_out[name]), name


def test_tp1_forward_is_the_golden_bit_for_bit_and_shows_every_stage():
    case = _case("csa", local_t=64)
    ctx, inputs = _single_rank(case)
    golden = BLOCK.rank_golden(ctx, _cloned(inputs))
    seen = []

    class Watching(TorchTP):
        def run_stage(self, stage, ctx, values):
            seen.append((ctx.case.layer, stage.name))
            return super().run_stage(stage, ctx, values)

    out = Watching()(ctx, _cloned(inputs))
    for name in BLOCK.compared_names(case):
        assert torch.equal(out[name], golden[name]), name
    halves = [layer for layer, _ in seen]
    assert halves == sorted(halves, key=("csa", "block", "moe").index)  # attention, hand-off, MoE
    assert ("block", HAND_OFF.name) in seen and ("csa", "reduce_scatter") in seen and ("moe", "dispatch") in seen


def test_a_wrong_hand_off_changes_x_next():
    case = _case("swa", local_t=64)
    ctx, inputs = _single_rank(case)
    golden = BLOCK.rank_golden(ctx, _cloned(inputs))

    class Reversed(TorchTP):
        def run_stage(self, stage, ctx, values):
            if stage.name == HAND_OFF.name:
                values = {**values, "x_out": values["x_out"].flip(0)}
            return super().run_stage(stage, ctx, values)

    assert not torch.equal(Reversed()(ctx, _cloned(inputs))["x_next"], golden["x_next"])


# -- on real ranks ---------------------------------------------------------------------------
def _forward_and_golden(rank, world, case):
    ctx = RankContext(case=case, rank=rank, device=torch.device("cpu"), group=dist.group.WORLD)
    inputs = BLOCK.rank_inputs(case, rank)
    golden = BLOCK.rank_golden(ctx, _cloned(inputs))
    out = TorchTP()(ctx, _cloned(inputs))
    return {n: (out[n], golden[n]) for n in BLOCK.compared_names(case)}


@pytest.mark.slow
def test_data_parallel_attention_on_two_ranks_is_the_golden_bit_for_bit():
    for rank_out in run_ranks(2, _forward_and_golden, _case("hca", tp=1, ep=2, local_t=32)):
        for name, (out, golden) in rank_out.items():
            assert torch.equal(out, golden), name


@pytest.mark.slow
def test_two_tp_groups_of_two_agree_with_the_golden_that_one_process_computes():
    """Each rank's forward is close to its `rank_golden`, and `golden` of the world's stacked
    tensors on one process equals every rank's `rank_golden` bit for bit."""
    case = _case("swa", tp=2, ep=4, local_t=32)
    ranks = run_ranks(4, _forward_and_golden, case)
    for rank_out in ranks:
        out, golden = rank_out["x_next"]
        assert torch.allclose(out, golden, rtol=1e-2, atol=1e-3)
        assert torch.equal(*rank_out["kv_cache"])
    inputs = [BLOCK.rank_inputs(case, r) for r in range(case.ep)]
    stacked = {n: torch.stack([rank[n] for rank in inputs]) for n in inputs[0]}
    want = BLOCK.golden(case, stacked)
    for r, rank_out in enumerate(ranks):
        for name, (_, golden) in rank_out.items():
            assert torch.equal(want[name][r], golden), (r, name)


def test_the_stage_list_names_each_half():
    from layers.stages import layer_stages

    names = [s.name for s in layer_stages(_case("hca", tp=2, ep=4))]
    attention, moe = get_layer("hca").stages(TINY), get_layer("moe").stages(TINY)
    assert names == [f"hca.{s.name}" for s in attention] + ["hand_off"] + [f"moe.{s.name}" for s in moe]
