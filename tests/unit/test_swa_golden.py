"""The SWA golden against the reference snapshot, and the layer's fixture and validation.

The snapshot test replays validation.md §5.3: every rank's slice of `in/`, with the full O
weights reassembled from the stacked shards, through `golden_decode_swa_tp1`, must give the
rank's slice of `out/` bit for bit (swa.md §5.7: a from-spec golden does, on CPU with two
threads).
"""

from __future__ import annotations


import pytest
import torch

from layers.registry import validated
from layers.swa import layer as swa
from layers.components.kv_cache import write_rows
from layers.contract.case import Case
from layers.contract.config import MINI, TINY, ConfigError
from layers.contract.context import RankContext
from layers.contract.tensors import Kind
from layers.swa import fixture as swa_fixture
from layers.tp import TorchTP

from .. import defects

from ..conftest import reference_snapshot
from ..one_pass_o_proj import use_one_pass_projection



def _load(folder):
    return {p.stem: torch.load(p, weights_only=True) for p in sorted(folder.glob("*.pt"))}


@pytest.mark.parametrize("one_pass", [False, True], ids=["golden", "one_pass_o_proj"])
def test_golden_reproduces_the_reference_snapshot(two_threads, monkeypatch, one_pass):
    """kv_cache bitwise; x_out a rounding off on a few tokens, and bitwise with the snapshot's
    one-pass o-projection swapped in (tests/one_pass_o_proj.py)."""
    if one_pass:
        use_one_pass_projection(monkeypatch)
    root = reference_snapshot("swa")
    inp, out = _load(root / "in"), _load(root / "out")
    p = inp["wo_a"].shape[0]
    case = Case("swa", MINI, p, int(inp["local_t"]), 0)
    assert set(inp) == set(swa.LAYER.names_of(case, Kind.INPUT) + swa.LAYER.names_of(case, Kind.INOUT))
    assert set(out) == set(swa.LAYER.compared_names(case))
    # §5.3: full wo_a = the shards in rank-major group order; full wo_b = the column blocks.
    wo_a = inp["wo_a"].reshape(-1, *inp["wo_a"].shape[2:])
    wo_b = inp["wo_b"].permute(1, 0, 2).reshape(inp["wo_b"].shape[1], -1)
    for r in range(p):
        tensors = {n: x[r].clone() for n, x in inp.items() if x.dim() > 0}
        tensors.update(wo_a=wo_a, wo_b=wo_b, wo_b_scale=inp["wo_b_scale"][0])
        got = swa.golden_decode_swa_tp1(MINI, tensors)
        diff = (got["x_out"] - out["x_out"][r]).abs().max().item()
        assert torch.equal(got["kv_cache"], out["kv_cache"][r]), f"rank {r} kv_cache"
        # A slip in the layer's own math moves x_out by far more than the projection's K order.
        assert diff == 0 if one_pass else diff < 1e-4, f"rank {r} x_out: max |diff| {diff:.3g}"


def test_rope_rows_follow_each_ranks_own_positions():
    # P11: a rank's RoPE rows are computed at its own positions, not copied from rank 0.
    m = TINY
    case = Case("swa", m, 2, 8, 0, start_pos=(100, 5000))
    r0, r1 = swa.LAYER.rank_inputs(case, 0), swa.LAYER.rank_inputs(case, 1)
    assert r0["position_ids"].tolist() == list(range(100, 108))
    assert r1["position_ids"].tolist() == list(range(5000, 5008))
    inv = 1.0 / (m.rope_theta ** (torch.arange(0, m.qk_rope_head_dim, 2, dtype=torch.float32) / m.qk_rope_head_dim))
    ang = torch.arange(5000, 5008, dtype=torch.float32)[:, None] * inv[None, :]
    assert torch.equal(r1["freqs_cos"], torch.cat((ang.cos(), ang.cos()), dim=-1).to(torch.bfloat16))
    assert torch.equal(r1["freqs_sin"], torch.cat((ang.sin(), ang.sin()), dim=-1).to(torch.bfloat16))


