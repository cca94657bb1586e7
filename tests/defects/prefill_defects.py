"""Defects of the context-parallel prefill (layers/prefill): the CP protocol and exchanges."""

from __future__ import annotations

import torch
from .stage_defect import StageDefect


# -- context-parallel prefill (layers/prefill): one defect of the CP protocol each ---------------
class PrefillMissingPredecessorTail(StageDefect):
    """Rank 1 never receives rank 0's tails: zeros where rank 0's segments' tails belong."""

    stages = ("tail_exchange",)

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)["logical_tails_out"].clone()
        if ctx.rank == 1:
            from layers.prefill import tables  # this section's own: the file above only grows at its end

            owners = torch.tensor([tables.owner(ctx.case, s)[0] for s in range(ctx.case.num_segments)])
            out[owners == 0] = 0
        return {"logical_tails_out": out}


class PrefillLocalRopePositions(StageDefect):
    """RoPE at the rank-local row index instead of the token's global position."""

    stages = ("project",)

    def defective(self, stage, ctx, v):
        local = torch.arange(v["query_position_ids"].numel(), dtype=torch.int32).reshape(v["query_position_ids"].shape)
        return stage.run(ctx, {**v, "query_position_ids": local})


class PrefillFinalWindowOnOwnerOnly(StageDefect):
    """Only the rank that owns the last segment commits the final window into its kv_cache."""

    stages = ("final_window_commit",)

    def defective(self, stage, ctx, v):
        from layers.prefill import tables

        if tables.owner(ctx.case, ctx.case.num_segments - 1)[0] == ctx.rank:
            return stage.run(ctx, v)
        return {"kv_cache": v["kv_cache"]}


class PrefillDroppedKeys(StageDefect):
    """The reference's key tables: only the immediate predecessor's tail, so a segment shorter
    than the window drops the keys of the segments before it."""

    stages = ("key_table",)

    def defective(self, stage, ctx, v):
        from layers.prefill import tables

        rows = tables.key_rows(v["query_position_ids"], v["overlay_active_lengths"], v["predecessor_segments"],
                               v["segment_starts_t"], ctx.case.window, v["kv_cache"][..., 0, 0].numel(),
                               predecessors="first")
        return {"swa_key_rows": rows}


# -- context-parallel prefill: the CP exchanges of each layout ------------------------------------
class PrefillAllGatherRingOrder(StageDefect):
    """The contiguous layout's KV all-gather left in ring arrival order: rank r's block i holds
    rank (i + r) mod cp's rows, so every rank but 0 reads its keys from the wrong ranks."""

    stages = ("kv_allgather",)

    def defective(self, stage, ctx, v):
        hd = v["kv"].shape[-1]
        blocks = stage.run(ctx, v)["gathered_kv"].reshape(ctx.case.cp, -1, hd)
        return {"gathered_kv": torch.roll(blocks, -ctx.rank, dims=0).reshape(-1, hd)}


class PrefillTailsInRankMajorOrder(StageDefect):
    """The zigzag tail exchange never applies reverse_index: the tails stay in rank-major order
    (block 2·rank + part), which is the logical order only for the contiguous layout."""

    stages = ("tail_exchange",)

    def defective(self, stage, ctx, v):
        index = v["reverse_index"]
        return stage.run(ctx, {**v, "reverse_index": torch.arange(index.shape[-1], dtype=index.dtype).expand_as(index)})


# -- context-parallel prefill, HCA: the compressor's windows and the compact exchange --------------
class PrefillHCALocalRopePositions(PrefillLocalRopePositions):
    """HCA: RoPE of Q and KV at the rank-local row index (its position table is `query_positions`)."""

    def defective(self, stage, ctx, v):
        from types import SimpleNamespace

        renamed = SimpleNamespace(run=lambda c, vals: stage.run(c, {**vals, "query_positions": vals["query_position_ids"]}))
        return super().defective(renamed, ctx, {**v, "query_position_ids": v["query_positions"]})


