"""Defects of the MoE layer (moe.md §10's pitfalls, the pooled budgets and caps)."""

from __future__ import annotations

import torch

from layers.components.moe_routing import block_transpose
from layers.distributed import wire
from layers.tp import TorchTP
from .stage_defect import StageDefect


# -- MoE defects (moe.md §10's pitfalls) ---------------------------------------------------------------
class MoeRoutesToTheWrongRank(StageDefect):
    """Every route goes to the next rank's expert of the same local id."""

    stages = ("dispatch",)

    def defective(self, stage, ctx, v):
        experts = ctx.case.routed_experts
        return stage.run(ctx, {**v, "indices": (v["indices"] + ctx.case.local_experts) % experts})


class MoeCombineReusesDispatchSplits(StageDefect):
    """The combine sends the routed rows back with the dispatch's splits, not the swapped ones
    (buffers cut or padded to fit: sizes agree pairwise, rows land wrongly)."""

    stages = ("combine",)

    def defective(self, stage, ctx, v):
        recv_y, recv_meta, send_meta, send_route = v["recv_y"], v["recv_meta"], v["send_meta"], v["send_route"]
        back = recv_y[block_transpose(recv_meta.t())]
        s, d = int(send_meta.sum()), recv_y.shape[1]

        def fit(x):
            return torch.cat((x[:s], x.new_zeros(max(0, s - x.shape[0]), d)))

        rows = wire.all_to_all_v(fit(back), send_meta.sum(1).tolist(), recv_meta.sum(1).tolist(), ctx.group, ctx.tp)
        buf = torch.zeros(ctx.case.tokens * ctx.model.num_experts_per_tok, d, dtype=torch.bfloat16)
        buf[send_route.long()] = fit(rows)
        return {"routed_y_buf": buf}


class MoeDropsTheRoutingWeight(StageDefect):
    """The routed experts ignore the routing weight (weight 1 on every row)."""

    stages = ("routed_experts",)

    def defective(self, stage, ctx, v):
        aux = v["recv_aux"].clone()
        aux[:, 1] = 1.0
        return stage.run(ctx, {**v, "recv_aux": aux})


class MoeProcessesTokensPastNumTokens(TorchTP):
    """Rank 1 routes and reduces every one of its T tokens, active or not."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            tensors = {**tensors, "num_tokens": torch.tensor(ctx.case.tokens, dtype=torch.int32)}
        return super().__call__(ctx, tensors)


class MoeHugeValueInXNext(TorchTP):
    """Rank 1 writes 1e30 into one value of its x_next: one point of the pooled 5 % budget, and
    ratio_reldiff puts no cap on a single point of the MoE layer."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            out["x_next"][0, 0, 0] = 1e30
        return out


class MoeCorruptsItsInputs(TorchTP):
    """Rank 1 computes the right x_next, then scales its x_hc by -3 and shifts its input_ids by
    7 in place (both pure inputs)."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            tensors["x_hc"].mul_(-3)
            tensors["input_ids"].add_(7)
        return out


class MoeDropsLastRoute(StageDefect):
    """Rank 1's combine drops the last of the K routes of its first 8 tokens: their rows of
    routed_y_buf stay 0, so those tokens' x_next miss one expert's output (a logic defect whose
    bad points all sit in 8 token rows, inside the 5 % budget of x_next)."""

    stages = ("combine",)
    tokens = 8

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)
        if ctx.rank == 1:
            k = ctx.model.num_experts_per_tok
            out["routed_y_buf"][torch.arange(self.tokens) * k + k - 1] = 0
        return out