def test_canonical_metadata_and_window():
    m = TINY
    case = Case("swa", m, 1, 24, 0)  # three requests: starts 8192, 127, 31
    x = swa.LAYER.rank_inputs(case, 0)
    pos = x["position_ids"].tolist()
    assert pos[0::8] == [8192, 127, 31]
    bs, nb, win = m.block_size, m.kv_ori_block_num, m.sliding_window
    for t, p in enumerate(pos):
        b = t // case.seq
        row = lambda q: (((q // bs) % nb) * case.batch + b) % nb * bs + q % bs  # noqa: E731
        assert int(x["swa_slot_mapping"][t]) == row(p)
        n = min(p + 1, win)
        assert int(x["swa_lens"][t]) == n
        want = [row(q) for q in range(p - n + 1, p + 1)] + [-1] * (win - n)
        assert x["swa_indices"][t].tolist() == want


def test_cache_insert_touches_only_mapped_rows_and_keeps_the_last_write():
    pool = torch.arange(6 * 2 * 1 * 3, dtype=torch.float32).reshape(6, 2, 1, 3).to(torch.bfloat16)
    before = pool.clone()
    kv = -torch.arange(1, 5, dtype=torch.float32)[:, None].repeat(1, 3).to(torch.bfloat16)
    write_rows(pool, torch.tensor([3, -1, 7, 3]), kv)
    flat, flat0 = pool.reshape(-1, 3), before.reshape(-1, 3)
    assert torch.equal(flat[3], kv[3]) and torch.equal(flat[7], kv[2])
    untouched = [i for i in range(12) if i not in (3, 7)]
    assert torch.equal(flat[untouched], flat0[untouched])


def test_a_replaced_stage_runs_in_the_implementation_only():
    # The golden runs the layer's own stages; an implementation's replaced stage never reaches it.
    case = Case("swa", TINY, 1, 8, 2)
    inputs = swa.LAYER.rank_inputs(case, 0)
    ctx = RankContext(case, 0, torch.device("cpu"))
    broken = defects.SkipCacheWrite()(ctx, {n: x.clone() for n, x in inputs.items()})
    assert torch.equal(broken["kv_cache"], inputs["kv_cache"])  # the replaced insert ran
    golden = swa.golden_decode_swa_tp1(TINY, {n: x.clone() for n, x in inputs.items()})
    assert not torch.equal(golden["kv_cache"], inputs["kv_cache"])
    assert torch.equal(TorchTP()(ctx, {n: x.clone() for n, x in inputs.items()})["kv_cache"], golden["kv_cache"])


def test_checks_in_validation_order():
    pool, x_out = swa.LAYER.checks(Case("swa", TINY, 2, 16, 0))
    assert (pool.output, pool.mapping, pool.block_size, pool.atol, pool.rtol, pool.max_error_ratio) == (
        "kv_cache", "swa_slot_mapping", 32, 1e-4, 1 / 128, 0.005,
    )  # fmt: skip
    assert (x_out.output, x_out.diff_thd, x_out.pct_thd, x_out.max_diff_hd) == ("x_out", 3e-3, 0.008, 1)


@pytest.mark.parametrize(
    "case, message",
    [
        (Case("swa", TINY, 1, 8, 0, start_pos=TINY.long_context_max_seq_len - 7), "context ceiling"),
        (Case("swa", TINY, 2, 16, 0, start_pos=(1, 2, 3)), "start_pos has 3 entries"),
        # batch 3 does not divide the 512-page pool: request 0's page 171 is request 1's page 0.
        (Case("swa", TINY, 1, 24, 0, start_pos=(171 * 32, 0, 100)), "write kv_cache row"),
        (Case("swa", TINY, 3, 16, 0), "tp=3"),
    ],
)
def test_validate_rejects(case, message):
    with pytest.raises(ConfigError, match=message):
        validated(case)


def test_validate_accepts_the_ceiling_and_the_canonical_sets():
    validated(Case("swa", TINY, 1, 8, 0, start_pos=TINY.long_context_max_seq_len - 8))
    for p in (1, 2, 4):
        validated(Case("swa", TINY, p, TINY.decode_tokens // p, 0))


def test_validate_rejects_an_unmapped_row_inside_a_window(monkeypatch):
    real = swa_fixture.metadata.block_table

    def holey(batch, table_blocks, physical_blocks=None, permuted=False):
        table = real(batch, table_blocks, physical_blocks, permuted)
        table[:, 0] = -1
        return table

    monkeypatch.setattr(swa_fixture.metadata, "block_table", holey)
    with pytest.raises(ConfigError, match="unmapped row inside its window"):
        validated(Case("swa", TINY, 1, 8, 0, start_pos=40))
