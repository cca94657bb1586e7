"""The per-rank stages of each TP layer, for locating the first divergent stage (validation.md §7).

A layer's step on rank r is a straight line of stages: hc_pre, rms_norm, qkv_proj_rope, then
the layer's own — SWA: cache_insert, attention (swa.md §6); CSA: compressor (main compressor
and its cmp_kv commit), indexer_compressor (inner compressor and the idx cache commit),
indexer_topk (query, weights, scores, top-k), cache_insert, attention (csa.md §3); HCA:
compressor, cache_insert, attention (hca.md §4) — then pack_heads and the shared output half:
group_all_to_all, sharded_o_proj, reduce_scatter, hc_post (swa.md §5). Each `Stage` names the tensors it reads (rank
tensors or earlier stages' outputs, by the spec's names) and writes, the project's
implementation of it and its golden, and the check of each output:

  * `impl(ctx, values)` runs the stage as the layer's TP forward does, through the module
    attributes at call time, so a stage monkeypatched inside an implementation's call (the
    defects of tests/defects.py) is the one that runs;
  * `golden(ctx, values)` is the reference math, with references taken at import. A
    cross-rank stage's golden reads every rank's value of the inputs listed in `every_rank`
    (stacked `[P, ...]`; `launcher.bisect` gathers them) and applies swa.md §5.3 / §5.5's
    index maps, so it never runs the collectives under test.

`staged_forward` is the layer's TP forward run stage by stage, recording every stage's outputs;
it returns exactly what the layer's `forward` returns. The stage tensors and their shapes are
the interface a user implementation exposes its intermediates through (`stage_tensors`).

Tolerances (`StageOutput.check`) judge a stage's output against the golden stage on the same
inputs: data movement (the cache insert, the all-to-all) must be bitwise; bf16 results may
differ by 1–2 ulps (rtol 1/128, validation.md §7) and fp32 ones by 1e-4 relative, in at most
0.5 % of the elements for stages with internal quantization or tiles; the reduce-scatter's
bf16 sum in every element. `chain_check` judges it against the golden's own chain when the
implementation does not expose the stage's inputs (the layer's own check for compared outputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import csa, hca, swa
from .components import attention, hc, hca_compressor, qkv
from .components import o_proj as output_half
from .components.numerics import bf16
from .contract.case import Case
from .contract.checks import AllcloseCheck, Check, ExactCheck
from .contract.config import ConfigError
from .contract.context import RankContext
from .distributed import collectives as tp

Values = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StageOutput:
    check: Check  # this stage's output vs the golden stage run on the same inputs
    chain_check: Check | None = None  # vs the golden chain where the inputs are not exposed; None: `check`

    @property
    def name(self) -> str:
        return self.check.output


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[StageOutput, ...]
    impl: Callable[[RankContext, Values], dict[str, torch.Tensor]]
    golden: Callable[[RankContext, Values], dict[str, torch.Tensor]]
    every_rank: tuple[str, ...] = ()  # inputs the golden needs from every rank, stacked [P, ...]

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs)


def _bf16(name: str, max_error_ratio: float = 0.005) -> AllcloseCheck:
    return AllcloseCheck(name, atol=1e-4, rtol=1 / 128, max_error_ratio=max_error_ratio)


def _fp32(name: str) -> AllcloseCheck:
    return AllcloseCheck(name, atol=1e-5, rtol=1e-4)


# -- the output half (swa.md §5), shared by every layer ---------------------------------------
# The golden's references, bound at import (an injected defect never reaches them).
_GOLDEN_SHARDED_O_PROJ = output_half.sharded_o_proj
_GOLDEN_HC_POST = hc.hc_post


def _group_all_to_all_golden(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§5.3: `X_d[lg, s·t + i] = A_s[d·LG + lg, i]` from every rank's attention_grouped [P, G, t, GI]."""
    every = v["attention_grouped"]
    p, g, t, gi = every.shape
    lg = g // p
    mine = every[:, ctx.rank * lg : (ctx.rank + 1) * lg]  # [P, LG, t, GI]
    return {"attention_local_groups": mine.permute(1, 0, 2, 3).reshape(lg, p * t, gi)}


