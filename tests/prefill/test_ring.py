"""The raw-KV ring is the model's (`prefill_ori_block_num` pages of PREFILL_BLOCK_ROWS): the
fixture's cache, the declared tensors and every ring row the tables and the golden compute
follow it, so a ring smaller than history + prompt wraps, and both layouts still PASS."""

from __future__ import annotations

import pytest

from layers.contract.config import TINY
from layers.prefill import fixture, layer, swa
from layers.prefill.case import PREFILL_BLOCK_ROWS, PrefillCase
from tests.prefill.group import run_group
from tests.prefill.judge import failures

ONE_PAGE = TINY.replace(prefill_ori_block_num=1)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_one_page_ring_wraps_and_passes(layout):
    case = PrefillCase("swa", ONE_PAGE, 2, 7, cp_layout=layout, prefix=300, segment_lens=(128, 60, 200, 128))
    case.validate()
    assert case.prefix + case.total > case.cache_rows == PREFILL_BLOCK_ROWS
    inputs = [fixture.rank_inputs(case, r) for r in range(case.cp)]
    assert inputs[0]["kv_cache"].shape == layer.of_case(case).tensor_specs(case)["kv_cache"].shape
    assert inputs[0]["kv_cache"].shape[:2] == (1, PREFILL_BLOCK_ROWS)
    expected = layer.golden(case, range(case.cp), fixture.whole_prompt(case), inputs[0])
    assert failures(swa.default_checks(), run_group(case, inputs), expected) == []
