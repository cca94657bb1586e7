"""Defects of the attention layers (swa, csa, hca): their TP stages, the dp x tp groups, and the
caches inside and outside the pooled budgets."""

from __future__ import annotations

import torch
import torch.distributed as dist

from layers.hca import layer as hca
from layers.components import hca_compressor
from layers.components.numerics import bf16
from layers.distributed import wire
from layers.tp import TorchTP
from .stage_defect import StageDefect


def _shift(slots: torch.Tensor) -> torch.Tensor:
    return torch.where(slots >= 0, slots + 1, slots)


class ReduceScatterWithoutSum(StageDefect):
    """Each owner keeps only its own partial: the other ranks' groups are never added."""

    stages = ("reduce_scatter",)

    def defective(self, stage, ctx, v):
        t = v["o_partial"].shape[0] // ctx.tp
        return {"attn_out": bf16(v["o_partial"][ctx.rank * t : (ctx.rank + 1) * t])}


class GroupsToWrongRank(StageDefect):
    """The head-group all-to-all delivers every rank's groups to the next rank."""

    stages = ("group_all_to_all",)

    def defective(self, stage, ctx, v):
        lg = v["attention_grouped"].shape[0] // ctx.tp
        return stage.run(ctx, {"attention_grouped": torch.roll(v["attention_grouped"], shifts=lg, dims=0)})


class PerturbRankTokens(TorchTP):
    """Rank 1 returns a slightly wrong x_out for its first request's tokens."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            seq = ctx.case.seq
            out["x_out"][:seq] = out["x_out"][:seq] * 1.5 + 0.25
        return out


class SkipCacheWrite(StageDefect):
    """The kv cache insert never happens."""

    stages = ("cache_insert",)

    def defective(self, stage, ctx, v):
        return {"kv_cache": v["kv_cache"]}


class CacheWriteWrongSlot(StageDefect):
    """The kv cache insert lands one row after the slot mapping's."""

    stages = ("cache_insert",)

    def defective(self, stage, ctx, v):
        mapping = next(n for n in stage.reads if n.endswith("slot_mapping"))
        return stage.run(ctx, {**v, mapping: _shift(v[mapping])})


class CsaMissedCommit(StageDefect):
    """The CSA main compressor never commits its compressed rows into cmp_kv."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        before = v["cmp_kv"].clone()
        out = stage.run(ctx, v)
        out["cmp_kv"].copy_(before)
        return out


class CsaStateWrongSlot(StageDefect):
    """The CSA compressors write their state one row after the state slot mapping's."""

    stages = ("compressor", "indexer_compressor")

    def defective(self, stage, ctx, v):
        mapping = "state_slot_mapping" if stage.name == "compressor" else "inner_state_slot_mapping"
        return stage.run(ctx, {**v, mapping: _shift(v[mapping])})


class CsaSentinelOverwritten(StageDefect):
    """Besides their own rows, the CSA compressors zero their state pool's last row (a
    never-used, -inf sentinel row)."""

    stages = ("compressor", "indexer_compressor")

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)
        state = "compress_state" if stage.name == "compressor" else "inner_compress_state"
        out[state].view(-1, out[state].shape[-1])[-1] = 0.0
        return out


class CsaTopkOffByOne(StageDefect):
    """The indexer's top-k returns every selected slot shifted by one."""

    stages = ("indexer_topk",)

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)
        return {**out, "idx_topk": _shift(out["idx_topk"])}


class HcaMissedCommit(CsaMissedCommit):
    """The HCA compressor never commits its compressed rows into cmp_kv (its stage has the CSA
    one's name)."""


class HcaPoolsWrongRows(StageDefect):
    """The HCA compressor pools the state rows one position late."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        def late(table, request, pool_pos, block_size):
            return hca_compressor.window_state_rows(table, request, pool_pos + 1, block_size)

        return hca.compressor(ctx, v, window_rows=late)


class HcaWrongRopePosition(StageDefect):
    """The HCA compressed rows are rotated with the previous row's angles."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        def rotate(y, cos, sin, model):
            return hca_compressor.rope_compressed(y, torch.roll(cos, 1, 0), torch.roll(sin, 1, 0), model)

        return hca.compressor(ctx, v, rotate=rotate)


# -- defects that only several TP groups in one launch (dp x tp) reveal -----------------------------
class GroupSliceByGlobalRank(StageDefect):
    """The all-to-all picks its output groups by the global rank (clamped into the group), not the
    rank inside the TP group: right in group 0, wrong in every later one."""

    stages = ("group_all_to_all",)

    def defective(self, stage, ctx, v):
        every = wire.all_gather(v["attention_grouped"], ctx.group, ctx.tp)  # [P, G, t, GI]
        p, g, t, gi = every.shape
        lg = g // p
        rank = min(ctx.global_rank, p - 1)
        return {"attention_local_groups": every[:, rank * lg : (rank + 1) * lg].permute(1, 0, 2, 3).reshape(lg, p * t, gi)}


