"""The MoE decode layer run expert-parallel: its stages, golden and EP forward (spec moe.md).

Owns the layer's tensor inventory (§2, one rank) and its stages in the spec's order (§3) —
hc_pre, gate, shared_expert, dispatch (count exchange + int8 all-to-all-v), routed_experts,
combine (all-to-all-v with swapped splits), reduce, hc_post — each a small function
`stage(ctx, values) -> {written tensors}` over the spec's tensor names, listed with what it
reads and writes as the layer's stage list (`MoELayer.stages`). The EP forward is that list on
the rank's EP group (`StagedLayer.forward`). The two all-to-alls also have a `reference`
replayed from every rank's inputs (`dispatch_reference`, `combine_reference`, §4.4 / §3.2).

The golden (§4) is the same stage list with each all-to-all by its reference, so it never
runs the collectives under test (`layers.distributed.golden_walk`): on one process over every
rank's stacked tensors (`MoELayer.golden`: snapshots, tests), or on each rank with its group,
whose harness all-gather brings every rank's gate outputs and receive rows to the references
(`MoELayer.rank_golden`: the launcher's). A rank thus computes the routed rows of its own
experts only, and routed weights (3 × 128 MiB int8 per rank at flash) stay with their owner.

Why the routed rows are batched per expert, in fp32 with dequantized weights (measured on
the 2-core CPU, MKL AVX2 strict, against the reference snapshot moe-ep2-small): this golden
reproduces its x_next bit for bit. fp32 GEMM rows are not independent of the batch: a
GEMM of one or two rows takes another kernel (43 of 48 rows of a flash expert change bits
when computed one by one), so a golden that computes each route alone, on its source, is
not the reference's. The device's exact int8 × int8 GEMMs (§5) would make every row
batch-independent, but they are not the golden's arithmetic: x_next moves by up to 8e-5
(never bitwise) and, with K = D = 4096 past fp32's exact range, they run in fp64, 3× slower
per flash expert (0.9 s vs 0.3 s). Batching at the experts' owner (the dispatch reference
hands every expert all its rows in the golden's order) gives the reference's bits and keeps
every weight on one rank.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..components import hc
from ..components import moe as moe_math
from ..components import moe_routing as routing
from ..contract.case import MoECase
from ..contract.checks import HIDDEN_AXES, ActiveRowsCheck, AllcloseCheck, RelDiffCheck
from ..contract.config import ConfigError
from ..contract.context import RankContext
from ..contract.stage import Stage
from ..contract.tensors import Kind, TensorSpec
from ..distributed import ep
from ..distributed.golden_walk import golden_stage, walk_group
from . import fixture
from ..contract.staged import StagedLayer, bf16_close, exact, fp32_close, judged, run_stages

Values = Mapping[str, torch.Tensor]

DISPATCH_RECEIVED = ("recv_meta", "recv_x", "recv_aux", "recv_route")
ROUTED = ("routed_w1", "routed_w1_scale", "routed_w3", "routed_w3_scale", "routed_w2", "routed_w2_scale")
SHARED = ("shared_w1", "shared_w1_scale", "shared_w3", "shared_w3_scale", "shared_w2", "shared_w2_scale")


def tensor_specs(case: MoECase) -> dict[str, TensorSpec]:
    """Every tensor of one rank, in §2's order (the stacked snapshot adds a leading [P])."""
    m, t, i = case.model, case.tokens, Kind.INPUT
    d, im, l, e, k = m.hidden_size, m.moe_intermediate_size, case.local_experts, case.routed_experts, m.num_experts_per_tok
    f32, i8 = torch.float32, torch.int8
    return {
        "x_hc": TensorSpec((t, m.hc_mult, d), f32, i),
        "hc_ffn_fn": TensorSpec((m.mix_hc, m.hc_dim), f32, i),
        "hc_ffn_scale": TensorSpec((3,), f32, i),
        "hc_ffn_base": TensorSpec((m.mix_hc,), f32, i),
        "norm_w": TensorSpec((d,), torch.bfloat16, i),
        "gate_w": TensorSpec((e, d), f32, i),
        "gate_bias": TensorSpec((e,), f32, i),
        "tid2eid": TensorSpec((m.vocab_size, k), torch.int32, i),
        "input_ids": TensorSpec((t,), torch.int64, i),
        "routed_w1": TensorSpec((l, im, d), i8, i),
        "routed_w3": TensorSpec((l, im, d), i8, i),
        "routed_w1_scale": TensorSpec((l, im), f32, i),
        "routed_w3_scale": TensorSpec((l, im), f32, i),
        "routed_w2": TensorSpec((l, d, im), i8, i),
        "routed_w2_scale": TensorSpec((l, d), f32, i),
        "shared_w1": TensorSpec((im, d), i8, i),
        "shared_w3": TensorSpec((im, d), i8, i),
        "shared_w1_scale": TensorSpec((im,), f32, i),
        "shared_w3_scale": TensorSpec((im,), f32, i),
        "shared_w2": TensorSpec((d, im), i8, i),
        "shared_w2_scale": TensorSpec((d,), f32, i),
        "x_next": TensorSpec((t, m.hc_mult, d), f32, Kind.OUTPUT),
        "layer_id": TensorSpec((), torch.int32, i),
        "num_tokens": TensorSpec((), torch.int32, i),
    }


