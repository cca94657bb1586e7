"""layer=hca phase=prefill scope=collectives in one process: each layout's exchanges alone
(zigzag: the tail and compact exchanges; contiguous: the all-gather of KV and state rows) on
closed-form integer sources, bitwise against the golden; a row at the wrong place or a commit
missing on one rank FAILs naming the tensor and the rank."""

from __future__ import annotations

import pytest
import torch

from layers.contract.config import TINY, ConfigError
from layers.contract.context import RankContext
from layers.prefill import hca, hca_collectives, registry
from layers.prefill.case import PrefillCase
from tests.prefill.judge import failures, scope_failures


def case(cp=2, **kw) -> PrefillCase:
    return PrefillCase("hca", TINY, cp, 7, scope="collectives", **kw)


def _group(c: PrefillCase, damage=None) -> list[dict]:
    """Every rank's outputs, each exchange by its reference movement; `damage(stage, rank, out)`
    changes a stage's output on one rank."""
    scope = registry.of_case(c)
    values = [scope.rank_inputs(c, r) for r in range(c.cp)]
    for stage in scope.exchange_stages(c):
        every = {n: torch.stack([v[n] for v in values]) for n in stage.every_rank}
        for r, v in enumerate(values):
            out = stage.reference(RankContext(case=c, rank=r, device=torch.device("cpu")), every)
            v.update(out if damage is None else damage(stage.name, r, out))
    return [{n: v[n] for n in hca_collectives.EXCHANGES[c.cp_layout][1]} for v in values]


@pytest.mark.parametrize("c", [
    case(1), case(2), case(4, prefix=300, segment_lens=(200, 77, 256, 130, 1, 60, 128, 3)),
    case(2, cp_layout="contiguous"), case(4, cp_layout="contiguous"),
], ids=lambda c: f"{c.cp_layout}-cp{c.cp}-p{c.prefix}")
def test_exchanges_match_the_golden(c):
    assert registry.of_case(c) is hca_collectives.SCOPE
    assert scope_failures(c, _group(c)) == []


def test_metadata_is_the_case_blocks_and_final_state():
    """cp=2 zigzag, segments of 128: each part completes one block (slot = segment); the final
    segment's owner (rank 0) sends the step's last 128 state rows."""
    c = case(2)
    meta = [hca_collectives.compact_sources(c, r) for r in range(2)]
    assert [m["local_cmp_meta"][[0, 2], 0].tolist() for m in meta] == [[0, 3], [1, 2]]
    assert [m["local_state_meta"][:2].tolist() for m in meta] == [[128, 384], [0, 0]]


@pytest.mark.parametrize("layout, stage, tensor", [
    ("zigzag", "tail_exchange", "logical_hidden_tails"),
    ("zigzag", "compact_exchange", "cmp_kv"),
    ("zigzag", "compact_exchange", "compress_state"),
    ("contiguous", "kv_allgather", "gathered_state"),
])
def test_wrong_rows_on_one_rank_fail_there(layout, stage, tensor):
    c = case(2, cp_layout=layout)

    def damage(name, rank, out):
        return {**out, tensor: out[tensor].flip(0)} if name == stage and rank == 1 else out

    assert scope_failures(c, _group(c, damage)) == [(1, tensor)]


def test_golden_places_rows_by_position_not_by_the_metadata():
    """A wrong slot in the metadata moves the row the stage commits; the golden does not follow."""
    c = case(2)
    scope = registry.of_case(c)
    values = [scope.rank_inputs(c, r) for r in range(c.cp)]
    values[1]["local_cmp_meta"][0, 0] = 5
    compact = next(s for s in scope.exchange_stages(c) if s.name == "compact_exchange")
    every = {n: torch.stack([v[n] for v in values]) for n in compact.every_rank}
    outs = [compact.reference(RankContext(case=c, rank=r, device=torch.device("cpu")), every) for r in range(2)]
    expected = [scope.golden(c, scope.rank_inputs(c, r)) for r in range(2)]
    assert failures(hca.default_checks()[1:2], outs, expected) == [(0, "cmp_kv"), (1, "cmp_kv")]


def test_hca_rules_hold_for_the_scope():
    with pytest.raises(ConfigError, match="ring of 32"):
        hca_collectives.SCOPE.validate(case(2, prefix=5000))
