"""The o-projection's K order against the reduced-dims reference snapshot the project is held to.

`layers/components/o_proj.py` sums wo_a's K in blocks of 128 because that is the order of the
reference's einsum where its `small` snapshots were made: with it the SWA golden reproduces
`x_out` of `swa-tp2-64` bit for bit, and with the one-pass order of the shipped `mini` snapshots'
machine (tests/one_pass_o_proj.py) it does not. The witness checked here is one request per rank
of that snapshot, cut from it unchanged by `scripts/o_proj_witness.py` (tests/data/reference/README.md).
"""

from __future__ import annotations

import torch

from layers.contract.config import SMALL
from layers.swa import layer as swa

from ..conftest import REFERENCE_DATA
from ..one_pass_o_proj import use_one_pass_projection

WITNESS = REFERENCE_DATA / "swa-tp2-64-witness.pt"


def _x_out_bitwise() -> list[bool]:
    w = torch.load(WITNESS, weights_only=True)
    inp, out, per_rank = w["in"], w["out"], w["per_rank"]
    wo_a = inp["wo_a"].reshape(-1, *inp["wo_a"].shape[2:])
    wo_b = inp["wo_b"].permute(1, 0, 2).reshape(inp["wo_b"].shape[1], -1)
    same = []
    for r in range(inp["wo_a"].shape[0]):
        tensors = {n: (x[r] if n in per_rank else x).clone() for n, x in inp.items() if x.dim() > 0}
        tensors.update(wo_a=wo_a, wo_b=wo_b)
        got = swa.golden_decode_swa_tp1(SMALL, tensors)
        assert torch.equal(got["kv_cache"], out["kv_cache"][r]), f"rank {r} kv_cache"
        same.append(torch.equal(got["x_out"], out["x_out"][r]))
    return same


def test_blocks_of_128_reproduce_the_small_snapshots_x_out_bitwise(two_threads):
    assert _x_out_bitwise() == [True, True]


def test_the_one_pass_order_does_not(two_threads, monkeypatch):
    use_one_pass_projection(monkeypatch)
    assert _x_out_bitwise() == [False, False]
