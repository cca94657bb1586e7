"""Bisect (launcher.run.bisect, layers.stages) on real gloo ranks: each stage's defect is found there.

A defect is the default implementation with one stage replaced by name (the pattern of
tests/defects/), on one rank where the stage is rank-local, so the report must name both
the stage and the rank. Implementations that are not stage-based take part through the
intermediates they return. The observed stages must be the layer's forward bit for bit, and
the golden chain the layer's golden at tp = 1.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from launcher.report.bisect_lines import render
from launcher.run.bisect import OUTPUTS_STAGE, bisect_rank, gather_bisect, golden_chain
from layers.distributed.golden_walk import every_rank
from layers import stages, tp
from layers.hca import layer as hca
from layers.components import attention, hc, qkv
from layers.components import o_proj as output_half
from layers.components.hca_compressor import rope_compressed
from layers.components.kv_cache import write_rows
from layers.components.numerics import bf16
from layers.contract.case import Case
from layers.contract.config import TINY
from layers.contract.context import RankContext
from layers.distributed import collectives
from layers.registry import get_layer

from .. import defects
from ..rank_harness import run_ranks

CASE2 = Case("swa", TINY, 2, 56, 5)


def _bisect_job(rank: int, world: int, case: Case, impl_cls) -> dict | None:
    layer = get_layer(case.layer)
    ctx = RankContext(case=case, rank=rank, device=torch.device("cpu"), group=dist.group.WORLD)
    return gather_bisect(ctx, bisect_rank(layer, ctx, layer.rank_inputs(case, rank), impl_cls()))


def _bisect(impl_cls, case: Case = CASE2) -> dict:
    reports = run_ranks(case.tp, _bisect_job, case, impl_cls)
    assert all(r is None for r in reports[1:])
    json.dumps(reports[0])  # the report is JSON-ready
    return reports[0]


# -- one defect per stage kind ----------------------------------------------------------------
class _OnRank(defects.StageDefect):
    """The stage misbehaves on `rank` only (the other ranks run the layer's own)."""

    rank = 1

    def defective(self, stage, ctx, v):
        return self.broken(stage, ctx, v) if ctx.rank == self.rank else stage.run(ctx, v)


class HcPreMixesWrong(_OnRank):
    stages = ("hc_pre",)

    def broken(self, stage, ctx, v):
        out = stage.run(ctx, v)
        return {**out, "x_mixed": bf16(out["x_mixed"].float() * 1.05)}


class RmsNormEpsTooLarge(_OnRank):
    stages = ("rms_norm",)

    def broken(self, stage, ctx, v):
        return {"x_normed": qkv.rms_norm(v["x_mixed"], v["attn_norm_w"], 1.0)}


class QkvRopeSinFlipped(_OnRank):
    stages = ("qkv_proj_rope",)
    rank = 0

    def broken(self, stage, ctx, v):
        return stage.run(ctx, {**v, "freqs_sin": -v["freqs_sin"]})


class WindowOneKeyShort(_OnRank):
    stages = ("attention",)

    def broken(self, stage, ctx, v):
        return stage.run(ctx, {**v, "swa_lens": (v["swa_lens"] - 1).clamp_min(1)})


class InverseRopeSignFlipped(_OnRank):
    stages = ("pack_heads",)

    def broken(self, stage, ctx, v):
        return stage.run(ctx, {**v, "freqs_sin": -v["freqs_sin"]})


class ProjectionWithoutScale(_OnRank):
    """The per-rank partial never multiplied by wo_b_scale (P10)."""

    stages = ("sharded_o_proj",)
    rank = 0

    def broken(self, stage, ctx, v):
        return stage.run(ctx, {**v, "wo_b_scale": torch.ones_like(v["wo_b_scale"])})


class CombTransposed(_OnRank):
    stages = ("hc_post",)

    def broken(self, stage, ctx, v):
        t, hc_n = v["post"].shape
        return stage.run(ctx, {**v, "comb": v["comb"].reshape(t, hc_n, hc_n).transpose(1, 2).reshape(t, -1)})


@pytest.mark.parametrize(
    "impl, stage, ranks",
    [
        (HcPreMixesWrong, "hc_pre", [1]),
        (RmsNormEpsTooLarge, "rms_norm", [1]),
        (QkvRopeSinFlipped, "qkv_proj_rope", [0]),
        (defects.CacheWriteWrongSlot, "cache_insert", [0, 1]),
        (WindowOneKeyShort, "attention", [1]),
        (InverseRopeSignFlipped, "pack_heads", [1]),
        (defects.GroupsToWrongRank, "group_all_to_all", [0, 1]),
        (ProjectionWithoutScale, "sharded_o_proj", [0]),
        (defects.ReduceScatterWithoutSum, "reduce_scatter", [0, 1]),
        (CombTransposed, "hc_post", [1]),
        (defects.PerturbRankTokens, OUTPUTS_STAGE, [1]),
    ],
)
def test_defect_located_at_its_stage_and_rank(impl, stage, ranks):
    report = _bisect(impl)
    assert report["diverged"] and report["stage"] == stage, render(report)
    assert report["ranks"] == ranks and report["rank"] == ranks[0], render(report)
    assert report["mode"] == "isolated" and report["staged_forward_ranks"] == [0, 1]
    names = [row["stage"] for row in report["stages"]]
    for row in report["stages"][: names.index(stage)]:  # every earlier stage passes on every rank
        assert row["passed"] is True, row
    cell = next(c for c in report["stages"][names.index(stage)]["per_rank"] if c["rank"] == ranks[0])
    bad = next(t for t in cell["tensors"] if t["passed"] is False)
    assert bad["tensor"] == report["tensor"] and report["figures"] == bad["figures"]
    assert f"first divergence at stage '{stage}' on rank {ranks[0]}" in render(report)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_faithful_implementation_does_not_diverge(tp_size):
    case = Case("swa", TINY, tp_size, TINY.decode_tokens // tp_size, 3)
    report = _bisect(tp.TorchTP, case)
    assert not report["diverged"] and report["stage"] is None, render(report)
    assert [row["stage"] for row in report["stages"]] == [s.name for s in stages.layer_stages(case)] + [OUTPUTS_STAGE]
    for row in report["stages"]:
        assert row["passed"] is True and len(row["per_rank"]) == tp_size
        for cell in row["per_rank"]:
            for t in cell["tensors"]:  # the project's stages are the golden's own code: bitwise
                assert t["chain"] is None or t["chain"]["bitwise"], (row["stage"], t)
    assert "no stage diverges" in render(report)


# -- implementations that expose their intermediates ------------------------------------------
class OwnPipeline:
    """A user implementation that runs the SWA step itself (not through the layer's forward),
    with its sharded projection missing wo_b_scale on rank 0, and returns its intermediates."""

    expose = True

    def __call__(self, ctx, x):
        m = ctx.model
        x_mixed, post, comb = hc.hc_pre(x["x_hc"], x["hc_attn_fn"], x["hc_attn_scale"], x["hc_attn_base"], m)
        x_normed = qkv.rms_norm(x_mixed, x["attn_norm_w"], m.rms_norm_eps)
        q, kv, _, _ = qkv.qkv_proj_rope(
            x_normed, x["wq_a"], x["wq_b"], x["wq_b_scale"], x["wkv"], x["freqs_cos"], x["freqs_sin"],
            x["gamma_cq"], x["gamma_ckv"], m,
        )  # fmt: skip
        write_rows(x["kv_cache"], x["swa_slot_mapping"], kv)
        o = attention.window_attention(m, q, x["kv_cache"], x["swa_indices"], x["swa_lens"], x["attn_sink"])
        attention_grouped = attention.pack_heads(o, x["freqs_cos"], x["freqs_sin"], m)
        attention_local_groups = collectives.group_all_to_all(ctx, attention_grouped)
        scale = torch.ones_like(x["wo_b_scale"]) if ctx.rank == 0 else x["wo_b_scale"]
        o_partial = output_half.sharded_o_proj(attention_local_groups, x["wo_a"], x["wo_b"], scale)
        attn_out = collectives.reduce_scatter(ctx, o_partial)
        x_out = hc.hc_post(attn_out, x["x_hc"], post, comb)
        out = {"kv_cache": x["kv_cache"], "x_out": x_out}
        if self.expose:
            out.update(x_mixed=x_mixed, post=post, comb=comb, x_normed=x_normed, q=q, kv=kv, o=o,
                       attention_grouped=attention_grouped, attention_local_groups=attention_local_groups,
                       o_partial=o_partial, attn_out=attn_out)
        return out


class OwnPipelineOutputsOnly(OwnPipeline):
    expose = False


def test_exposed_intermediates_locate_the_stage():
    report = _bisect(OwnPipeline)
    assert report["staged_forward_ranks"] == []
    assert (report["stage"], report["ranks"], report["mode"]) == ("sharded_o_proj", [0], "isolated"), render(report)
    assert OUTPUTS_STAGE not in [row["stage"] for row in report["stages"]]


def test_outputs_only_are_judged_against_the_golden_chain():
    report = _bisect(OwnPipelineOutputsOnly)
    modes = {row["stage"]: set(row["modes"]) for row in report["stages"]}
    assert modes["cache_insert"] == {"chain"} and modes["hc_post"] == {"chain"}
    assert modes["hc_pre"] == {"absent"} and modes["reduce_scatter"] == {"absent"}
    # The cache is right; x_out is where the error shows, against the chain, on every rank
    # (rank 0's missing scale reaches every owner through the reduce-scatter).
    assert (report["stage"], report["tensor"], report["mode"]) == ("hc_post", "x_out", "chain"), render(report)
    assert report["ranks"] == [0, 1]


def test_stage_tensors_name_the_interface():
    names = stages.stage_tensors(CASE2)
    assert names["hc_pre"] == ("x_mixed", "post", "comb")
    assert names["group_all_to_all"] == ("attention_local_groups",)
    assert names["hc_post"] == ("x_out",)
    assert {n for ns in names.values() for n in ns} >= set(get_layer("swa").compared_names(CASE2))


# -- the instrument itself --------------------------------------------------------------------
@pytest.mark.parametrize("layer_name", ["swa", "csa", "hca"])
def test_observed_stages_are_the_layer_forward_bitwise(layer_name):
    case = Case(layer_name, TINY, 1, 64, 9)
    layer = get_layer(layer_name)
    ctx = RankContext(case=case, rank=0, device=torch.device("cpu"))
    inputs = layer.rank_inputs(case, 0)
    want = layer.forward(ctx, {n: t.clone() for n, t in inputs.items()})
    record = {}

    def observe(stage, run):
        record[stage.name] = {n: t.clone() for n, t in run().items()}
        return record[stage.name]

    got = tp.TorchTP()(dataclasses.replace(ctx, observe=observe), {n: t.clone() for n, t in inputs.items()})
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n
    assert list(record) == [s.name for s in stages.layer_stages(case)]
    assert torch.equal(record["hc_post"]["x_out"], want["x_out"])


@pytest.mark.parametrize("layer_name", ["swa", "csa", "hca"])
def test_golden_chain_is_the_layer_golden_at_tp1(layer_name):
    case = Case(layer_name, TINY, 1, 64, 9)
    layer = get_layer(layer_name)
    ctx = RankContext(case=case, rank=0, device=torch.device("cpu"))
    inputs = layer.rank_inputs(case, 0)
    chain = golden_chain(stages.layer_stages(case), ctx, inputs)
    latest = {n: t for outputs in chain.values() for n, t in outputs.items()}
    golden_in = {n: t.clone() for n, t in inputs.items()}
    golden_in["wo_a"], golden_in["wo_b"] = layer.full_o_weights(case)
    want = layer.golden(case, golden_in)
    for n in layer.compared_names(case):
        assert torch.equal(latest[n], want[n]), n
    for n, t in layer.rank_inputs(case, 0).items():  # the chain ran on clones
        assert torch.equal(inputs[n], t), n


@pytest.mark.parametrize("layer_name", ["csa", "hca"])
def test_faithful_csa_and_hca_do_not_diverge(layer_name):
    report = _bisect(tp.TorchTP, dataclasses.replace(CASE2, layer=layer_name))
    assert not report["diverged"], render(report)
    for row in report["stages"]:
        for cell in row["per_rank"]:
            assert all(t["chain"] is None or t["chain"]["bitwise"] for t in cell["tensors"]), row["stage"]


class CompressorRowsOff(_OnRank):
    stages = ("compressor",)

    def broken(self, stage, ctx, v):
        out = stage.run(ctx, v)
        rows = out["cmp_kv"].view(-1, out["cmp_kv"].shape[-1])
        written = (v["cmp_slot_mapping"][v["cmp_slot_mapping"] >= 0]).unique()
        rows[written] = bf16(rows[written].float() * 1.01)
        return out


class InnerCommitOff(_OnRank):
    stages = ("indexer_compressor",)
    rank = 0

    def broken(self, stage, ctx, v):
        out = stage.run(ctx, v)
        rows = out["idx_kv_cache"].view(-1, out["idx_kv_cache"].shape[-1])
        written = (v["idx_slot_mapping"][v["idx_slot_mapping"] >= 0]).unique()
        rows[written] = rows[written].flip(-1)
        return out


class TopkReversed(_OnRank):
    stages = ("indexer_topk",)

    def broken(self, stage, ctx, v):
        return stage.run(ctx, {**v, "idx_weights": -v["idx_weights"]})


class HcaPooledOff(_OnRank):
    stages = ("compressor",)

    def broken(self, stage, ctx, v):
        return hca.compressor(ctx, v, rotate=lambda y, cos, sin, model: rope_compressed(y * 1.01, cos, sin, model))


@pytest.mark.parametrize(
    "layer_name, impl, stage, ranks",
    [
        ("csa", CompressorRowsOff, "compressor", [1]),
        ("csa", InnerCommitOff, "indexer_compressor", [0]),
        ("csa", TopkReversed, "indexer_topk", [1]),
        ("hca", HcaPooledOff, "compressor", [1]),
        ("hca", defects.ReduceScatterWithoutSum, "reduce_scatter", [0, 1]),
    ],
)
def test_compressor_and_indexer_defects_located(layer_name, impl, stage, ranks):
    report = _bisect(impl, dataclasses.replace(CASE2, layer=layer_name))
    assert (report["stage"], report["ranks"]) == (stage, ranks), render(report)


def _reference_collectives_job(rank, world, case):
    ctx = RankContext(case=case, rank=rank, device=torch.device("cpu"), group=dist.group.WORLD)
    names = [st.name for st in stages.layer_stages(case)]
    a2a, rs = (stages.layer_stages(case)[names.index(n)] for n in ("group_all_to_all", "reduce_scatter"))
    gen = torch.Generator().manual_seed(rank)
    g, t, gi, d = case.model.o_groups, case.local_t, case.model.group_in, case.model.hidden_size
    a = bf16(torch.randn(g, t, gi, generator=gen))
    part = torch.randn(world * t, d, generator=gen)
    golden_a2a = a2a.golden(ctx, {"attention_grouped": every_rank(ctx, a)})["attention_local_groups"]
    golden_rs = rs.golden(ctx, {"o_partial": every_rank(ctx, part)})["attn_out"]
    return {"a": a, "part": part, "a2a": golden_a2a, "a2a_impl": collectives.group_all_to_all(ctx, a),
            "rs": golden_rs, "rs_impl": collectives.reduce_scatter(ctx, part)}


def test_cross_rank_goldens_are_the_spec_index_maps():
    case = Case("swa", TINY, 4, 16, 0)
    res = run_ranks(4, _reference_collectives_job, case)
    p, t, lg = 4, 16, TINY.o_groups // 4
    for d in range(p):
        for j in range(lg):
            for s in range(p):
                for i in range(t):  # §5.3: X_d[lg, s·t + i] = A_s[d·LG + lg, i]
                    assert torch.equal(res[d]["a2a"][j, s * t + i], res[s]["a"][d * lg + j, i])
        acc = res[0]["part"][d * t : (d + 1) * t].clone()
        for s in range(1, p):  # §5.5: ascending source rank
            acc = acc + res[s]["part"][d * t : (d + 1) * t]
        assert torch.equal(res[d]["rs"], bf16(acc))
        # and the project's collectives agree with them bitwise
        assert torch.equal(res[d]["a2a_impl"], res[d]["a2a"]) and torch.equal(res[d]["rs_impl"], res[d]["rs"])


@pytest.mark.parametrize(
    "layer, impl, stage",
    [("swa", defects.ReduceScatterWithoutSum, "reduce_scatter"), ("swa", defects.CacheWriteWrongSlot, "cache_insert"),
     ("hca", defects.GroupsToWrongRank, "group_all_to_all")],
)
def test_bisect_through_the_launcher_names_the_stage(tp_run, layer, impl, stage):
    run = tp_run(layer=layer, tp=2, model="tiny", impl=impl, bisect=True)
    assert run.exit_code == 1, run
    assert run.result["bisect"]["stage"] == stage, run
    assert f"first divergence at stage '{stage}'" in run.report


def test_bisect_of_a_passing_run_is_not_run(tp_run):
    run = tp_run(layer="swa", tp=2, model="tiny", bisect=True)
    assert run.passed and "bisect" not in run.result
