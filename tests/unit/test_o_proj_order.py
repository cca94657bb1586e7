"""The o-projection's K order against the reduced-dims reference snapshots the project is held to.

`layers/components/o_proj.py` sums wo_a's K in blocks of 128 because that is the order of the
reference's einsum where its `small` snapshots were made: with it the SWA golden reproduces
`x_out` of `swa-tp2-64` bit for bit, and with the one-pass order of the shipped `mini` snapshots'
machine (tests/one_pass_o_proj.py) it does not. The snapshot is 23 MB and lives beside the
checkout (`../shared/peer`), not in it: where it is absent this test skips, saying so; the
shipped snapshots (tests/data/reference) cover the rest of the layer bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from layers.contract.config import SMALL
from layers.swa import layer as swa

from ..conftest import REPO
from ..one_pass_o_proj import use_one_pass_projection

SNAPSHOT = REPO.parent / "shared" / "peer" / "swa-tp2-64"


def _x_out_bitwise() -> list[bool]:
    if not SNAPSHOT.is_dir():
        pytest.skip(f"reference snapshot {SNAPSHOT} is absent (23 MB, kept beside the checkout)")
    inp, out = ({p.stem: torch.load(p, weights_only=True) for p in sorted((SNAPSHOT / k).glob("*.pt"))}
                for k in ("in", "out"))
    wo_a = inp["wo_a"].reshape(-1, *inp["wo_a"].shape[2:])
    wo_b = inp["wo_b"].permute(1, 0, 2).reshape(inp["wo_b"].shape[1], -1)
    same = []
    for r in range(inp["wo_a"].shape[0]):
        tensors = {n: x[r].clone() for n, x in inp.items() if x.dim() > 0}
        tensors.update(wo_a=wo_a, wo_b=wo_b, wo_b_scale=inp["wo_b_scale"][0])
        got = swa.golden_decode_swa_tp1(SMALL, tensors)
        assert torch.equal(got["kv_cache"], out["kv_cache"][r]), f"rank {r} kv_cache"
        same.append(torch.equal(got["x_out"], out["x_out"][r]))
    return same


def test_blocks_of_128_reproduce_the_small_snapshots_x_out_bitwise(two_threads):
    assert _x_out_bitwise() == [True, True]


def test_the_one_pass_order_does_not(two_threads, monkeypatch):
    use_one_pass_projection(monkeypatch)
    assert not all(_x_out_bitwise())