def _reduce_scatter_golden(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§5.5: owner o sums rows [o·t, (o+1)·t) of every rank's partial [P, P·t, D], ascending rank."""
    every = v["o_partial"]
    p = every.shape[0]
    t = every.shape[1] // p
    mine = every[:, ctx.rank * t : (ctx.rank + 1) * t]
    acc = mine[0].clone()
    for s in range(1, p):  # ascending source rank: the reference's fp32 order
        acc = acc + mine[s]
    return {"attn_out": bf16(acc)}


def _sharded_o_proj(fn: Callable, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"o_partial": fn(v["attention_local_groups"], v["wo_a"], v["wo_b"], v["wo_b_scale"])}


def _hc_post(fn: Callable, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"x_out": fn(v["attn_out"], v["x_hc"], v["post"], v["comb"])}


def output_half_stages(checks: Mapping[str, Check]) -> tuple[Stage, ...]:
    """The all-to-all, the sharded projection, the reduce-scatter and hc_post (§6 steps 6–9)."""
    return (
        Stage(
            "group_all_to_all", ("attention_grouped",),
            (StageOutput(ExactCheck("attention_local_groups"), _bf16("attention_local_groups")),),
            lambda ctx, v: {"attention_local_groups": tp.group_all_to_all(ctx, v["attention_grouped"])},
            _group_all_to_all_golden, every_rank=("attention_grouped",),
        ),
        Stage(
            "sharded_o_proj", ("attention_local_groups", "wo_a", "wo_b", "wo_b_scale"),
            (StageOutput(AllcloseCheck("o_partial", atol=1e-4, rtol=1 / 128)),),
            lambda ctx, v: _sharded_o_proj(output_half.sharded_o_proj, ctx, v),
            functools.partial(_sharded_o_proj, _GOLDEN_SHARDED_O_PROJ),
        ),
        Stage(
            "reduce_scatter", ("o_partial",),
            (StageOutput(_bf16("attn_out", max_error_ratio=0.0), _bf16("attn_out")),),
            lambda ctx, v: {"attn_out": tp.reduce_scatter(ctx, v["o_partial"])},
            _reduce_scatter_golden, every_rank=("o_partial",),
        ),
        Stage(
            "hc_post", ("attn_out", "x_hc", "post", "comb"),
            (StageOutput(_fp32("x_out"), checks["x_out"]),),
            lambda ctx, v: _hc_post(hc.hc_post, ctx, v),
            functools.partial(_hc_post, _GOLDEN_HC_POST),
        ),
    )  # fmt: skip


# -- SWA (swa.md §6 steps 1–5) ----------------------------------------------------------------
HC_PRE_INPUTS = ("x_hc", "hc_attn_fn", "hc_attn_scale", "hc_attn_base")
HC_PRE_OUTPUTS = (StageOutput(_bf16("x_mixed")), StageOutput(_fp32("post")), StageOutput(_fp32("comb")))
RMS_NORM_INPUTS, RMS_NORM_OUTPUTS = ("x_mixed", "attn_norm_w"), (StageOutput(_bf16("x_normed")),)
QKV_WEIGHTS = ("wq_a", "wq_b", "wq_b_scale", "wkv", "gamma_cq", "gamma_ckv")


class SWASteps(NamedTuple):
    hc_pre: Callable
    rms_norm: Callable
    qkv_proj_rope: Callable
    write_cache_rows: Callable
    swa_attention: Callable
    pack_heads: Callable


def swa_live_steps() -> SWASteps:
    """SWA's per-rank steps as their modules hold them now (what the TP forward runs)."""
    return SWASteps(
        hc.hc_pre, qkv.rms_norm, qkv.qkv_proj_rope, swa.write_cache_rows, swa.swa_attention, attention.pack_heads
    )


_SWA_GOLDEN = swa_live_steps()  # bound at import: an injected defect never reaches the golden


# The stages shared by SWA and HCA take any steps tuple with the fields they call (SWASteps,
# HCASteps, csa.Steps).
def _hc_pre_stage(s, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    x_mixed, post, comb = s.hc_pre(v["x_hc"], v["hc_attn_fn"], v["hc_attn_scale"], v["hc_attn_base"], ctx.model)
    return {"x_mixed": x_mixed, "post": post, "comb": comb}


def _rms_norm_stage(s, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"x_normed": s.rms_norm(v["x_mixed"], v["attn_norm_w"], ctx.model.rms_norm_eps)}


def _qkv_stage(s, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    q, kv, _qr, _qr_scale = s.qkv_proj_rope(
        v["x_normed"], v["wq_a"], v["wq_b"], v["wq_b_scale"], v["wkv"], v["freqs_cos"], v["freqs_sin"],
        v["gamma_cq"], v["gamma_ckv"], ctx.model,
    )  # fmt: skip
    return {"q": q, "kv": kv}


def _swa_cache_insert(s: SWASteps, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    s.write_cache_rows(v["kv_cache"], v["swa_slot_mapping"], v["kv"])  # in place
    return {"kv_cache": v["kv_cache"]}


def _swa_attention(s: SWASteps, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"o": s.swa_attention(ctx.model, v["q"], v["kv_cache"], v["swa_indices"], v["swa_lens"], v["attn_sink"])}


def _pack_heads_stage(s, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"attention_grouped": s.pack_heads(v["o"], v["freqs_cos"], v["freqs_sin"], ctx.model)}


def _local(
    name: str, fn: Callable, live: Callable[[], tuple], golden: tuple, inputs: tuple[str, ...],
    outputs: tuple[StageOutput, ...],
) -> Stage:
    """A rank-local stage: the same code with the live steps (impl, `live()` at call time) and the golden's."""
    return Stage(name, inputs, outputs, lambda ctx, v: fn(live(), ctx, v), functools.partial(fn, golden))


def _pool(check: Check) -> AllcloseCheck:
    """A pool re-computed from the same inputs: the layer's tolerance on every element, stray
    writes included (the whole pool is compared, budget 0)."""
    return AllcloseCheck(check.output, atol=check.atol, rtol=check.rtol, max_error_ratio=0.0)


def swa_stages(case: Case) -> tuple[Stage, ...]:
    checks = {c.output: c for c in swa.LAYER.checks(case)}
    stage = functools.partial(_local, live=swa_live_steps, golden=_SWA_GOLDEN)
    return (
        stage("hc_pre", _hc_pre_stage, inputs=HC_PRE_INPUTS, outputs=HC_PRE_OUTPUTS),
        stage("rms_norm", _rms_norm_stage, inputs=RMS_NORM_INPUTS, outputs=RMS_NORM_OUTPUTS),
        stage("qkv_proj_rope", _qkv_stage, inputs=("x_normed", *QKV_WEIGHTS, "freqs_cos", "freqs_sin"),
              outputs=(StageOutput(_bf16("q")), StageOutput(_bf16("kv")))),
        stage("cache_insert", _swa_cache_insert, inputs=("kv_cache", "swa_slot_mapping", "kv"),
              outputs=(StageOutput(ExactCheck("kv_cache"), checks["kv_cache"]),)),
        stage("attention", _swa_attention, inputs=("q", "kv_cache", "swa_indices", "swa_lens", "attn_sink"),
              outputs=(StageOutput(_bf16("o")),)),
        stage("pack_heads", _pack_heads_stage, inputs=("o", "freqs_cos", "freqs_sin"),
              outputs=(StageOutput(_bf16("attention_grouped")),)),
        *output_half_stages(checks),
    )  # fmt: skip


# -- CSA (csa.md §3 steps 1–8) ----------------------------------------------------------------
class CSAFunctions(NamedTuple):
    steps: csa.Steps
    compressor_rows: Callable
    rope_rows: Callable


def csa_live_functions() -> CSAFunctions:
    return CSAFunctions(csa.live_steps(), csa.compressor_rows, csa.rope_rows)


_CSA_GOLDEN = csa_live_functions()  # bound at import, as SWA's


def _csa_rows(f: CSAFunctions, ctx: RankContext, v: Values):
    return f.rope_rows(v["freqs_cos"], v["freqs_sin"], v["position_ids"], ctx.model.decode_seq)


def _csa_first(ctx: RankContext, v: Values) -> torch.Tensor:
    return v["position_ids"].to(torch.int64)[:: ctx.model.decode_seq]


def _csa_hc_pre(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return _hc_pre_stage(f.steps, ctx, v)


def _csa_rms_norm(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return _rms_norm_stage(f.steps, ctx, v)


def _csa_qkv(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    rows = _csa_rows(f, ctx, v)
    q, kv, qr, qr_scale = f.steps.qkv_proj_rope(
        v["x_normed"], v["wq_a"], v["wq_b"], v["wq_b_scale"], v["wkv"], rows.token_cos, rows.token_sin,
        v["gamma_cq"], v["gamma_ckv"], ctx.model,
    )  # fmt: skip
    return {"q": q, "kv": kv, "qr": qr, "qr_scale": qr_scale}


def _csa_compressor(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The main compressor and its cmp_kv commit (§4.5); both pools in place."""
    s, m, rows = f.steps, ctx.model, _csa_rows(f, ctx, v)
    main = f.compressor_rows(
        s, m, v["x_normed"], (v["cmp_wkv"], v["cmp_wgate"], v["cmp_ape"], v["cmp_norm_w"]), v["compress_state"],
        v["compress_state_block_table"], v["state_slot_mapping"], v["position_ids"], rows.cmp_cos, rows.cmp_sin,
    )  # fmt: skip
    s.commit_cmp_rows(v["cmp_kv"], s.commit_slots(_csa_first(ctx, v), v["cmp_slot_mapping"], m.decode_seq), main)
    return {"compress_state": v["compress_state"], "cmp_kv": v["cmp_kv"]}


def _csa_indexer_compressor(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The indexer's inner compressor and its idx cache commit (§4.6); the pools in place."""
    s, m, rows = f.steps, ctx.model, _csa_rows(f, ctx, v)
    inner = f.compressor_rows(
        s, m, v["x_normed"], (v["inner_wkv"], v["inner_wgate"], v["inner_ape"], v["inner_norm_w"]),
        v["inner_compress_state"], v["inner_compress_state_block_table"], v["inner_state_slot_mapping"],
        v["position_ids"], rows.step_cos, rows.step_sin,
    )  # fmt: skip
    slots = s.commit_slots(_csa_first(ctx, v), v["idx_slot_mapping"], m.decode_seq)
    s.commit_idx_rows(v["idx_kv_cache"], v["idx_kv_scale"], slots, inner, v["hadamard_idx"])
    return {n: v[n] for n in ("inner_compress_state", "idx_kv_cache", "idx_kv_scale")}


def _csa_indexer_topk(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """Indexer query, head weights, scores over the committed idx cache, top-k (§4.6).

    The layer forms the query before the inner compressor commits; the two share no tensor,
    so running it after is the same computation.
    """
    s, m, rows = f.steps, ctx.model, _csa_rows(f, ctx, v)
    seq = m.decode_seq
    q_idx, q_idx_scale = s.indexer_query(
        m, v["qr"], v["qr_scale"], v["idx_wq_b"], v["idx_wq_b_scale"],
        rows.step_cos.repeat_interleave(seq, dim=0), rows.step_sin.repeat_interleave(seq, dim=0), v["hadamard_idx"],
    )  # fmt: skip
    weights = s.head_weights(m, v["x_normed"], v["weights_proj"])
    visible = s.visible_slots(m, v["position_ids"], v["kv_seq_lens"])
    score = s.index_scores(
        m, q_idx, q_idx_scale, weights, v["idx_kv_cache"], v["idx_kv_scale"], v["idx_block_table"], int(visible.max())
    )
    return {"index_score": score, "idx_topk": s.select_topk(score, visible, m.index_topk)}


def _csa_cache_insert(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    f.steps.write_kv_cache(v["kv_cache"], v["ori_slot_mapping"], v["kv"])
    return {"kv_cache": v["kv_cache"]}


def _csa_attention(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    o = f.steps.csa_attention(
        ctx.model, v["q"], v["kv_cache"], v["window_swa_indices"], v["cmp_kv"], v["cmp_block_table"], v["idx_topk"],
        v["position_ids"], v["attn_sink"],
    )  # fmt: skip
    return {"o": o}


def _csa_pack_heads(f: CSAFunctions, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    rows = _csa_rows(f, ctx, v)
    return {"attention_grouped": f.steps.pack_heads(v["o"], rows.token_cos, rows.token_sin, ctx.model)}


def csa_stages(case: Case) -> tuple[Stage, ...]:
    checks = {c.output: c for c in csa.LAYER.checks(case)}
    stage = functools.partial(_local, live=csa_live_functions, golden=_CSA_GOLDEN)
    rope = ("freqs_cos", "freqs_sin", "position_ids")

    def pools(*names: str) -> tuple[StageOutput, ...]:
        return tuple(StageOutput(_pool(checks[n]), checks[n]) for n in names)

    return (
        stage("hc_pre", _csa_hc_pre, inputs=HC_PRE_INPUTS, outputs=HC_PRE_OUTPUTS),
        stage("rms_norm", _csa_rms_norm, inputs=RMS_NORM_INPUTS, outputs=RMS_NORM_OUTPUTS),
        stage("qkv_proj_rope", _csa_qkv, inputs=("x_normed", *QKV_WEIGHTS, *rope),
              outputs=(StageOutput(_bf16("q")), StageOutput(_bf16("kv")),
                       StageOutput(AllcloseCheck("qr", atol=1, rtol=0)), StageOutput(_fp32("qr_scale")))),
        stage("compressor", _csa_compressor,
              inputs=("x_normed", "cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w", "compress_state",
                      "compress_state_block_table", "state_slot_mapping", "cmp_kv", "cmp_slot_mapping", *rope),
              outputs=pools("compress_state", "cmp_kv")),
        stage("indexer_compressor", _csa_indexer_compressor,
              inputs=("x_normed", "inner_wkv", "inner_wgate", "inner_ape", "inner_norm_w", "inner_compress_state",
                      "inner_compress_state_block_table", "inner_state_slot_mapping", "idx_kv_cache", "idx_kv_scale",
                      "idx_slot_mapping", "hadamard_idx", *rope),
              outputs=pools("inner_compress_state", "idx_kv_cache", "idx_kv_scale")),
        stage("indexer_topk", _csa_indexer_topk,
              inputs=("qr", "qr_scale", "idx_wq_b", "idx_wq_b_scale", "hadamard_idx", "x_normed", "weights_proj",
                      "kv_seq_lens", "idx_kv_cache", "idx_kv_scale", "idx_block_table", *rope),
              outputs=(StageOutput(_fp32("index_score")), StageOutput(ExactCheck("idx_topk")))),
        stage("cache_insert", _csa_cache_insert, inputs=("kv_cache", "ori_slot_mapping", "kv"),
              outputs=(StageOutput(ExactCheck("kv_cache"), checks["kv_cache"]),)),
        stage("attention", _csa_attention,
              inputs=("q", "kv_cache", "window_swa_indices", "cmp_kv", "cmp_block_table", "idx_topk", "position_ids",
                      "attn_sink"),
              outputs=(StageOutput(_bf16("o")),)),
        stage("pack_heads", _csa_pack_heads, inputs=("o", *rope), outputs=(StageOutput(_bf16("attention_grouped")),)),
        *output_half_stages(checks),
    )  # fmt: skip


# -- HCA (hca.md §4.1–4.6) --------------------------------------------------------------------
class HCASteps(NamedTuple):
    hc_pre: Callable
    rms_norm: Callable
    qkv_proj_rope: Callable
    compress: Callable
    write_kv_cache: Callable
    attention_keys: Callable
    sparse_attention: Callable
    pack_heads: Callable


def hca_live_steps() -> HCASteps:
    """HCA's per-rank steps as their modules hold them now (the compressor's own stages too)."""
    return HCASteps(
        hc.hc_pre, qkv.rms_norm, qkv.qkv_proj_rope, hca_compressor.compress, hca.write_kv_cache, hca.attention_keys,
        attention.sparse_attention, attention.pack_heads,
    )  # fmt: skip


# Bound at import; the compressor runs its module's import-time steps, as the HCA golden's does.
_HCA_GOLDEN = hca_live_steps()._replace(
    compress=functools.partial(hca_compressor.compress, steps=hca_compressor.GOLDEN_STEPS)
)


def _hca_compressor(s: HCASteps, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    s.compress(
        ctx.model, v["x_normed"], v["cmp_wkv"], v["cmp_wgate"], v["cmp_ape"], v["cmp_norm_w"],
        v["cmp_freqs_cos"], v["cmp_freqs_sin"], v["compress_state"], v["compress_state_block_table"],
        v["cmp_kv"], v["position_ids"], v["state_slot_mapping"], v["cmp_slot_mapping"],
    )  # fmt: skip
    return {"compress_state": v["compress_state"], "cmp_kv": v["cmp_kv"]}


def _hca_cache_insert(s: HCASteps, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    s.write_kv_cache(v["kv_cache"], v["ori_slot_mapping"], v["kv"])
    return {"kv_cache": v["kv_cache"]}


def _hca_attention(s: HCASteps, ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    m = ctx.model
    keys, valid = s.attention_keys(
        m, v["kv_cache"], v["cmp_kv"], v["window_swa_indices"], v["cmp_block_table"], v["position_ids"],
        v["kv_seq_lens"],
    )  # fmt: skip
    return {"o": s.sparse_attention(v["q"], keys, valid, v["attn_sink"], m.softmax_scale)}


def hca_stages(case: Case) -> tuple[Stage, ...]:
    checks = {c.output: c for c in hca.LAYER.checks(case)}
    stage = functools.partial(_local, live=hca_live_steps, golden=_HCA_GOLDEN)
    return (
        stage("hc_pre", _hc_pre_stage, inputs=HC_PRE_INPUTS, outputs=HC_PRE_OUTPUTS),
        stage("rms_norm", _rms_norm_stage, inputs=RMS_NORM_INPUTS, outputs=RMS_NORM_OUTPUTS),
        stage("qkv_proj_rope", _qkv_stage, inputs=("x_normed", *QKV_WEIGHTS, "freqs_cos", "freqs_sin"),
              outputs=(StageOutput(_bf16("q")), StageOutput(_bf16("kv")))),
        stage("compressor", _hca_compressor,
              inputs=("x_normed", "cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w", "cmp_freqs_cos", "cmp_freqs_sin",
                      "compress_state", "compress_state_block_table", "cmp_kv", "position_ids", "state_slot_mapping",
                      "cmp_slot_mapping"),
              outputs=tuple(StageOutput(_pool(checks[n]), checks[n]) for n in ("compress_state", "cmp_kv"))),
        stage("cache_insert", _hca_cache_insert, inputs=("kv_cache", "ori_slot_mapping", "kv"),
              outputs=(StageOutput(ExactCheck("kv_cache"), checks["kv_cache"]),)),
        stage("attention", _hca_attention,
              inputs=("q", "kv_cache", "cmp_kv", "window_swa_indices", "cmp_block_table", "position_ids",
                      "kv_seq_lens", "attn_sink"),
              outputs=(StageOutput(_bf16("o")),)),
        stage("pack_heads", _pack_heads_stage, inputs=("o", "freqs_cos", "freqs_sin"),
              outputs=(StageOutput(_bf16("attention_grouped")),)),
        *output_half_stages(checks),
    )  # fmt: skip


_BUILDERS: dict[str, Callable[[Case], tuple[Stage, ...]]] = {"swa": swa_stages, "csa": csa_stages, "hca": hca_stages}


def layer_stages(case: Case) -> tuple[Stage, ...]:
    """The stages of `case.layer`, in dependency order."""
    if case.layer not in _BUILDERS:
        raise ConfigError(f"bisect: no stage list for layer {case.layer!r} yet (have {', '.join(_BUILDERS)})")
    return _BUILDERS[case.layer](case)


def stage_tensors(case: Case) -> dict[str, tuple[str, ...]]:
    """Stage name → the tensors a user implementation may return to expose that stage."""
    return {s.name: s.output_names for s in layer_stages(case)}


def staged_forward(
    stages: tuple[Stage, ...], outputs: tuple[str, ...], ctx: RankContext, tensors: dict[str, torch.Tensor],
    record: dict[str, dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The layer's TP forward stage by stage; `record[stage]` gets CPU copies of its outputs.

    Returns `outputs` (the layer's compared names) as the layer's forward does: in-place
    tensors are the caller's.
    """
    values = dict(tensors)
    for stage in stages:
        produced = stage.impl(ctx, {n: values[n] for n in stage.inputs})
        record[stage.name] = {n: t.detach().to("cpu", copy=True) for n, t in produced.items()}
        values.update(produced)
    return {n: values[n] for n in outputs}


__all__ = [
    "Stage",
    "StageOutput",
    "SWASteps",
    "swa_live_steps",
    "swa_stages",
    "output_half_stages",
    "layer_stages",
    "stage_tensors",
    "staged_forward",
]
