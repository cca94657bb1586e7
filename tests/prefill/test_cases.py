"""CP prefill cases at tiny dims against the independent golden: the canonical case, those the
reference never runs (history, uneven and short segments, cp 1/4/8, contiguous layout), the
defects that must FAIL naming tensor and rank, and the early refusal of bad cases."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from layers.contract.config import TINY, ConfigError
from layers.contract.stage import Stage
from layers.prefill import fixture, gathered, layer, swa, tables
from layers.prefill.case import PrefillCase
from tests.prefill.group import run_group
from tests.prefill.judge import failures


@functools.cache
def _weights(seed: int) -> dict:
    return fixture.weights(PrefillCase("swa", TINY, 1, seed))


def _inputs(case: PrefillCase) -> list[dict]:
    w = _weights(case.seed)
    return [fixture.rank_inputs(case, r, w) for r in range(case.cp)]


def _expected(case: PrefillCase, inputs: list[dict]) -> list[dict]:
    prompt = fixture.whole_prompt(case)
    return layer.golden(case, range(case.cp), prompt, inputs[0])


def _run(case: PrefillCase, stages=None) -> list[tuple[int, str]]:
    case.validate()
    inputs = _inputs(case)
    expected = _expected(case, inputs)
    return failures(swa.default_checks(), run_group(case, inputs, stages), expected)


def case(cp=2, **kw) -> PrefillCase:
    return PrefillCase("swa", TINY, cp, 7, **kw)


@pytest.mark.parametrize("c", [
    case(1), case(2), case(4), case(2, cp_layout="contiguous"), case(4, cp_layout="contiguous"),
    case(2, prefix=300),  # the window reaches into history rows
    case(2, segment_lens=(200, 77, 256, 130)),  # uneven: tails straddle tiles
    case(2, segment_lens=(128, 40, 30, 128)),  # short segments: keys from two predecessors back
    case(2, cp_layout="contiguous", prefix=300, segment_lens=(40, 30, 20, 200)),  # gathered keys of three segments
], ids=lambda c: f"cp{c.cp}-{c.cp_layout}-p{c.prefix}-{'x'.join(map(str, c.lengths))}")
def test_case_passes(c):
    assert _run(c) == []


def test_golden_is_layout_independent():
    """Both layouts cut the same prompt: the golden's rows of one segment agree."""
    z, k = case(2), case(2, cp_layout="contiguous")
    gz, gk = _expected(z, _inputs(z)), _expected(k, _inputs(k))
    # segment 1: zigzag rank 1 part 0, contiguous rank 0 part 1
    w, tiles = z.window, 2
    assert torch.equal(gz[1]["x_out"][:w], gk[0]["x_out"][tiles * w: tiles * w + w])
    assert torch.equal(gz[0]["kv_cache"], gk[1]["kv_cache"])


def _replaced(name: str, run) -> tuple[Stage, ...]:
    return tuple(dataclasses.replace(s, run=run, reference=None if s.reference is None else run)
                 if s.name == name else s for s in swa.stages())


def _stage(name: str) -> Stage:
    return next(s for s in swa.stages() if s.name == name)