class PrefillHCAWindowFromOwnRowsOnly(StageDefect):
    """HCA: a pooling window that straddles into earlier segments reads zeros there (no
    exchanged hidden tails), as if every block started in the segment that ends it."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        return stage.run(ctx, {**v, "logical_hidden_tails": torch.zeros_like(v["logical_hidden_tails"])})


class PrefillHCAWindowFromPredecessorOnly(StageDefect):
    """HCA: the reference's scratch pool: a pooling window reads the immediate predecessor's
    hidden tail only, so a window reaching two segments back reads zeros there."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        tails = v["logical_hidden_tails"]
        outs = []
        for part in range(2):
            pred = int(v["predecessor_segments"][part])
            kept = torch.zeros_like(tails)
            if pred >= 0:
                kept[pred] = tails[pred]
            outs.append(stage.run(ctx, {**v, "logical_hidden_tails": kept}))
        rows = outs[0]["local_cmp_payload"].shape[0] // 2  # part p's rows come from run p
        merged = {n: outs[0][n].clone() for n in outs[0]}
        for n in ("local_cmp_payload", "local_cmp_meta"):
            merged[n][rows:] = outs[1][n][rows:]
        final = int(v["final_segment_t"][0])
        if int(v["predecessor_segments"][1]) + 1 == final:
            for n in ("local_state_payload", "local_state_meta"):
                merged[n] = outs[1][n]
        return merged


class PrefillHCAStateOnOwnerOnly(StageDefect):
    """HCA: only the final segment's owner commits the last compressor-state rows."""

    stages = ("compact_exchange",)

    def defective(self, stage, ctx, v):
        from layers.prefill import tables

        before = v["compress_state"].clone()
        out = stage.run(ctx, v)
        if tables.owner(ctx.case, ctx.case.num_segments - 1)[0] != ctx.rank:
            out["compress_state"].copy_(before)
        return out


class PrefillHCACompressedRowsOnOwnerOnly(StageDefect):
    """HCA: each rank commits only the compressed rows it made itself (no compact exchange of them)."""

    stages = ("compact_exchange",)

    def defective(self, stage, ctx, v):
        from layers.prefill import hca

        out = stage.run(ctx, {**v, "local_cmp_meta": torch.full_like(v["local_cmp_meta"], -1)})  # no row sent
        no_state = (v["local_state_payload"][None][:0], v["local_state_meta"][None][:0])
        return hca.commit_compact({**v, **out}, v["local_cmp_payload"][None], v["local_cmp_meta"][None], *no_state,
                                  ctx.model.c128_state_block_size)


# -- context-parallel prefill, HCA under the contiguous layout: the replicated-KV all-gather ------
class PrefillHCAAllGatherRingOrder(StageDefect):
    """HCA contiguous: the all-gather of the KV and compressor-state rows left in ring arrival
    order (rank r's block i holds rank (i + r) mod cp's rows), so every rank but 0 reads its
    keys and pools its blocks from the wrong ranks' rows."""

    stages = ("kv_allgather",)

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)
        return {n: torch.roll(t.reshape(ctx.case.cp, -1, t.shape[-1]), -ctx.rank, dims=0).reshape(-1, t.shape[-1])
                for n, t in out.items()}


