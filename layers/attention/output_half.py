"""The stages every attention layer ends with: packing, the TP output half and hc_post.

swa.md §3.6–3.8 and §5 (shared by SWA, CSA and HCA): inverse RoPE and packing of the heads
into output groups, the head-group all-to-all (§5.3), the sharded grouped O projection
(§5.4), the reduce-scatter (§5.5) and hc_post. On a single device (the golden) both
collectives are identities and the projection runs over every group with the full weights:
`bf16(sharded_o_proj)` is the TP1 grouped projection of §3.7.

The two collective stages carry a `reference`: the data movement applied to every rank's
inputs by §5.3 / §5.5's index maps, so bisect judges them without running them.
"""

from __future__ import annotations

import torch

from ..components import attention, hc, o_proj
from ..components.numerics import bf16
from ..contract.checks import AllcloseCheck, Check
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..distributed import collectives
from ..contract.staged import bf16_close, exact, fp32_close, judged


def pack_heads(cos: str = "freqs_cos", sin: str = "freqs_sin") -> Stage:
    """Inverse RoPE of the heads' outputs at the token rows `cos` / `sin`, packed into output
    groups: attention_grouped bf16 [G, t, GI]."""

    def run(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
        return {"attention_grouped": attention.pack_heads(v["o"], v[cos], v[sin], ctx.model)}

    return Stage("pack_heads", ("o", cos, sin), (judged(bf16_close("attention_grouped")),), run)


def _group_all_to_all(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"attention_local_groups": collectives.group_all_to_all(ctx, v["attention_grouped"])}


def _group_all_to_all_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§5.3: `X_d[lg, s·t + i] = A_s[d·LG + lg, i]` from every rank's attention_grouped [P, G, t, GI]."""
    every = v["attention_grouped"]
    p, g, t, gi = every.shape
    lg = g // p
    mine = every[:, ctx.rank * lg : (ctx.rank + 1) * lg]  # [P, LG, t, GI]
    return {"attention_local_groups": mine.permute(1, 0, 2, 3).reshape(lg, p * t, gi)}


def _sharded_o_proj(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"o_partial": o_proj.sharded_o_proj(v["attention_local_groups"], v["wo_a"], v["wo_b"], v["wo_b_scale"])}


def _reduce_scatter(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"attn_out": collectives.reduce_scatter(ctx, v["o_partial"])}


def _reduce_scatter_reference(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """§5.5: owner o sums rows [o·t, (o+1)·t) of every rank's partial [P, P·t, D], ascending rank."""
    every = v["o_partial"]
    p = every.shape[0]
    t = every.shape[1] // p
    return {"attn_out": bf16(collectives.sum_in_rank_order(every[:, ctx.rank * t : (ctx.rank + 1) * t]))}


def _hc_post(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"x_out": hc.hc_post(v["attn_out"], v["x_hc"], v["post"], v["comb"])}


GROUP_ALL_TO_ALL = Stage(
    "group_all_to_all", ("attention_grouped",),
    (judged(exact("attention_local_groups"), bf16_close("attention_local_groups")),),
    _group_all_to_all, reference=_group_all_to_all_reference, every_rank=("attention_grouped",),
)  # fmt: skip
SHARDED_O_PROJ = Stage(
    "sharded_o_proj", ("attention_local_groups", "wo_a", "wo_b", "wo_b_scale"),
    (judged(AllcloseCheck("o_partial", atol=1e-4, rtol=1 / 128)),), _sharded_o_proj,
)  # fmt: skip
REDUCE_SCATTER = Stage(
    "reduce_scatter", ("o_partial",), (judged(bf16_close("attn_out", max_error_ratio=0.0), bf16_close("attn_out")),),
    _reduce_scatter, reference=_reduce_scatter_reference, every_rank=("o_partial",),
)  # fmt: skip


# attention_grouped [G, t, GI] -> attn_out [t, D] (swa.md §5.1, §6 steps 6–8).
TP_OUTPUT_HALF = (GROUP_ALL_TO_ALL, SHARDED_O_PROJ, REDUCE_SCATTER)


def stages(x_out_check: Check, cos: str = "freqs_cos", sin: str = "freqs_sin") -> tuple[Stage, ...]:
    """pack_heads, group_all_to_all, sharded_o_proj, reduce_scatter, hc_post (swa.md §6 steps
    5–9); `x_out_check`: the layer's own check of x_out, hc_post's judge along the chain."""
    hc_post = Stage("hc_post", ("attn_out", "x_hc", "post", "comb"), (judged(fp32_close("x_out"), x_out_check),),
                    _hc_post)
    return (pack_heads(cos, sin), *TP_OUTPUT_HALF, hc_post)


__all__ = ["pack_heads", "GROUP_ALL_TO_ALL", "SHARDED_O_PROJ", "REDUCE_SCATTER", "TP_OUTPUT_HALF", "stages"]