def test_missing_predecessor_tail_fails():
    """Rank 1 never receives rank 0's tails (zeros in their place)."""
    base = _stage("tail_exchange")

    def run(ctx, v):
        out = base.golden(ctx, v)["logical_tails_out"].clone()
        if ctx.rank == 1:
            out[(v["reverse_index"][0] // 2 if v["reverse_index"].dim() > 1 else v["reverse_index"] // 2) == 0] = 0
        return {"logical_tails_out": out}

    assert (1, "x_out") in _run(case(2), _replaced("tail_exchange", run))


def test_local_rope_positions_fail():
    """RoPE at the rank-local row index instead of the global position."""
    base = _stage("project")

    def run(ctx, v):
        local = dict(v, query_position_ids=torch.arange(v["query_position_ids"].numel(), dtype=torch.int32))
        return base.run(ctx, local)

    bad = _run(case(2), _replaced("project", run))
    assert (1, "x_out") in bad and (0, "kv_cache") in bad


def test_final_window_on_owner_only_fails():
    """Only the rank that owns the last segment commits the final window."""
    base = _stage("final_window_commit")
    last_owner = tables.owner(case(2), case(2).num_segments - 1)[0]

    def run(ctx, v):
        return base.run(ctx, v) if ctx.rank == last_owner else {"kv_cache": v["kv_cache"]}

    assert _run(case(2), _replaced("final_window_commit", run)) == [(1 - last_owner, "kv_cache")]


def test_dropped_keys_fail_on_short_segments_only():
    """The reference's tables: only the immediate predecessor's tail; keys further back dropped."""
    def run(ctx, v):
        return {"swa_key_rows": tables.key_rows(v["query_position_ids"], v["overlay_active_lengths"],
                                                v["predecessor_segments"], v["segment_starts_t"], ctx.case.window,
                                                ctx.case.cache_rows, predecessors="first")}

    stages = _replaced("key_table", run)
    assert _run(case(2), stages) == []
    short = case(2, segment_lens=(128, 40, 30, 128))  # segment 2's first rows reach into segment 0
    assert (1, "x_out") in _run(short, stages)


@pytest.mark.parametrize("kw, words", [
    (dict(cp=0), "cp=0"),
    (dict(cp_layout="striped"), "cp_layout"),
    (dict(prefix=-1), "prefix=-1"),
    (dict(segment_lens=(128, 128)), "2*cp = 4 segments"),
    (dict(segment_lens=(128, 0, 128, 128)), "every length"),
    (dict(segment_lens=(128, 257, 128, 128)), "every length"),
    (dict(prefix=16300), "RoPE table"),
])
def test_bad_case_refused_early(kw, words):
    c = dataclasses.replace(case(2), **kw)
    with pytest.raises(ConfigError, match=words):
        c.validate()


def test_beyond_reference_is_said():
    assert case(2).beyond_reference() == []
    notes = " ".join(case(2, prefix=8, segment_lens=(128, 40, 30, 128)).beyond_reference())
    assert "prefix=8" in notes and "drop the keys" in notes


def test_each_layout_walks_its_own_stage_list():
    """Zigzag exchanges tails; contiguous all-gathers every projected KV row (replicated KV)."""
    names = lambda c: [s.name for s in layer.of_case(c).stages(c.model)]  # noqa: E731
    assert "tail_exchange" in names(case(2)) and "kv_allgather" not in names(case(2))
    assert "kv_allgather" in names(case(2, cp_layout="contiguous"))
    assert "tail_exchange" not in names(case(2, cp_layout="contiguous"))


def _gathered_replaced(name: str, run) -> tuple[Stage, ...]:
    return tuple(dataclasses.replace(s, run=run, reference=None if s.reference is None else run)
                 if s.name == name else s for s in gathered.stages())


def test_allgather_in_ring_arrival_order_fails():
    """Each rank keeps the gathered blocks in ring arrival order (block i: rank (i + rank) mod cp)."""
    c = case(2, cp_layout="contiguous")
    base = next(s for s in gathered.stages() if s.name == "kv_allgather")

    def run(ctx, v):
        blocks = base.golden(ctx, v)["gathered_kv"].reshape(ctx.case.cp, -1, v["kv"].shape[-1])
        return {"gathered_kv": torch.roll(blocks, -ctx.rank, dims=0).reshape(-1, blocks.shape[-1])}

    assert _run(c, _gathered_replaced("kv_allgather", run)) == [(1, "kv_cache"), (1, "x_out")]


def test_gathered_commit_of_own_rows_only_fails():
    """Each rank commits only the final-window rows it projected itself: the window's other
    rows keep the history on that rank."""
    c = case(2, cp_layout="contiguous", segment_lens=(128, 128, 30, 40))  # the final window spans both ranks
    base = next(s for s in gathered.stages() if s.name == "final_window_commit")

    def run(ctx, v):
        own = torch.zeros_like(v["gathered_slot_mapping"]).reshape(ctx.case.cp, -1)
        own[ctx.rank] = 1
        slots = torch.where(own.reshape(-1) > 0, v["gathered_slot_mapping"], -1)
        return base.run(ctx, {**v, "gathered_slot_mapping": slots})

    assert _run(c, _gathered_replaced("final_window_commit", run)) == [(0, "kv_cache"), (1, "kv_cache")]
