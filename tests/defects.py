"""Implementations under test with one deliberate defect each (for negative end-to-end tests).

Each is the default TP implementation with one stage replaced, inside its own call only, so
the golden (computed outside the call) stays the reference. The workers import this module by
name, as they would a user's implementation.
"""

from __future__ import annotations

from unittest import mock

import torch

from layers import tp
from layers.components.numerics import bf16


class _Patched(tp.TorchTP):
    target: str  # the module attribute this defect replaces

    def replacement(self, ctx, original):
        raise NotImplementedError

    def __call__(self, ctx, tensors):
        original = _resolve(self.target)
        with mock.patch(self.target, self.replacement(ctx, original)):
            return super().__call__(ctx, tensors)


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


class ReduceScatterWithoutSum(_Patched):
    """Each owner keeps only its own partial: the other ranks' groups are never added."""

    target = "layers.distributed.collectives.reduce_scatter"

    def replacement(self, ctx, original):
        def reduce_scatter(ctx, o_partial):
            t = o_partial.shape[0] // ctx.tp
            return bf16(o_partial[ctx.rank * t : (ctx.rank + 1) * t])

        return reduce_scatter


class GroupsToWrongRank(_Patched):
    """The head-group all-to-all delivers every rank's groups to the next rank."""

    target = "layers.distributed.collectives.group_all_to_all"

    def replacement(self, ctx, original):
        def group_all_to_all(ctx, attention_grouped):
            g = attention_grouped.shape[0]
            lg = g // ctx.tp
            return original(ctx, torch.roll(attention_grouped, shifts=lg, dims=0))

        return group_all_to_all


class PerturbRankTokens(tp.TorchTP):
    """Rank 1 returns a slightly wrong x_out for its first request's tokens."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            seq = ctx.case.seq
            out["x_out"][:seq] = out["x_out"][:seq] * 1.5 + 0.25
        return out


class SkipCacheWrite(_Patched):
    """The SWA kv insert never happens."""

    target = "layers.swa.write_cache_rows"

    def replacement(self, ctx, original):
        return lambda kv_cache, slot_mapping, kv: None


class CacheWriteWrongSlot(_Patched):
    """The SWA kv insert lands one row after the slot mapping's."""

    target = "layers.swa.write_cache_rows"

    def replacement(self, ctx, original):
        def write_cache_rows(kv_cache, slot_mapping, kv):
            shifted = torch.where(slot_mapping >= 0, slot_mapping + 1, slot_mapping)
            original(kv_cache, shifted, kv)

        return write_cache_rows


def _shift(slots: torch.Tensor) -> torch.Tensor:
    return torch.where(slots >= 0, slots + 1, slots)


class CsaMissedCommit(_Patched):
    """The CSA main compressor never commits its compressed rows into cmp_kv."""

    target = "layers.components.csa_compressor.commit_cmp_rows"

    def replacement(self, ctx, original):
        return lambda cmp_kv, slots, rows: None


class CsaStateWrongSlot(_Patched):
    """The CSA compressors write their state one row after the state slot mapping's."""

    target = "layers.components.csa_compressor.write_state"

    def replacement(self, ctx, original):
        return lambda state_rows, slots, kv, score: original(state_rows, _shift(slots), kv, score)


class CsaSentinelOverwritten(_Patched):
    """Besides its own rows, the CSA state write zeroes the pool's last row (a never-used,
    -inf sentinel row)."""

    target = "layers.components.csa_compressor.write_state"

    def replacement(self, ctx, original):
        def write_state(state_rows, slots, kv, score):
            original(state_rows, slots, kv, score)
            state_rows[-1] = 0.0

        return write_state


class CsaTopkOffByOne(_Patched):
    """The indexer's top-k returns every selected slot shifted by one."""

    target = "layers.components.indexer.select_topk"

    def replacement(self, ctx, original):
        return lambda score, visible, k: _shift(original(score, visible, k))


class HcaMissedCommit(_Patched):
    """The HCA compressor never commits its compressed rows into cmp_kv."""

    target = "layers.components.hca_compressor.commit"

    def replacement(self, ctx, original):
        return lambda cmp_kv, cmp_slots, y: None


class HcaPoolsWrongRows(_Patched):
    """The HCA compressor pools the state rows one position late."""

    target = "layers.components.hca_compressor.window_state_rows"

    def replacement(self, ctx, original):
        return lambda table, request, pool_pos, block_size: original(table, request, pool_pos + 1, block_size)


class HcaWrongRopePosition(_Patched):
    """The HCA compressed rows are rotated with the previous row's angles."""

    target = "layers.components.hca_compressor.rope_compressed"

    def replacement(self, ctx, original):
        return lambda y, cos, sin, model: original(y, torch.roll(cos, 1, 0), torch.roll(sin, 1, 0), model)