class PrefillHCAGatheredOwnBlocksOnly(StageDefect):
    """HCA contiguous: zigzag's compressor without its compact exchange: each rank commits only
    the compressed rows of the blocks ending in its own segments, and the final state rows only
    on the final segment's owner."""

    stages = ("gathered_compressor",)

    def defective(self, stage, ctx, v):
        from layers.components.hca_compressor import COMPRESS_RATIO
        from layers.prefill import hca_tables, tables

        case, hd = ctx.case, ctx.model.head_dim
        cmp_before, state_before = v["cmp_kv"].clone(), v["compress_state"].clone()
        out = stage.run(ctx, v)
        own = tables.owner_segments(case)[ctx.rank]
        for b in hca_tables.boundaries(case.prefix, case.prefix + case.total):
            segment = max(i for i, st in enumerate(case.starts) if st <= b)
            if segment not in own:
                row = hca_tables.cmp_rows(v["cmp_block_table"], torch.tensor([(b + 1) // COMPRESS_RATIO - 1]))
                out["cmp_kv"].view(-1, hd)[row] = cmp_before.view(-1, hd)[row]
        if case.num_segments - 1 not in own:
            out["compress_state"].copy_(state_before)
        return out


# -- context-parallel prefill, CSA: the compressors, the compact exchange and the indexer ----------
class PrefillCSALocalRopePositions(PrefillHCALocalRopePositions):
    """CSA: RoPE of Q and KV at the rank-local row index (its position table is `query_positions`)."""


class PrefillCSAWindowFromOwnRowsOnly(PrefillHCAWindowFromOwnRowsOnly):
    """CSA: a compressor window that reaches into earlier segments reads zeros there (no
    exchanged hidden tails): every segment's first block loses the 4 positions before it."""


class PrefillCSAInnerStateFromWrongSegment(StageDefect):
    """CSA: the final segment's owner sends the inner compressor's state rows of its other
    segment (the main compressor's are right)."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)
        final, parts = int(v["final_segment_t"][0]), [int(p) + 1 for p in v["predecessor_segments"]]
        if final in parts:
            other = torch.tensor([parts[1 - parts.index(final)]], dtype=v["final_segment_t"].dtype)
            out["inner_state_payload"] = stage.run(ctx, {**v, "final_segment_t": other})["inner_state_payload"]
        return out


class PrefillCSATopkAtLocalPositions(StageDefect):
    """CSA: the indexer's causal limit from the rank-local row index, not the global position:
    a query of a later segment sees only as many compressed rows as its row index allows."""

    stages = ("indexer_topk",)

    def defective(self, stage, ctx, v):
        pos = v["query_positions"]
        return stage.run(ctx, {**v, "query_positions": torch.arange(pos.numel(), dtype=pos.dtype).reshape(pos.shape)})


class PrefillCSAIndexerRowsOnOwnerOnly(StageDefect):
    """CSA: each rank commits only the indexer rows (int8 and scale) it made itself; the main
    rows and the state rows go through the compact exchange."""

    stages = ("compact_exchange",)

    def defective(self, stage, ctx, v):
        from layers.prefill import csa_tables

        before = {n: v[n].clone() for n in ("idx_kv_cache", "idx_kv_scale")}
        out = stage.run(ctx, v)
        for n, t in before.items():
            out[n].copy_(t)
        slots = v["record_meta"][:, 0].long()
        rows = csa_tables.cmp_rows(v["idx_block_table"], slots[slots >= 0])
        out["idx_kv_cache"].view(-1, v["idx_payload"].shape[-1])[rows] = v["idx_payload"][slots >= 0]
        out["idx_kv_scale"].view(-1, 1)[rows] = v["idx_scale_payload"][slots >= 0]
        return out


class PrefillCSAWindowFromPredecessorOnly(StageDefect):
    """CSA: the reference's seed: a segment's compressors see only its immediate predecessor's
    rows before it, so a window reaching two segments back reads zeros there."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        from layers.prefill import csa

        tails, preds = v["logical_hidden_tails"], [int(p) for p in v["predecessor_segments"]]
        only = [tails * (torch.arange(tails.shape[0]) == p).to(tails.dtype)[:, None, None] for p in preds]
        runs = [stage.run(ctx, {**v, "logical_hidden_tails": kept}) for kept in only]
        half = csa.PAYLOAD_ROWS // 2  # part p's compressed rows from run p, the final state from its part's
        final_part = int(preds[1] + 1 == int(v["final_segment_t"][0]))
        return {n: torch.cat((runs[0][n][:half], runs[1][n][half:])) if n in csa.COMPACT[:4] else runs[final_part][n]
                for n in csa.COMPACT}
