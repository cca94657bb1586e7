"""The same config gives bit-identical fixtures and the same verdict, whatever the process order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ..conftest import REPO

_HASH_SLICES = """
import hashlib, json, sys
from layers.contract.case import Case
from layers.contract.config import TINY
from layers.registry import get_layer
layer, order = sys.argv[1], [int(r) for r in sys.argv[2].split(',')]
case = Case(layer, TINY, 4, 32, 11)
out = {}
for rank in order:
    h = hashlib.sha256()
    for name, t in sorted(get_layer(layer).rank_inputs(case, rank).items()):
        h.update(name.encode()); h.update(t.contiguous().view(-1).view(__import__('torch').uint8).numpy().tobytes())
    out[rank] = h.hexdigest()
print(json.dumps(out))
"""


@pytest.mark.slow  # a fresh interpreter per order
@pytest.mark.parametrize("layer", ["swa", "csa", "hca"])
def test_rank_slices_do_not_depend_on_the_order_ranks_are_built(layer):
    def hashes(order: str) -> dict:
        p = subprocess.run([sys.executable, "-c", _HASH_SLICES, layer, order], capture_output=True, text=True,
                           check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        return json.loads(p.stdout)

    forward, backward = hashes("0,1,2,3"), hashes("3,1,2,0")
    assert forward == backward
    assert len(set(forward.values())) == 4  # and the ranks really hold different slices


def _tensors(d):
    return {f"{sub}/{f}": torch.load(os.path.join(d, sub, f), weights_only=True)
            for sub in ("in", "out") for f in sorted(os.listdir(os.path.join(d, sub)))}


@pytest.mark.slow  # two runs on real ranks
def test_two_runs_started_differently_give_identical_fixtures_and_verdicts(tp_run, tmp_path):
    a = tp_run(layer="swa", tp=4, model="tiny", save_data=str(tmp_path / "a"), golden_cache=None)
    b = tp_run(layer="swa", tp=4, model="tiny", save_data=str(tmp_path / "b"), golden_cache=None, start_method="spawn")
    assert a.passed and b.passed, (a, b)
    ta, tb = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert ta.keys() == tb.keys()
    for name in ta:
        x, y = ta[name], tb[name]
        assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                                                  y.view(torch.uint8) if y.dtype == torch.bfloat16 else y), name
    strip = lambda r: [(v["tensor"], v["passed"], v["figures"]["n_bad"], v["figures"]["max_abs_diff"]) for v in r.result["verdicts"]]  # noqa: E731
    assert strip(a) == strip(b)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("scope", ["full", "tp1"])
@pytest.mark.parametrize("layer", ["swa", "csa", "hca"])
def test_o_weights_drawn_once_are_the_streamed_shard_and_full_weights(layer, scope):
    """The golden-computing rank's fixture (one draw of the O weights, the shard sliced from
    the full ones) is bit for bit the streamed shard plus the separately built full weights."""
    from layers.contract.case import Case
    from layers.contract.config import TINY
    from layers.registry import get_scope

    lay = get_scope(layer, scope)
    case = Case(layer, TINY, 4, 32, 11)
    inputs, (wo_a, wo_b) = lay.rank_inputs_and_full_o(case, 2)
    streamed = lay.rank_inputs(case, 2)
    assert list(inputs) == list(streamed)
    assert all(_same_bits(inputs[n], streamed[n]) for n in streamed), [n for n in streamed if not _same_bits(inputs[n], streamed[n])]
    full_a, full_b = lay.full_o_weights(case)
    assert _same_bits(wo_a, full_a) and _same_bits(wo_b, full_b)
    lg, ol = case.local_o_groups, TINY.o_lora_rank
    if scope == "full":  # the shard is the rank's own groups of the full weights, not another rank's
        assert _same_bits(inputs["wo_a"], full_a[2 * lg : 3 * lg]) and not _same_bits(inputs["wo_a"], full_a[lg : 2 * lg])
        assert _same_bits(inputs["wo_b"], full_b[:, 2 * lg * ol : 3 * lg * ol].contiguous())


class _ThreadGather:
    """A group exchange among threads standing for a group's ranks: each `all_gather` returns
    every rank's tensor of that call stacked [P, ...] (`keep_own`: a wrong exchange, only the
    rank's own), each `broadcast` the source's."""

    def __init__(self, world: int, keep_own: bool = False):
        import threading

        self.world, self.keep_own = world, keep_own
        self.barrier, self.sent = threading.Barrier(world), {}

    def for_rank(self, rank: int):
        calls = iter(range(1 << 30))

        def all_gather(t: torch.Tensor) -> torch.Tensor:
            call = next(calls)
            self.sent[call, rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack([self.sent[call, rank if self.keep_own else r] for r in range(self.world)])
            self.barrier.wait()
            return stacked

        def broadcast(t, shape, dtype, src: int) -> torch.Tensor:
            return all_gather(torch.empty(shape, dtype=dtype) if t is None else t)[src].clone()

        from layers.fixtures.draw import GroupExchange

        return GroupExchange(rank, self.world, all_gather, broadcast)


def _by_the_group(lay, case, gather: _ThreadGather) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from layers.fixtures.kept import forget_kept_weights

    forget_kept_weights()
    with ThreadPoolExecutor(case.tp) as pool:
        made = [pool.submit(lay.rank_inputs_and_full_o_by_the_group, case, gather.for_rank(r)) for r in range(case.tp)]
        made = {r: m.result() for r, m in enumerate(made)}
    forget_kept_weights()
    return made


@pytest.mark.parametrize("layer", ["swa", "csa", "hca"])
def test_weights_drawn_a_share_per_rank_and_exchanged_are_the_single_draws_bits(layer):
    """Each rank drawing its own O-weight groups and a share of the replicated weights, the
    group exchanging them, gives every rank the bits one rank drawing them all gives; an
    exchange that hands a rank only its own (a wrong exchange) does not."""
    from layers.contract.case import Case
    from layers.contract.config import TINY
    from layers.registry import get_scope

    lay = get_scope(layer, "full")
    case = Case(layer, TINY, 4, 32, 11)
    made = _by_the_group(lay, case, _ThreadGather(case.tp))
    for rank, (inputs, (wo_a, wo_b)) in made.items():
        single, (full_a, full_b) = lay.rank_inputs_and_full_o(case, rank)
        assert list(inputs) == list(single)
        assert [n for n in single if not _same_bits(inputs[n], single[n])] == []
        assert _same_bits(wo_a, full_a) and _same_bits(wo_b, full_b)
    wrong = _by_the_group(lay, case, _ThreadGather(case.tp, keep_own=True))
    single, _ = lay.rank_inputs_and_full_o(case, 1)
    assert not _same_bits(wrong[1][0]["wo_b_scale"], single["wo_b_scale"])
    assert not all(_same_bits(w["wq_a"], single["wq_a"]) for w, _ in wrong.values())  # the ranks that did not draw it
