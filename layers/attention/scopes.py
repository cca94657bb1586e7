"""Focused scopes: the TP output half alone, the collectives alone and the TP1 layer (swa.md §9, §6).

A scope is a `Layer` in everything the orchestrator uses (tensor specs, per-rank fixture,
golden, the project's implementation, checks), so the worker runs it unchanged on real ranks
through the same launcher; `layers.registry.get_scope(layer, scope)` hands it out. Kernel engineers use the
focused scopes to find where a TP mismatch of the full layer comes from:

  * `full`: the layer itself.
  * `output` (swa.md §9.4 and §9.1): window attention of closed-form queries over a cache that
    is NaN outside the window's pages → inverse RoPE + packing → head-group all-to-all →
    sharded grouped O projection → reduce-scatter, written into `o_local [LOCAL_T_PAD, D]`
    whose rows past local_t hold the sentinel −7.0; and, on every rank, the receive side of
    the sharded projection on its own buffer `proj_attention_local_groups [LG, GROUP_T_PAD,
    GI]` whose rows past group_t are NaN, into `o_partial [GROUP_T_PAD, D]` whose tail must
    stay exactly zero. The output half is one code path for SWA, CSA and HCA (swa.md §5), so
    this fixture is the same for every layer.
  * `collectives` (swa.md §9.2): the kv token all-gather, the group all-to-all and the
    reduce-scatter on integer data (exact in bf16 / fp32) with poisoned capacity rows
    (−1000 / −2000 / −3000) into outputs pre-filled with the sentinel −7.0; compared
    bitwise, so a poison value that travels or a padding row that is written fails.
  * `tp1` (swa.md §6, last paragraph): the single-device layer on every rank's own shard with
    the full O weights, no collectives.

The poison and sentinel rows exist only below capacity (local_t < LOCAL_T, or LOCAL_T not a
multiple of 16). `output` and `collectives` take any local_t in [1, LOCAL_T]: their tokens are
buffer rows, not requests; the default (the reference's, for both) is LOCAL_T − 1.

Outputs that must keep their sentinel / zero tail are in-out tensors: their initial value is
part of the fixture (and of a snapshot's in/). A scope whose golden uses the rank's own weights
(`tp1`) or has none (`collectives`) says so with `sharded_o_weights = False`: the worker must
then not replace wo_a / wo_b with the full weights.

Shapes on rank r of P (t = local_t, LOCAL_T = capacity, LOCAL_T_PAD = ceil(LOCAL_T/16)·16,
GROUP_T = P·LOCAL_T, GROUP_T_PAD = P·LOCAL_T_PAD, G = o_groups, LG = G/P, LW = LG·OL):

| scope       | tensor                      | shape                  | dtype | kind  |
|-------------|-----------------------------|------------------------|-------|-------|
| output      | q                           | [t, H, HD]             | bf16  | in    |
|             | kv_cache                    | [NB, BS, 1, HD]        | bf16  | in    |
|             | swa_indices / swa_lens      | [t, WIN] / [t]         | int32 | in    |
|             | attn_sink                   | [H]                    | fp32  | in    |
|             | freqs_cos / freqs_sin       | [t, R]                 | bf16  | in    |
|             | wo_a / wo_b / wo_b_scale    | [LG, OL, GI] / [D, LW] / [D] | bf16 / int8 / fp32 | in |
|             | proj_attention_local_groups | [LG, GROUP_T_PAD, GI]  | bf16  | in    |
|             | proj_wo_a / proj_wo_b       | [LG, OL, GI] / [D, LW] | bf16 / int8 | in |
|             | o_partial                   | [GROUP_T_PAD, D]       | fp32  | inout |
|             | o_local                     | [LOCAL_T_PAD, D]       | bf16  | inout |
| collectives | kv_local                    | [LOCAL_T, D]           | bf16  | in    |
|             | attention_grouped           | [G·LOCAL_T_PAD, GI]    | bf16  | in    |
|             | o_partial                   | [GROUP_T_PAD, D]       | fp32  | in    |
|             | tp_rank                     | [1]                    | int32 | in    |
|             | kv_group                    | [GROUP_T, D]           | bf16  | inout |
|             | attention_local_groups      | [LG·GROUP_T_PAD, GI]   | bf16  | inout |
|             | o_local                     | [LOCAL_T_PAD, D]       | bf16  | inout |
| tp1         | the layer's, with wo_a [G, OL, GI] and wo_b [D, G·OL] (full) |    |       |       |

Every scope also holds the scalar `local_t`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from . import output_half
from ..components import attention, o_proj
from ..components.numerics import bf16
from ..contract.case import Case
from ..contract.checks import AllcloseCheck, Check, ExactCheck, PrefixTailCheck
from ..contract.config import ConfigError, ModelConfig, ceil_div
from ..contract.context import RankContext
from ..contract.layer import Layer
from ..contract.stage import Stage, Values
from ..contract.tensors import Kind, TensorSpec
from ..distributed import collectives
from ..contract.staged import RunStage, StagedLayer, bf16_close, default_run_stage, exact, fp32_close, judged

SENTINEL = -7.0  # every output row no valid destination reaches (swa.md §9.2, §9.4)
KV_POISON, ATTENTION_POISON, PARTIAL_POISON = -1000.0, -2000.0, -3000.0  # capacity rows of the inputs
# §9.1's banded wo_a: k-block kb of each local group holds (lg+1)·coef[kb] on its diagonal.
PROJ_DIAGONAL = (0.5, -0.25, 0.125, -0.0625)


class _Scope:
    """A focused scope of one layer: named as the layer, `scope` says which part it runs."""

    scope: ClassVar[str]

    def __init__(self, layer: StagedLayer):
        self.layer = layer
        self.name = layer.name


def _sizes(case: Case) -> tuple[int, int, int, int]:
    """(t, LOCAL_T_PAD, group_t, GROUP_T_PAD) of the case."""
    return case.local_t, case.local_t_pad, case.tp * case.local_t, case.tp * case.local_t_pad


def _local_t(case: Case) -> torch.Tensor:
    return torch.tensor(case.local_t, dtype=torch.int32)


# -- output scope (swa.md §9.4, §9.1) ---------------------------------------------------------
def _wo_b_scale(model: ModelConfig) -> torch.Tensor:
    """`(n % 4)·0.25 + 0.5` (§9.1 and §9.4 alike): {0.5, 0.75, 1.0, 1.25}."""
    return (torch.arange(model.hidden_size) % 4).float() * 0.25 + 0.5


def _output_wo_a(case: Case, rank: int) -> torch.Tensor:
    """§9.4: `wo_a[r][lg, j, j·HD] = 0.125·(r+1)(lg+1)(j+1)`: lora row j picks head j's dim 0."""
    m, lg = case.model, case.local_o_groups
    hpg = m.heads_per_group
    wo_a = torch.zeros(lg, m.o_lora_rank, m.group_in)
    coef = 0.125 * (rank + 1) * (torch.arange(lg)[:, None] + 1) * (torch.arange(hpg)[None, :] + 1)  # [LG, HPG]
    j = torch.arange(hpg)
    wo_a[:, j, j * m.head_dim] = coef.float()
    return bf16(wo_a)


