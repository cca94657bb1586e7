"""layer=csa phase=prefill scope=collectives in one process: the zigzag tail and compact
exchanges alone on closed-form integer sources, bitwise against the golden; a row at the wrong
place or a commit missing on one rank FAILs naming the tensor and the rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from layers.contract.config import TINY, ConfigError
from layers.contract.context import RankContext
from layers.prefill import csa_collectives, csa_layer, registry
from layers.prefill.csa_fixture import POOLS
from layers.prefill.case import PrefillCase
from tests.prefill.judge import failures, scope_failures

CPU = torch.device("cpu")


def case(cp=2, **kw) -> PrefillCase:
    return PrefillCase("csa", TINY, cp, 7, scope="collectives", **kw)


def _every(run):
    """`run(stage, ctx, v)` reading the group's stacked sources from `run.every` (set by `_group`)."""
    run.every = {}
    return run


def _group(c: PrefillCase, run=None) -> list[dict]:
    """Every rank's outputs, each exchange by its reference movement on every rank's stacked
    sources; `run(stage, ctx, v)` in place of it (a wrong movement), those sources in `run.every`."""
    scope = registry.of_case(c)
    values = [scope.rank_inputs(c, r) for r in range(c.cp)]
    for stage in scope.exchange_stages(c):
        every = {n: torch.stack([v[n] for v in values]) for n in stage.every_rank}
        if run is not None:
            run.every = every
        for r, v in enumerate(values):
            ctx = RankContext(case=c, rank=r, device=CPU)
            v.update(stage.reference(ctx, every) if run is None else run(stage, ctx, v))
    return [{n: v[n] for n in csa_collectives.COMPARED} for v in values]


@pytest.mark.parametrize("c", [
    case(1), case(2), case(4), case(4, prefix=301, segment_lens=(201, 77, 256, 130, 1, 61, 128, 3)),
], ids=lambda c: f"cp{c.cp}-p{c.prefix}")
def test_exchanges_match_the_golden(c):
    assert registry.of_case(c) is csa_collectives.SCOPE
    assert scope_failures(c, _group(c)) == []


def test_metadata_is_the_case_blocks_and_final_state():
    """cp=2, segments of 128: each part completes 32 blocks (slots 32·segment …); the final
    segment's owner (rank 0) sends the step's last 8 state rows."""
    c = case(2)
    meta = [csa_collectives.compact_sources(c, r) for r in range(2)]
    assert [m["record_meta"][[0, 64], 0].tolist() for m in meta] == [[0, 96], [32, 64]]
    assert [m["state_meta"][:2].tolist() for m in meta] == [[8, 504], [0, 0]]


@pytest.mark.parametrize("stage, tensor", [
    ("tail_exchange", "logical_hidden_tails"),
    ("compact_exchange", "idx_kv_cache"),
    ("compact_exchange", "idx_kv_scale"),
    ("compact_exchange", "inner_compress_state"),
])
def test_wrong_rows_on_one_rank_fail_there(stage, tensor):
    c = case(2)

    def run(s, ctx, v):
        out = s.reference(ctx, run.every)
        return {**out, tensor: out[tensor].flip(0)} if s.name == stage and ctx.rank == 1 else out

    assert scope_failures(c, _group(c, _every(run))) == [(1, tensor)]


def test_tails_in_rank_order_fail_on_every_rank():
    """reverse_index never applied (PrefillTailsInRankMajorOrder's movement): both tails wrong
    on ranks 0 and 1; the pools pass."""
    c = case(2)

    def run(s, ctx, v):
        if s.name != "tail_exchange":
            return s.reference(ctx, run.every)
        index = run.every["reverse_index"]
        return s.reference(ctx, {**run.every, "reverse_index": torch.arange(index.shape[-1]).expand_as(index)})

    assert sorted(scope_failures(c, _group(c, _every(run)))) == [(0, "logical_hidden_tails"), (0, "logical_tails_out"),
                                                          (1, "logical_hidden_tails"), (1, "logical_tails_out")]


def test_indexer_rows_on_their_maker_only_fail_on_every_rank():
    """PrefillCSAIndexerRowsOnOwnerOnly's movement: each rank commits the main and state rows of
    every rank but only its own indexer rows and scales."""
    c = case(2)

    def run(s, ctx, v):
        if s.name != "compact_exchange":
            return s.reference(ctx, run.every)
        meta = run.every["record_meta"].clone()
        meta[torch.arange(c.cp) != ctx.rank] = -1
        empty = {n: run.every[n].clone() for n in POOLS}  # the reference commits into the pools it reads
        own = s.reference(ctx, {**run.every, **empty, "record_meta": meta})
        out = s.reference(ctx, {**run.every, **{n: t.clone() for n, t in empty.items()}})
        return {**out, "idx_kv_cache": own["idx_kv_cache"], "idx_kv_scale": own["idx_kv_scale"]}

    assert sorted(scope_failures(c, _group(c, _every(run)))) == [(0, "idx_kv_cache"), (0, "idx_kv_scale"),
                                                          (1, "idx_kv_cache"), (1, "idx_kv_scale")]


def test_golden_places_rows_by_position_not_by_the_metadata():
    """A wrong slot in the metadata moves the row the stage commits; the golden does not follow."""
    c = case(2)
    scope = registry.of_case(c)
    values = [scope.rank_inputs(c, r) for r in range(c.cp)]
    values[1]["record_meta"][0, 0] = 5
    compact = next(s for s in scope.exchange_stages(c) if s.name == "compact_exchange")
    every = {n: torch.stack([v[n] for v in values]) for n in compact.every_rank}
    outs = [compact.reference(RankContext(case=c, rank=r, device=CPU), every) for r in range(2)]
    expected = [scope.golden(c, scope.rank_inputs(c, r)) for r in range(2)]
    checks = [ch for ch in scope.checks(c) if ch.output in POOLS]
    assert sorted(failures(checks, outs, expected)) == [(r, n) for r in range(2) for n in
                                                        ("cmp_kv", "idx_kv_cache", "idx_kv_scale")]


@pytest.mark.parametrize("kw, words", [
    (dict(cp_layout="contiguous"), "cp_layout=zigzag"),
    (dict(prefix=4000), "scores at most 1024"),
])
def test_csa_rules_hold_for_the_scope(kw, words):
    with pytest.raises(ConfigError, match=words):
        registry.of_case(case(2, **kw)).validate(case(2, **kw))


def test_full_scope_keeps_the_full_layer():
    assert registry.of_case(dataclasses.replace(case(2), scope="full")) is csa_layer.LAYER