def checks_of(model) -> tuple[RelDiffCheck, ...]:
    """§8: x_next alone, `ratio_reldiff(3e-3, 0.05)` over all T rows of every rank (no mask:
    an inactive token's x_next is its residual mix) with one pooled budget, no single-point cap."""
    return (RelDiffCheck("x_next", diff_thd=3e-3, pct_thd=0.05, max_diff_hd=float("inf"), axes=HIDDEN_AXES),)


def checks(case: MoECase) -> tuple[RelDiffCheck, ...]:
    return checks_of(case.model)


# -- the stages (§3), in order ---------------------------------------------------------------------
def hc_pre(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§4.1: x_hc → x_mixed [T, D] bf16, post [T, 4], comb [T, 16] fp32 (all T rows)."""
    x_mixed, post, comb = hc.hc_pre(v["x_hc"], v["hc_ffn_fn"], v["hc_ffn_scale"], v["hc_ffn_base"], ctx.model)
    return {"x_mixed": x_mixed, "post": post, "comb": comb}


def gate(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§4.2: x_mixed → x_norm_i8, x_norm_scale, indices (global expert ids), weights."""
    x_norm_i8, x_norm_scale, indices, weights = moe_math.gate(
        v["x_mixed"], v["norm_w"], v["gate_w"], v["gate_bias"], v["tid2eid"], v["input_ids"],
        int(v["layer_id"]), int(v["num_tokens"]), ctx.model,
    )  # fmt: skip
    return {"x_norm_i8": x_norm_i8, "x_norm_scale": x_norm_scale, "indices": indices, "weights": weights}


def shared_expert(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§4.3: sh [T, D] bf16 on every row (no communication)."""
    return {"sh": moe_math.shared_expert(v["x_norm_i8"], v["x_norm_scale"], *(v[n] for n in SHARED), ctx.model)}


def dispatch(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§3.1: the send layout, the count exchange, then the int8 all-to-all-v of every route."""
    case = ctx.case
    send_meta, send_route = routing.send_layout(v["indices"], int(v["num_tokens"]), case.ep, case.local_experts)
    recv_meta = ep.count_exchange(ctx, send_meta)
    recv_x, recv_aux, recv_route = ep.dispatch(
        ctx, v["x_norm_i8"], v["x_norm_scale"], v["weights"], send_meta, send_route, recv_meta
    )
    return {"send_meta": send_meta, "send_route": send_route, "recv_meta": recv_meta,
            "recv_x": recv_x, "recv_aux": recv_aux, "recv_route": recv_route}  # fmt: skip


def routed_experts(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§4.5: the 16 local experts on their received rows → recv_y [R, D] bf16 (× routing weight)."""
    recv_count = v["recv_meta"].sum(dim=0)
    return {"recv_y": moe_math.routed_experts(recv_count, v["recv_x"], v["recv_aux"], *(v[n] for n in ROUTED), ctx.model)}


def combine(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§3.2: recv_y back to the routes' sources (swapped splits) → routed_y_buf [T·K, D] bf16."""
    k = ctx.model.num_experts_per_tok
    return {"routed_y_buf": ep.combine(ctx, v["recv_y"], v["recv_meta"], v["send_meta"], v["send_route"],
                                       ctx.case.tokens, k)}  # fmt: skip


# -- the two all-to-alls from every rank's inputs (bisect's judges: no collective under test) ------
def dispatch_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§4.4 replayed for this rank from every source's gate outputs (stacked [P, ...]): what it
    sends (send_meta, send_route in (dst, e, ρ) order) and what it receives."""
    case, me, n = ctx.case, ctx.rank, int(v["num_tokens"])
    replays = [routing.replay_dispatch(d, v["indices"], n, case.local_experts) for d in range(case.ep)]
    send_meta = torch.stack([recv_meta[me] for recv_meta, _src, _rho in replays])
    send_route = torch.cat([rho[src == me] for _meta, src, rho in replays]).to(torch.int32)
    received = golden_dispatch(case, me, v, n)
    return {"send_meta": send_meta, "send_route": send_route, **{name: received[name] for name in DISPATCH_RECEIVED}}


def combine_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§3.2 from every rank's receive side (each rank's tensors, rows differ): row j of rank d's
    recv_y, from source s by d's recv_meta (expert-major, then source), goes to s's
    routed_y_buf at the route id it carries, recv_route[j]; this rank keeps the rows s = me."""
    case, me = ctx.case, ctx.rank
    p, routes = case.ep, case.tokens * ctx.model.num_experts_per_tok
    buf = torch.zeros(routes, ctx.model.hidden_size, dtype=torch.bfloat16)
    for d in range(p):
        meta = v["recv_meta"][d]  # [P, L]
        src = torch.repeat_interleave(torch.arange(p).repeat(case.local_experts), meta.t().reshape(-1).long())
        # an implementation whose rows disagree with its counts is judged on what pairs up
        rows = min(src.numel(), v["recv_y"][d].shape[0], v["recv_route"][d].shape[0])
        rho = v["recv_route"][d][:rows].long()
        mine = (src[:rows] == me) & (rho >= 0) & (rho < routes)
        buf[rho[mine]] = v["recv_y"][d][:rows][mine]
    return {"routed_y_buf": buf}


def reduce(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§3.3: ffn_out [T, D] bf16 = sh + the K routed rows of each active token, in k order."""
    return {"ffn_out": moe_math.reduce(v["sh"], v["routed_y_buf"], int(v["num_tokens"]))}


def hc_post(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§4.7: x_next [T, 4, D] fp32 from ffn_out and the residual streams x_hc."""
    return {"x_next": hc.hc_post(v["ffn_out"], v["x_hc"], v["post"], v["comb"])}


def _active(check, rows_per_token: int = 1, order_by: str | None = None) -> ActiveRowsCheck:
    return ActiveRowsCheck(check, "num_tokens", rows_per_token, order_by)


def _stages(model) -> tuple[Stage, ...]:
    """The stages of §3 in order, each output judged as bisect would a stage of the attention
    layers (codes and routing bitwise, bf16 results within 1–2 ulps, fp32 within 1e-4) with
    §13.5's masks: gate outputs on the active tokens, their index rows as sets (weights paired),
    routed_y_buf on the active routes; the compact receive rows are all filled. The dispatch
    lists what a rank sends before what it receives, so bisect names a bad route's source."""
    x_next, k = checks_of(model)[0], model.num_experts_per_tok
    return (
        Stage("hc_pre", ("x_hc", "hc_ffn_fn", "hc_ffn_scale", "hc_ffn_base"),
              (judged(bf16_close("x_mixed")), judged(fp32_close("post")), judged(fp32_close("comb"))), hc_pre),
        Stage("gate", ("x_mixed", "norm_w", "gate_w", "gate_bias", "tid2eid", "input_ids", "layer_id", "num_tokens"),
              (judged(_active(AllcloseCheck("x_norm_i8", atol=1, rtol=0))), judged(_active(fp32_close("x_norm_scale"))),
               judged(_active(exact("indices"), order_by="indices")),
               judged(_active(fp32_close("weights"), order_by="indices"))), gate),
        Stage("shared_expert", ("x_norm_i8", "x_norm_scale", *SHARED), (judged(bf16_close("sh")),), shared_expert),
        Stage("dispatch", ("x_norm_i8", "x_norm_scale", "indices", "weights", "num_tokens"),
              tuple(judged(exact(n)) for n in ("send_meta", "send_route", *DISPATCH_RECEIVED)), dispatch,
              reference=dispatch_reference, every_rank=("x_norm_i8", "x_norm_scale", "indices", "weights")),
        Stage("routed_experts", ("recv_meta", "recv_x", "recv_aux", *ROUTED), (judged(bf16_close("recv_y")),),
              routed_experts),
        Stage("combine", ("recv_y", "recv_meta", "recv_route", "send_meta", "send_route"),
              (judged(_active(exact("routed_y_buf"), rows_per_token=k)),), combine,
              reference=combine_reference, every_rank=("recv_y", "recv_meta", "recv_route")),
        Stage("reduce", ("sh", "routed_y_buf", "num_tokens"), (judged(bf16_close("ffn_out")),), reduce),
        Stage("hc_post", ("ffn_out", "x_hc", "post", "comb"), (judged(fp32_close("x_next"), x_next),), hc_post),
    )  # fmt: skip


# -- the dispatch replay (§4.4) -------------------------------------------------------------------


def golden_dispatch(case: MoECase, dst: int, gates: Values, num_tokens: int) -> dict[str, torch.Tensor]:
    """§4.4 on rank `dst`, from every source's gate outputs stacked [P, ...]: the dispatch
    stage's outputs recv_meta [P, L], recv_x [R, D] int8, recv_aux [R, 2] fp32 and recv_route
    [R] int32 (expert-major, then source, then ρ), plus recv_src [R] (each row's source)."""
    k = case.model.num_experts_per_tok
    recv_meta, route_src, route_id = routing.replay_dispatch(dst, gates["indices"], num_tokens, case.local_experts)
    tok = route_id // k
    aux = torch.stack((gates["x_norm_scale"][route_src, tok, 0], gates["weights"][route_src, tok, route_id % k]), dim=1)
    return {"recv_meta": recv_meta, "recv_x": gates["x_norm_i8"][route_src, tok], "recv_aux": aux,
            "recv_route": route_id.to(torch.int32), "recv_src": route_src}  # fmt: skip


__all__ = [
    "tensor_specs", "checks", "MoELayer", "LAYER",
    "hc_pre", "gate", "shared_expert", "dispatch", "routed_experts", "combine", "reduce", "hc_post",
    "dispatch_reference", "combine_reference", "golden_dispatch",
]  # fmt: skip


class MoELayer(StagedLayer):
    """The MoE layer for the launcher: its stages, its fixture slice, and a golden that needs
    every rank's routes (every rank's routes reach every rank's experts, moe.md §13.4)."""

    name = "moe"
    sharded_o_weights = False
    golden_reads_every_rank = True
    # The fixture's `replicated_inputs`: the hc and norm weights, the gate, the shared expert.
    replicated_inputs = frozenset({
        "hc_ffn_fn", "hc_ffn_scale", "hc_ffn_base", "norm_w", "gate_w", "gate_bias", "tid2eid", "shared_w1",
        "shared_w1_scale", "shared_w3", "shared_w3_scale", "shared_w2", "shared_w2_scale"})

    def stages(self, model) -> tuple[Stage, ...]:
        return _stages(model)

    def validate(self, case: MoECase) -> None:
        """Every case that passes `MoECase.validate` runs."""

    def tensor_specs(self, case: MoECase) -> dict[str, TensorSpec]:
        return tensor_specs(case)

    def rank_inputs(self, case: MoECase, rank: int) -> dict[str, torch.Tensor]:
        specs = tensor_specs(case)
        inputs = fixture.rank_inputs(case, rank)
        return {n: inputs[n] for n, s in specs.items() if s.kind is not Kind.OUTPUT}

    def full_o_weights(self, case):
        raise ConfigError("the MoE layer has no O weights")

    def checks(self, case: MoECase) -> tuple[RelDiffCheck, ...]:
        return checks(case)

    def golden(self, case: MoECase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """§4 on one process: the stage list over every rank's tensors stacked [P, ...] (a
        snapshot's in/; 0-dim scalars are every rank's), each all-to-all by its reference.
        Returns x_next stacked [P, T, 4, D] fp32."""
        ranks = [{n: x if x.dim() == 0 else x[r] for n, x in tensors.items()} for r in range(case.ep)]
        values = walk_group(self.stages(case.model), RankContext(case=case, rank=0, device=torch.device("cpu")), ranks)
        return {n: torch.stack([v[n] for v in values]) for n in self.compared_names(case)}

    def rank_golden(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's golden: the stage list with its group, each all-to-all by its reference
        over every rank's inputs, which the harness's all-gather brings (moe.md §13.4)."""
        values = run_stages(self.stages(ctx.model), ctx, tensors, golden_stage)
        return {n: values[n] for n in self.compared_names(ctx.case)}


LAYER = MoELayer()