def _output_wo_b(case: Case, rank: int) -> torch.Tensor:
    """§9.4: `wo_b[r] = (arange(D·LW) + r) % 7 − 3` (−3…3)."""
    d, lw = case.model.hidden_size, case.local_o_groups * case.model.o_lora_rank
    return ((torch.arange(d * lw) + rank) % 7 - 3).to(torch.int8).reshape(d, lw)


def _output_attention_inputs(case: Case, rank: int) -> dict[str, torch.Tensor]:
    """§9.4's closed form: every window key equal, so each head's dim-0 output is analytic."""
    m, t = case.model, case.local_t
    h, hd, win, bs, r = m.num_attention_heads, m.head_dim, m.sliding_window, m.block_size, m.qk_rope_head_dim
    q = torch.zeros(t, h, hd)
    q[:, :, 0] = rank + 0.25 * torch.arange(t)[:, None] + 0.0625 * torch.arange(h)[None, :]
    # NaN outside the window's pages: a gather past the valid keys poisons the output (P4).
    kv_cache = torch.full((m.kv_ori_block_num, bs, 1, hd), float("nan"))
    pages = ceil_div(win, bs)
    kv_cache[:pages] = 0.0
    kv_cache[:pages, :, 0, 0] = 0.25
    return {
        "q": bf16(q),
        "kv_cache": bf16(kv_cache),
        "swa_indices": torch.arange(win, dtype=torch.int32).repeat(t, 1),
        "swa_lens": torch.full((t,), win, dtype=torch.int32),
        "attn_sink": 4 + 0.125 * (torch.arange(h) % m.heads_per_group).float(),
        "freqs_cos": torch.ones(t, r, dtype=torch.bfloat16),
        "freqs_sin": torch.zeros(t, r, dtype=torch.bfloat16),
    }