class ReduceOnTheWorldGroup(StageDefect):
    """The reduce-scatter sums the partials of every rank of the world, not of the TP group."""

    stages = ("reduce_scatter",)

    def defective(self, stage, ctx, v):
        import torch.distributed as dist

        total = v["o_partial"].clone()
        dist.all_reduce(total, group=dist.group.WORLD)
        t = total.shape[0] // ctx.tp
        return {"attn_out": bf16(total[ctx.rank * t : (ctx.rank + 1) * t])}


class PerturbGroup1Rank1(TorchTP):
    """Rank 1 of TP group 1 returns a slightly wrong x_out for its first request's tokens."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.group_index == 1 and ctx.rank == 1:
            seq = ctx.case.seq
            out["x_out"][:seq] = out["x_out"][:seq] * 1.5 + 0.25
        return out


# -- defects inside the reference's pooled budgets (integrity checks) ----------------------------
class CacheTamperedAfterAttention(StageDefect):
    """The kv cache insert runs and attention reads the right rows, so x_out is right; then
    `tamper` changes the cache rows of `tokens` on each rank of `ranks` (a copy of the rows,
    written back), as a kernel that attends over its fresh kv but botches the cache write."""

    stages = ("cache_insert", "attention")
    ranks: tuple[int, ...] = (1,)
    groups: tuple[int, ...] | None = None  # the TP groups of a dp x tp launch it tampers in (None: all)
    tokens = slice(-2, None)  # the rank's last two tokens

    def tamper(self, rank: int, rows: torch.Tensor, before: torch.Tensor) -> None:
        raise NotImplementedError

    def defective(self, stage, ctx, v):
        flat = v["kv_cache"].view(-1, v["kv_cache"].shape[-1])
        if stage.name == "cache_insert":
            mapping = v[next(n for n in stage.reads if n.endswith("slot_mapping"))]
            slots = mapping[self.tokens]
            self._slots = slots[slots >= 0].to(torch.int64)
            self._before = flat[self._slots].clone()
            return stage.run(ctx, v)
        out = stage.run(ctx, v)
        if ctx.rank in self.ranks and (self.groups is None or ctx.group_index in self.groups):
            rows = flat[self._slots]
            self.tamper(ctx.rank, rows, self._before)
            flat[self._slots] = rows
        return out


class SkipTokenCacheWrites(CacheTamperedAfterAttention):
    """Rank 1 never writes its last two tokens' kv cache rows: they keep their value from
    before the step (inside the pooled 0.5 % budget at small and flash dims)."""

    def tamper(self, rank, rows, before):
        rows.copy_(before)


class HugeValueInCache(CacheTamperedAfterAttention):
    """Rank 1 writes 1e30 into one value of its last token's kv cache row."""

    tokens = slice(-1, None)

    def tamper(self, rank, rows, before):
        rows[0, 0] = 1e30


class HugeValueInGroup1Cache(HugeValueInCache):
    """HugeValueInCache in TP group 1 of a dp x tp launch only."""

    groups = (1,)


class SkipWriteAndHugeValue(CacheTamperedAfterAttention):
    """Both at once, one token each: rank 0 writes 1e30 into its last token's kv cache row,
    rank 1 never writes its last token's row."""

    ranks = (0, 1)
    tokens = slice(-1, None)

    def tamper(self, rank, rows, before):
        if rank == 1:
            rows.copy_(before)
        else:
            rows[0, 0] = 1e30


class CorruptPureInputs(TorchTP):
    """Rank 1 computes the right outputs, then scales its wq_a by -3 and shifts its slot
    mapping by 7 in place (pure inputs: the contract lets only the in-out tensors change)."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            tensors["wq_a"].mul_(-3)
            mapping = next(n for n in tensors if n.endswith("slot_mapping"))
            tensors[mapping].add_(7)
        return out


# -- stored zeros: inside the pooled budgets and the caps (stale_values, concentration) --------------
class ZeroKvTailColumns(CacheTamperedAfterAttention):
    """Rank 1 stores zeros in the last 16 columns of its last two tokens' kv cache rows (a
    kernel whose last vector store never happens): each row is written, so written_rows sees
    it changed, and a 0 never exceeds the cap 128 atol + |e|."""

    def tamper(self, rank, rows, before):
        rows[:, -16:] = 0


class ZeroKvRows(CacheTamperedAfterAttention):
    """Rank 1 stores zeros in its last two tokens' whole kv cache rows (SkipTokenCacheWrites
    with zeros for the old values)."""

    def tamper(self, rank, rows, before):
        rows.zero_()


class HcaStateHalfRowUnwritten(StageDefect):
    """Rank 1's HCA compressor writes only the first half of its last token's compressor-state
    row: the second half keeps its value from before the step (the pool's initial 0)."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        flat = v["compress_state"].view(-1, v["compress_state"].shape[-1])
        slot = int(v["state_slot_mapping"][-1])
        before = flat[slot].clone()
        out = stage.run(ctx, v)
        if ctx.rank == 1:
            half = flat.shape[1] // 2
            flat[slot, half:] = before[half:]
        return out
