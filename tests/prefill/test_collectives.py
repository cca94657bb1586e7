"""phase=prefill scope=collectives in one process: each layout's exchange alone on its
closed-form integer sources, bitwise against the golden; a wrong order FAILs naming the rank."""

from __future__ import annotations

import pytest
import torch

from layers.contract.config import TINY, ConfigError
from layers.contract.context import RankContext
from layers.prefill import collectives, layer, registry
from layers.prefill.case import PrefillCase
from tests.prefill.judge import failures


def case(cp=2, **kw) -> PrefillCase:
    return PrefillCase("swa", TINY, cp, 7, scope="collectives", **kw)


def _group(c: PrefillCase, swap=None) -> list[dict]:
    """Every rank's output by the exchange's reference movement; `swap(rank, out)` damages it."""
    scope = layer.of_case(c)
    stage = scope.exchange_stage(c)
    inputs = [scope.rank_inputs(c, r) for r in range(c.cp)]
    every = {n: torch.stack([i[n] for i in inputs]) for n in stage.every_rank}
    outs = []
    for r in range(c.cp):
        out = stage.reference(RankContext(case=c, rank=r, device=torch.device("cpu")), every)
        outs.append(out if swap is None else swap(r, out))
    return outs


def _judge(c: PrefillCase, outs: list[dict]) -> list[tuple[int, str]]:
    scope = layer.of_case(c)
    expected = [scope.golden(c, scope.rank_inputs(c, r)) for r in range(c.cp)]
    return failures(scope.checks(c), outs, expected)


@pytest.mark.parametrize("c", [case(1), case(2), case(4), case(2, cp_layout="contiguous"),
                               case(4, cp_layout="contiguous")], ids=lambda c: f"cp{c.cp}-{c.cp_layout}")
def test_exchange_matches_the_golden(c):
    assert layer.of_case(c) is collectives.SCOPE
    assert _judge(c, _group(c)) == []


def test_sources_name_their_block_and_row():
    src = collectives.source_rows(case(4), 3).float()
    rows = collectives.part_rows(case(4))
    assert src[:, 0].tolist() == [6.0] * rows + [7.0] * rows
    assert src[:rows, 1].tolist() == list(map(float, range(rows)))


@pytest.mark.parametrize("layout, output", [("zigzag", "logical_tails_out"), ("contiguous", "gathered_kv")])
def test_wrong_order_on_one_rank_fails_there(layout, output):
    c = case(2, cp_layout=layout)

    def swap(rank, out):
        return {output: out[output].flip(0)} if rank == 1 else out

    assert _judge(c, _group(c, swap)) == [(1, output)]


@pytest.mark.parametrize("c, source", [(case(2), "local_kv_tail"),
                                       (PrefillCase("hca", TINY, 2, 7, scope="collectives"), "local_hidden_tail")],
                         ids=["swa", "hca"])
def test_golden_refuses_other_sources(c, source):
    scope = registry.of_case(c)
    tensors = scope.rank_inputs(c, 0)
    tensors[source] = tensors[source] + 1
    with pytest.raises(ValueError, match="closed-form sources"):
        scope.golden(c, tensors)


def test_other_scopes_refused():
    with pytest.raises(ConfigError, match="scope=full or collectives"):
        PrefillCase("swa", TINY, 2, 7, scope="output").validate()