def _projection_inputs(case: Case) -> dict[str, torch.Tensor]:
    """§9.1, one rank's receive side (the same on every rank): rows past group_t are NaN."""
    m, lg = case.model, case.local_o_groups
    _, _, group_t, group_t_pad = _sizes(case)
    gi, ol, d = m.group_in, m.o_lora_rank, m.hidden_size
    x = (torch.arange(lg * group_t_pad * gi) % 31 - 15).float().reshape(lg, group_t_pad, gi)
    x[:, :, 0] = 127.0  # amax 127 in every valid row
    x[:, group_t:] = float("nan")
    wo_a = torch.zeros(lg, ol, gi)
    r = torch.arange(ol)
    # Up to four k-blocks (GI >= 4·OL at FLASH); a smaller GI keeps the blocks that fit.
    for kb, c in enumerate(PROJ_DIAGONAL[: gi // ol]):
        wo_a[:, r, r + kb * ol] = (torch.arange(lg)[:, None].float() + 1) * c
    return {
        "proj_attention_local_groups": bf16(x),
        "proj_wo_a": bf16(wo_a),
        "proj_wo_b": (torch.arange(d * lg * ol) % 7 - 3).to(torch.int8).reshape(d, lg * ol),
    }


class OutputScope(_Scope, StagedLayer):
    """The TP output half after window attention (§9.4) and the sharded projection alone (§9.1)."""

    scope = "output"
    sharded_o_weights = True

    def validate(self, case: Case) -> None:
        m = case.model
        if m.o_lora_rank < m.heads_per_group:
            raise ConfigError(
                f"scope=output: o_lora_rank={m.o_lora_rank} must be >= heads_per_group={m.heads_per_group} "
                f"(the §9.4 wo_a maps head j of a group to lora row j)"
            )
        if m.group_in < m.o_lora_rank:
            raise ConfigError(
                f"scope=output: group_in={m.group_in} must be >= o_lora_rank={m.o_lora_rank} "
                f"(the §9.1 banded wo_a needs at least one diagonal block)"
            )
        if ceil_div(m.sliding_window, m.block_size) > m.kv_ori_block_num:
            raise ConfigError(
                f"scope=output: the window of {m.sliding_window} keys needs {ceil_div(m.sliding_window, m.block_size)} "
                f"pages of {m.block_size}; kv_ori_block_num is {m.kv_ori_block_num}"
            )

    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        m = case.model
        t, pad, _, group_t_pad = _sizes(case)
        h, hd, d, r, lg, ol, gi = (
            m.num_attention_heads, m.head_dim, m.hidden_size, m.qk_rope_head_dim, case.local_o_groups,
            m.o_lora_rank, m.group_in,
        )  # fmt: skip
        f32_, bf16_, i8, i32 = torch.float32, torch.bfloat16, torch.int8, torch.int32
        inp = Kind.INPUT
        return {
            "q": TensorSpec((t, h, hd), bf16_, inp),
            "kv_cache": TensorSpec((m.kv_ori_block_num, m.block_size, 1, hd), bf16_, inp),
            "swa_indices": TensorSpec((t, m.sliding_window), i32, inp),
            "swa_lens": TensorSpec((t,), i32, inp),
            "attn_sink": TensorSpec((h,), f32_, inp),
            "freqs_cos": TensorSpec((t, r), bf16_, inp),
            "freqs_sin": TensorSpec((t, r), bf16_, inp),
            "wo_a": TensorSpec((lg, ol, gi), bf16_, inp),
            "wo_b": TensorSpec((d, lg * ol), i8, inp),
            "wo_b_scale": TensorSpec((d,), f32_, inp),
            "proj_attention_local_groups": TensorSpec((lg, group_t_pad, gi), bf16_, inp),
            "proj_wo_a": TensorSpec((lg, ol, gi), bf16_, inp),
            "proj_wo_b": TensorSpec((d, lg * ol), i8, inp),
            "local_t": TensorSpec((), i32, inp),
            "o_partial": TensorSpec((group_t_pad, d), f32_, Kind.INOUT),
            "o_local": TensorSpec((pad, d), bf16_, Kind.INOUT),
        }

    def rank_inputs(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        m = case.model
        _, pad, _, group_t_pad = _sizes(case)
        return {
            **_output_attention_inputs(case, rank),
            "wo_a": _output_wo_a(case, rank),
            "wo_b": _output_wo_b(case, rank),
            "wo_b_scale": _wo_b_scale(m),
            **_projection_inputs(case),
            "local_t": _local_t(case),
            "o_partial": torch.zeros(group_t_pad, m.hidden_size),
            "o_local": torch.full((pad, m.hidden_size), SENTINEL, dtype=torch.bfloat16),
        }

    def full_o_weights(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        ranks = range(case.tp)
        return (
            torch.cat([_output_wo_a(case, r) for r in ranks]),
            torch.cat([_output_wo_b(case, r) for r in ranks], dim=1),
        )

    def stages(self, model: ModelConfig) -> tuple[Stage, ...]:
        """§9.4's window attention and output half into o_local's valid rows, then §9.1's
        sharded projection of the receive buffer's valid rows into o_partial. On a single
        device (the golden) the projection covers every group with the full O weights."""
        return (
            Stage("attention", ("q", "kv_cache", "swa_indices", "swa_lens", "attn_sink"), (judged(bf16_close("o")),),
                  _output_attention),
            output_half.pack_heads(),
            # One stage here: the half's intermediate `o_partial` would shadow this scope's
            # §9.1 buffer of the same name.
            Stage("output_half", ("attention_grouped", "wo_a", "wo_b", "wo_b_scale", "o_local", "local_t"),
                  (judged(exact("o_local")),), _output_half),
            Stage("projection", ("proj_attention_local_groups", "proj_wo_a", "proj_wo_b", "wo_b_scale", "o_partial",
                                 "local_t"), (judged(fp32_close("o_partial")),), _projection),
        )  # fmt: skip

    def checks(self, case: Case) -> tuple[Check, ...]:
        # validation.md §12.5: the projection's prefix with an exact zero tail, then the output
        # half's prefix with its sentinel tail (max_error_ratio 0 as in §9.1 / §9.4).
        t, _, group_t, _ = _sizes(case)
        return (
            AllcloseCheck("o_partial", atol=1e-4, rtol=1 / 128, max_error_ratio=0.0, valid_rows=group_t,
                          zero_tail=True),
            PrefixTailCheck("o_local", valid_rows=t, atol=1e-4, rtol=1 / 128, max_error_ratio=0.0),
        )


def _output_attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"o": attention.window_attention(ctx.model, v["q"], v["kv_cache"], v["swa_indices"], v["swa_lens"], v["attn_sink"])}


def _output_half(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """a2a → sharded projection → reduce-scatter into o_local's valid rows (§9.4)."""
    attn_out = collectives.tp_output_half(ctx, v["attention_grouped"], v["wo_a"], v["wo_b"], v["wo_b_scale"])
    v["o_local"][: int(v["local_t"])] = attn_out
    return {"o_local": v["o_local"]}


def _projection(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """Only the valid prefix of the receive buffer is read (P8): group_t = P·t rows, with
    P = G / LG (the golden's single device holds the same LG-group buffer)."""
    group_t = ctx.model.o_groups // v["proj_wo_a"].shape[0] * int(v["local_t"])
    v["o_partial"][:group_t] = o_proj.sharded_o_proj(
        v["proj_attention_local_groups"][:, :group_t], v["proj_wo_a"], v["proj_wo_b"], v["wo_b_scale"]
    )
    return {"o_partial": v["o_partial"]}


# -- collectives scope (swa.md §9.2) ----------------------------------------------------------
def _ramp(base: torch.Tensor, width: int, mod: int) -> torch.Tensor:
    """`(base + column) % mod` for row bases `base` (int64, any shape) → [..., width] float."""
    return ((base[..., None] + torch.arange(width)) % mod).float()


def _collective_sources(
    model: ModelConfig, p: int, capacity: int, pad: int, t: int, rank: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of §9.2's stacked inputs: flat `arange % m` over [P, ...], poisoned rows.

    The ramps run over the rank-stacked tensors, so rank r's values start at offset r·(its numel).
    """
    d, g, gi = model.hidden_size, model.o_groups, model.group_in
    kv = _ramp(rank * capacity * d + torch.arange(capacity) * d, d, 251)
    kv[t:] = KV_POISON
    a = _ramp(rank * g * pad * gi + torch.arange(g * pad) * gi, gi, 127).reshape(g, pad, gi)
    a[:, t:] = ATTENTION_POISON
    part = _ramp(rank * p * pad * d + torch.arange(p * pad) * d, d, 17)
    part[p * t :] = PARTIAL_POISON
    return {"kv_local": bf16(kv), "attention_grouped": bf16(a.reshape(g * pad, gi)), "o_partial": part}


class CollectivesScope(_Scope, Layer):
    """The three data transitions of the TP layers, bitwise, on sentinel-filled outputs (§9.2)."""

    scope = "collectives"
    sharded_o_weights = False

    def validate(self, case: Case) -> None:
        """Every case that passes `Case.validate` runs."""

    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        m = case.model
        _, pad, _, group_t_pad = _sizes(case)
        d, g, gi = m.hidden_size, m.o_groups, m.group_in
        bf16_, inp, io = torch.bfloat16, Kind.INPUT, Kind.INOUT
        return {
            "kv_local": TensorSpec((case.capacity, d), bf16_, inp),
            "attention_grouped": TensorSpec((g * pad, gi), bf16_, inp),
            "o_partial": TensorSpec((group_t_pad, d), torch.float32, inp),
            "tp_rank": TensorSpec((1,), torch.int32, inp),
            "local_t": TensorSpec((), torch.int32, inp),
            "kv_group": TensorSpec((case.tp * case.capacity, d), bf16_, io),
            "attention_local_groups": TensorSpec((case.local_o_groups * group_t_pad, gi), bf16_, io),
            "o_local": TensorSpec((pad, d), bf16_, io),
        }

    def rank_inputs(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        t, pad, _, _ = _sizes(case)
        specs = self.tensor_specs(case)
        sources = _collective_sources(case.model, case.tp, case.capacity, pad, t, rank)
        outputs = {n: torch.full(specs[n].shape, SENTINEL, dtype=specs[n].dtype) for n in self.compared_names(case)}
        return {**sources, "tp_rank": torch.tensor([rank], dtype=torch.int32), "local_t": _local_t(case), **outputs}

    def full_o_weights(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError("scope=collectives has no O weights (sharded_o_weights is False)")

    def golden(self, case: Case, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`golden_decode_attention_collectives_fixture` for rank d, every other row left −7.0.

        Rank d's outputs hold every rank's rows, and a rank's golden sees only its own tensors:
        the other ranks' sources are rebuilt from the §9.2 recipe (pure functions of the sizes
        and the rank), after checking that this rank's inputs are that recipe's.
        """
        x, model = tensors, case.model
        d, t = int(x["tp_rank"][0]), int(x["local_t"])
        capacity, width = x["kv_local"].shape
        g, gi = model.o_groups, model.group_in
        pad = x["attention_grouped"].shape[0] // g
        p = x["kv_group"].shape[0] // capacity
        lg = g // p
        own = _collective_sources(model, p, capacity, pad, t, d)
        if any(not torch.equal(x[n], own[n]) for n in own):
            raise ValueError(f"rank {d}: the collectives golden needs the swa.md §9.2 inputs; these differ from them")
        ranks = torch.arange(p)[:, None]
        tokens = torch.arange(t)[None, :]
        # kv_group[:P·t]: rank s's valid rows at s·t (rank-major all-gather).
        kv = _ramp(ranks * capacity * width + tokens * width, width, 251)  # [P, t, D]
        x["kv_group"][: p * t] = bf16(kv.reshape(p * t, width))
        # attention_local_groups[lg·GROUP_T_PAD + s·t + i] = attention_grouped_s[(d·LG + lg)·LOCAL_T_PAD + i].
        groups = (d * lg + torch.arange(lg))[:, None, None]
        rows = ranks[None] * g * pad * gi + (groups * pad + tokens[None]) * gi  # [LG, P, t]
        slabs = x["attention_local_groups"].view(lg, p * pad, gi)
        slabs[:, : p * t] = bf16(_ramp(rows, gi, 127).reshape(lg, p * t, gi))
        # o_local[i] = bf16(Σ_s o_partial_s[d·t + i]): integers, exact in any order.
        parts = _ramp(ranks * p * pad * width + (d * t + tokens) * width, width, 17)  # [P, t, D]
        x["o_local"][:t] = bf16(parts.sum(dim=0))
        return {n: x[n] for n in ("kv_group", "attention_local_groups", "o_local")}

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The project's collectives, each sent only the valid rows (P8) and written into them."""
        x, m = tensors, ctx.model
        p, t, pad = ctx.tp, ctx.case.local_t, ctx.case.local_t_pad
        g, gi, lg = m.o_groups, m.group_in, ctx.case.local_o_groups
        x["kv_group"][: p * t] = collectives.kv_all_gather(ctx, x["kv_local"][:t])
        attention_grouped = x["attention_grouped"].view(g, pad, gi)[:, :t]  # [G, t, GI]
        x["attention_local_groups"].view(lg, p * pad, gi)[:, : p * t] = collectives.group_all_to_all(ctx, attention_grouped)
        x["o_local"][:t] = collectives.reduce_scatter(ctx, x["o_partial"][: p * t])
        return {n: x[n] for n in ("kv_group", "attention_local_groups", "o_local")}

    def checks(self, case: Case) -> tuple[Check, ...]:
        # validation.md §12.5: bitwise, in transition order.
        poison = (KV_POISON, ATTENTION_POISON, PARTIAL_POISON)
        return tuple(
            ExactCheck(n, sentinel=SENTINEL, poison=poison) for n in ("kv_group", "attention_local_groups", "o_local")
        )


# -- tp1 scope (swa.md §6) --------------------------------------------------------------------
class TP1Scope(_Scope, StagedLayer):
    """The single-device layer on each rank's shard: full O weights, no collectives."""

    scope = "tp1"
    sharded_o_weights = False

    def validate(self, case: Case) -> None:
        self.layer.validate(case)

    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        m = case.model
        specs = dict(self.layer.tensor_specs(case))
        specs["wo_a"] = dataclasses.replace(specs["wo_a"], shape=(m.o_groups, m.o_lora_rank, m.group_in))
        specs["wo_b"] = dataclasses.replace(specs["wo_b"], shape=(m.hidden_size, m.o_groups * m.o_lora_rank))
        return specs

    def rank_inputs(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        inputs, (inputs["wo_a"], inputs["wo_b"]) = self.layer.rank_inputs_and_full_o(case, rank)
        return inputs  # wo_b_scale is already the full one's

    def full_o_weights(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.full_o_weights(case)

    def start_positions(self, case: Case) -> list[list[int]]:
        return self.layer.start_positions(case)

    def stages(self, model: ModelConfig) -> tuple[Stage, ...]:
        return self.layer.stages(model)

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor],
                run_stage: RunStage = default_run_stage) -> dict[str, torch.Tensor]:
        """The layer's stages on this rank alone: both collectives are identities (§5.6)."""
        return super().forward(ctx.single_device(), tensors, run_stage)

    def checks(self, case: Case) -> tuple[Check, ...]:
        return self.layer.checks(case)


__all__ = [
    "SENTINEL",
    "OutputScope",
    "CollectivesScope",
    "TP1Scope",
]
