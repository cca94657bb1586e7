"""The focused scopes (layers.attention.scopes) and their stage-level comparators (launcher.verify.exact).

Every scope runs the worker's per-rank flow on real gloo ranks (tests.rank_harness) at tiny
dims for tp 1, 2, 4 and 8, below capacity so that the poisoned and sentinel rows exist. The
fixtures are checked against the spec's own formulation (flat `arange % m` over the rank-
stacked tensors, swa.md §9.2; the closed forms of §9.1 / §9.4), the goldens against loop
re-statements written here, and each check must fail on an implementation that sends, reads
or writes outside the valid rows.
"""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch

from hydra import compose, initialize_config_module

from launcher.config.spec import validated_spec
from launcher.store import snapshot
from launcher.verify import build_comparator
from layers.distributed import collectives
from layers.components import o_proj as output_half
from layers.contract.tensors import Kind
from layers.contract.case import Case
from layers.contract.checks import AllcloseCheck, ExactCheck, PrefixTailCheck
from layers.contract.config import TINY, ConfigError
from layers.components.numerics import bf16
from layers.registry import get_layer, get_scope, validated
from launcher.verify.exact import PrefixAndTail, SentinelExact

from ..rank_harness import run_scope

SCOPES = ("output", "collectives", "tp1")


def _below_capacity(tp_size: int) -> Case:
    cap = TINY.decode_tokens // tp_size
    return Case("swa", TINY, tp_size, cap - 8 if cap > 8 else cap, 5)


def _passed(verdicts: dict) -> bool:
    return all(v["passed"] for v in verdicts.values())


# -- every scope on real ranks ----------------------------------------------------------------
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("scope", SCOPES)
def test_scope_passes_at_every_tp(scope, tp_size):
    case = _below_capacity(tp_size)
    verdicts = run_scope(case, scope)
    assert list(verdicts) == list(get_scope("swa", scope).compared_names(case))
    assert _passed(verdicts), verdicts
    for v in verdicts.values():
        assert len(v["per_rank"]) == tp_size
    if scope == "collectives":
        for v in verdicts.values():
            f = v["figures"]
            assert f["max_abs_diff"] == 0 and f["touched_padding_rows"] == 0 and f["poison_values"] == 0
            assert f["padding_rows"] > 0  # the sentinel rows exist, so the check is not vacuous
    if scope == "output":
        assert verdicts["o_local"]["figures"]["tail_rows"] == case.local_t_pad - case.local_t > 0
    if scope == "tp1":  # the project's TP1 layer is the golden's own code: bitwise
        assert all(v["figures"]["max_abs_diff"] == 0 for v in verdicts.values())


@pytest.mark.parametrize("scope", SCOPES)
def test_scope_passes_at_capacity(scope):
    assert _passed(run_scope(Case("swa", TINY, 2, TINY.decode_tokens // 2, 5), scope))


@pytest.mark.parametrize("layer", ["csa", "hca"])
def test_scopes_of_the_other_layers(layer):
    case = dataclasses.replace(_below_capacity(2), layer=layer)
    for scope in ("output", "collectives"):
        assert get_scope(layer, scope).name == layer
        assert _passed(run_scope(case, scope))
    validated(case)
    assert _passed(run_scope(case, "tp1"))


# -- fixtures against the spec's stacked formulation ------------------------------------------
def _stacked_collectives(case: Case) -> dict[str, torch.Tensor]:
    """swa.md §9.2 as written: flat arange % m over the [P, ...] tensors, then the poison."""
    m, p, t = case.model, case.tp, case.local_t
    cap, pad, d, g, gi = case.capacity, case.local_t_pad, m.hidden_size, m.o_groups, m.group_in
    kv = (torch.arange(p * cap * d) % 251).float().reshape(p, cap, d)
    kv[:, t:] = -1000.0
    a = (torch.arange(p * g * pad * gi) % 127).float().reshape(p, g, pad, gi)
    a[:, :, t:] = -2000.0
    part = (torch.arange(p * p * pad * d) % 17).float().reshape(p, p * pad, d)
    part[:, p * t :] = -3000.0
    return {"kv_local": bf16(kv), "attention_grouped": bf16(a.reshape(p, g * pad, gi)), "o_partial": part}


def _naive_collectives_golden(case: Case, stacked: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    m, p, t = case.model, case.tp, case.local_t
    pad, d, g, gi, lg = case.local_t_pad, m.hidden_size, m.o_groups, m.group_in, case.local_o_groups
    a = stacked["attention_grouped"].reshape(p, g, pad, gi)
    out = []
    for r in range(p):
        kv_group = torch.full((p * case.capacity, d), -7.0, dtype=torch.bfloat16)
        alg = torch.full((lg * p * pad, gi), -7.0, dtype=torch.bfloat16)
        o_local = torch.full((pad, d), -7.0, dtype=torch.bfloat16)
        for s in range(p):
            for i in range(t):
                kv_group[s * t + i] = stacked["kv_local"][s, i]
                for j in range(lg):
                    alg[j * p * pad + s * t + i] = a[s, r * lg + j, i]
        for i in range(t):
            acc = torch.zeros(d)
            for s in range(p):
                acc = acc + stacked["o_partial"][s, r * t + i]
            o_local[i] = bf16(acc)
        out.append({"kv_group": kv_group, "attention_local_groups": alg, "o_local": o_local})
    return out


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_collectives_fixture_and_golden_follow_the_spec(tp_size):
    case = _below_capacity(tp_size)
    layer = get_scope("swa", "collectives")
    stacked = _stacked_collectives(case)
    want = _naive_collectives_golden(case, stacked)
    for r in range(tp_size):
        inputs = layer.rank_inputs(case, r)
        for name in stacked:
            assert torch.equal(inputs[name], stacked[name][r]), name
        assert int(inputs["tp_rank"][0]) == r and int(inputs["local_t"]) == case.local_t
        for name in layer.compared_names(case):
            assert (inputs[name] == -7.0).all(), name
        got = layer.golden(case, {n: x.clone() for n, x in inputs.items()})
        for name, expected in want[r].items():
            assert torch.equal(got[name], expected), (r, name)


def test_collectives_golden_refuses_foreign_inputs():
    case = _below_capacity(2)
    layer = get_scope("swa", "collectives")
    inputs = layer.rank_inputs(case, 1)
    inputs["kv_local"][0, 0] += 1
    with pytest.raises(ValueError, match="§9.2"):
        layer.golden(case, inputs)


def _naive_o_proj(x, wo_a, wo_b, wo_b_scale):
    """swa.md §5.4 with the reference's own ops: fp32 einsum, per (group, token) quant, int32 GEMMs."""
    lg, u, _ = x.shape
    d, ol = wo_b.shape[0], wo_a.shape[1]
    y = torch.einsum("gui,gri->gur", x.float(), wo_a.float())
    amax = y.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    sq = 127.0 / amax
    q = torch.round(y * sq).to(torch.int32).to(torch.float16).to(torch.int8)
    out = torch.zeros(u, d)
    for g in range(lg):
        i_g = (q[g].to(torch.int32) @ wo_b[:, g * ol : (g + 1) * ol].to(torch.int32).T).float()
        out = out + i_g * (1.0 / sq[g])
    return out * wo_b_scale[None, :]


def test_output_fixture_poison_and_projection_golden():
    case = _below_capacity(2)
    m, t = case.model, case.local_t
    layer = get_scope("swa", "output")
    inputs = layer.rank_inputs(case, 1)
    pages = math.ceil(m.sliding_window / m.block_size)
    cache = inputs["kv_cache"].float()
    assert torch.isnan(cache[pages:]).all() and not torch.isnan(cache[:pages]).any()
    group_t = case.tp * t
    x = inputs["proj_attention_local_groups"]
    assert torch.isnan(x[:, group_t:].float()).all() and not torch.isnan(x[:, :group_t].float()).any()
    assert (x[:, :group_t, 0] == 127).all()
    assert (inputs["o_local"] == -7.0).all() and (inputs["o_partial"] == 0).all()
    # §9.1's banded wo_a: (lg+1)·coef[kb] at [lg, r, r + kb·OL], for the blocks that fit GI.
    wo_a = inputs["proj_wo_a"].float()
    ol = m.o_lora_rank
    for lgi in range(case.local_o_groups):
        for kb, c in enumerate((0.5, -0.25, 0.125, -0.0625)[: m.group_in // ol]):
            for r in range(ol):
                assert wo_a[lgi, r, r + kb * ol] == (lgi + 1) * c
    assert int((wo_a != 0).sum()) == case.local_o_groups * ol * (m.group_in // ol)
    got = layer.golden(case, {**{n: v.clone() for n, v in inputs.items()},
                                    **dict(zip(("wo_a", "wo_b"), layer.full_o_weights(case)))})
    want = _naive_o_proj(x[:, :group_t], inputs["proj_wo_a"], inputs["proj_wo_b"], inputs["wo_b_scale"])
    assert torch.equal(got["o_partial"][:group_t], want)
    assert (got["o_partial"][group_t:] == 0).all()


def test_output_golden_closed_form():
    """swa.md §9.4: all WIN keys equal, so head h's dim 0 is WIN·0.25 / (WIN + exp(sink − q0·0.25·scale))."""
    case = _below_capacity(2)
    m, t = case.model, case.local_t
    layer = get_scope("swa", "output")
    wo_a_full, wo_b_full = layer.full_o_weights(case)
    hpg, ol, hd = m.heads_per_group, m.o_lora_rank, m.head_dim
    for r in range(case.tp):
        inputs = layer.rank_inputs(case, r)
        golden_in = {**{n: v.clone() for n, v in inputs.items()}, "wo_a": wo_a_full, "wo_b": wo_b_full}
        got = layer.golden(case, golden_in)
        head0 = torch.zeros(t, m.num_attention_heads)
        for i in range(t):
            for h in range(m.num_attention_heads):
                q0 = float(bf16(torch.tensor(r + 0.25 * i + 0.0625 * h)))
                sink = 4 + 0.125 * (h % hpg)
                score = q0 * 0.25 * m.softmax_scale
                head0[i, h] = m.sliding_window * 0.25 / (m.sliding_window + math.exp(sink - score))
        expect = torch.zeros(t, m.hidden_size, dtype=torch.float64)
        for g in range(m.o_groups):
            rank_of, lgi = divmod(g, case.local_o_groups)
            y = torch.zeros(t, ol)
            for j in range(hpg):
                y[:, j] = bf16(head0[:, g * hpg + j]).float() * (0.125 * (rank_of + 1) * (lgi + 1) * (j + 1))
                assert wo_a_full[g, j, j * hd] == 0.125 * (rank_of + 1) * (lgi + 1) * (j + 1)
            sq = 127.0 / y.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
            expect += (torch.round(y * sq).double() @ wo_b_full[:, g * ol : (g + 1) * ol].double().T) / sq.double()
        expect *= ((torch.arange(m.hidden_size) % 4) * 0.25 + 0.5).double()
        torch.testing.assert_close(got["o_local"][:t].double(), expect, rtol=1 / 128, atol=1e-4)
        assert (got["o_local"][t:] == -7.0).all()


# -- implementations that send, read or write outside the valid rows --------------------------
def _writes_padding_row(ctx, tensors):
    """Rank 1's reduce-scatter writes one row past local_t."""
    out = get_scope("swa", "collectives").forward(ctx, tensors)
    if ctx.rank == 1:
        out["o_local"][ctx.case.local_t] = 0.0
    return out


def _gathers_capacity_rows(ctx, tensors):
    """The kv all-gather sends every capacity row (padded stride, poison included)."""
    out = get_scope("swa", "collectives").forward(ctx, tensors)
    whole = collectives.kv_all_gather(ctx, tensors["kv_local"])  # [P·LOCAL_T, D]
    out["kv_group"].copy_(whole)
    return out


def _padded_stride_all_to_all(ctx, tensors):
    """The group all-to-all sends LOCAL_T_PAD rows per group and lands them at s·LOCAL_T_PAD (P9)."""
    out = get_scope("swa", "collectives").forward(ctx, tensors)
    m, pad = ctx.model, ctx.case.local_t_pad
    whole = collectives.group_all_to_all(ctx, tensors["attention_grouped"].view(m.o_groups, pad, m.group_in))
    out["attention_local_groups"].copy_(whole.reshape(-1, m.group_in))
    return out


@pytest.mark.parametrize(
    "impl, tensor, figure",
    [
        (_writes_padding_row, "o_local", "touched_padding_rows"),
        (_gathers_capacity_rows, "kv_group", "poison_values"),
        (_padded_stride_all_to_all, "attention_local_groups", "poison_values"),
    ],
)
def test_collectives_defects_fail(impl, tensor, figure):
    case = _below_capacity(2)
    verdicts = run_scope(case, "collectives", impl)
    v = verdicts[tensor]
    assert not v["passed"] and v["figures"][figure] > 0, v
    others = [n for n in verdicts if n != tensor]
    assert all(verdicts[n]["passed"] for n in others)
    if impl is _writes_padding_row:
        assert v["figures"]["touched_padding_by_rank"] == [0, 1]
        assert "padding rows written" in v["detail"]
        assert {r["rank"] for r in v["per_rank"] if r["n_bad"]} == {1}


def _projection_reads_tail(ctx, tensors):
    """The sharded projection runs over the whole receive buffer, NaN tail included."""
    out = get_scope("swa", "output").forward(ctx, tensors)
    out["o_partial"].copy_(output_half.sharded_o_proj(
        tensors["proj_attention_local_groups"], tensors["proj_wo_a"], tensors["proj_wo_b"], tensors["wo_b_scale"]))
    return out


def _writes_o_local_tail(ctx, tensors):
    out = get_scope("swa", "output").forward(ctx, tensors)
    if ctx.rank == 0:
        out["o_local"][ctx.case.local_t :] = 0.0
    return out


def _reduce_scatter_without_sum(ctx, tensors):
    def own_rows(ctx, o_partial):
        t = o_partial.shape[0] // ctx.tp
        return bf16(o_partial[ctx.rank * t : (ctx.rank + 1) * t])

    with mock.patch("layers.distributed.collectives.reduce_scatter", own_rows):
        return get_scope("swa", "output").forward(ctx, tensors)


@pytest.mark.parametrize(
    "impl, tensor, kind",
    [
        (_projection_reads_tail, "o_partial", "zero_tail"),
        (_writes_o_local_tail, "o_local", "tail"),
        (_reduce_scatter_without_sum, "o_local", "budget"),
    ],
)
def test_output_defects_fail(impl, tensor, kind):
    verdicts = run_scope(_below_capacity(2), "output", impl)
    v = verdicts[tensor]
    assert not v["passed"] and v["kind"] == kind, v
    assert all(verdicts[n]["passed"] for n in verdicts if n != tensor)


# -- any local_t for the buffer-row scopes (the reference's default: capacity - 1) -------------
@pytest.mark.parametrize("scope, defect, tensor", [("output", _writes_o_local_tail, "o_local"),
                                                    ("collectives", _writes_padding_row, "o_local")])
def test_capacity_minus_one_passes_and_catches_a_defect(scope, defect, tensor):
    case = Case("swa", TINY, 2, TINY.decode_tokens // 2 - 1, 5)  # 63: neither a multiple of 8 nor of 16
    verdicts = run_scope(case, scope)
    assert _passed(verdicts), verdicts
    if scope == "collectives":
        assert all(v["figures"]["padding_rows"] > 0 and v["figures"]["poison_values"] == 0 for v in verdicts.values())
    else:
        assert verdicts["o_local"]["figures"]["tail_rows"] == case.local_t_pad - case.local_t == 1
    failing = run_scope(case, scope, defect)[tensor]
    assert not failing["passed"] and failing["kind"] in ("tail", "mismatch"), failing


@pytest.mark.parametrize("scope", ["output", "collectives"])
def test_buffer_row_scopes_take_any_local_t_and_default_to_capacity_minus_one(scope):
    cap = TINY.decode_tokens // 2
    for t in (1, 5, cap - 1, cap):
        validated(Case("swa", TINY, 2, t, 0, scope=scope))
    for t in (0, cap + 1):
        with pytest.raises(ConfigError, match=rf"local_t={t} must be in \[1, {cap}\]"):
            validated(Case("swa", TINY, 2, t, 0, scope=scope))
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=[f"scope={scope}", "model=tiny", "tp=2"])
    assert validated_spec(cfg, "/x").case.local_t == cap - 1
    with pytest.raises(ConfigError, match="must be a multiple of 8"):  # the layers still take whole requests
        validated(Case("swa", TINY, 2, cap - 1, 0, scope="tp1"))


# -- snapshots of every scope -----------------------------------------------------------------
@pytest.mark.parametrize("scope", SCOPES)
def test_snapshot_roundtrip_replays_the_golden(scope, tmp_path):
    case = _below_capacity(2)
    layer = get_scope("swa", scope)
    specs = layer.tensor_specs(case)
    compared = layer.compared_names(case)
    in_names = [n for n, s in specs.items() if s.kind is not Kind.OUTPUT]

    def golden(inputs):
        x = {n: v.clone() for n, v in inputs.items()}
        if layer.sharded_o_weights:
            x["wo_a"], x["wo_b"] = layer.full_o_weights(case)
        return {n: layer.golden(case, x)[n] for n in compared}

    ranks = [layer.rank_inputs(case, r) for r in range(case.tp)]
    outs = [golden(inputs) for inputs in ranks]
    stacked_in = {n: torch.stack([x[n] for x in ranks]) for n in in_names}
    stacked_out = {n: torch.stack([o[n] for o in outs]) for n in compared}
    snapshot.save(str(tmp_path), case, specs, stacked_in, stacked_out, None)
    snapshot.check(str(tmp_path), specs, case.tp)
    for r in range(case.tp):
        loaded = snapshot.load_rank(str(tmp_path), "in", in_names, r, specs)
        reference = snapshot.load_rank(str(tmp_path), "out", compared, r, specs)
        replayed = golden(loaded)
        for n in compared:
            assert torch.equal(replayed[n], reference[n]) and torch.equal(reference[n], outs[r][n]), (r, n)


# -- registry and validation ------------------------------------------------------------------
def test_get_scope():
    assert get_scope("swa") is get_layer("swa") and get_scope("swa", "full") is get_layer("swa")
    assert get_scope("swa", "output") is get_scope("swa", "output")
    assert get_scope("swa", "tp1").scope == "tp1"
    with pytest.raises(ConfigError, match="unknown scope 'half'"):
        get_scope("swa", "half")
    with pytest.raises(ConfigError, match="unknown layer"):
        get_scope("mla", "output")


def test_scope_validation_names_the_rule():
    layer = get_scope("swa", "output")
    with pytest.raises(ConfigError, match="o_lora_rank=1 must be >= heads_per_group=2"):
        layer.validate(Case("swa", TINY.replace(o_lora_rank=1), 2, 56, 0))
    with pytest.raises(ConfigError, match="tp=3"):
        validated(Case("swa", TINY, 3, 8, 0, scope="collectives"))
    with pytest.raises(TypeError, match="no O weights"):
        get_scope("swa", "collectives").full_o_weights(_below_capacity(2))


def test_tp1_specs_hold_the_full_o_weights():
    case = _below_capacity(4)
    specs = get_scope("swa", "tp1").tensor_specs(case)
    m = case.model
    assert specs["wo_a"].shape == (m.o_groups, m.o_lora_rank, m.group_in)
    assert specs["wo_b"].shape == (m.hidden_size, m.o_groups * m.o_lora_rank)
    inputs = get_scope("swa", "tp1").rank_inputs(case, 3)
    wo_a, wo_b = get_layer("swa").full_o_weights(case)
    assert torch.equal(inputs["wo_a"], wo_a) and torch.equal(inputs["wo_b"], wo_b)


# -- the stage-level comparators --------------------------------------------------------------
def test_sentinel_exact_counts_touched_rows_and_poison_per_rank():
    expected = torch.full((2, 4, 3), -7.0)
    expected[:, :2] = 1.0
    actual = expected.clone()
    actual[1, 3] = 5.0  # a padding row of rank 1
    actual[0, 0, 1] = -2000.0  # poison on rank 0, in a valid row
    cmp = build_comparator(ExactCheck("x", sentinel=-7.0, poison=(-2000.0,)), mapping_shape=(), leading_rank_axis=True)
    assert isinstance(cmp, SentinelExact) and cmp.__name__ == "exact"
    v = cmp.evaluate(actual, expected)
    assert not v.passed and v.kind == "mismatch"
    assert v.figures["touched_padding_by_rank"] == [0, 1]
    assert v.figures["first_touched_padding"] == [{"rank": 1, "row": 3}]
    assert v.figures["poison_by_rank"] == [1, 0] and v.figures["padding_rows"] == 4
    assert "padding rows written" in v.detail and "poison" in v.detail
    assert cmp.evaluate(expected.clone(), expected).passed


def test_prefix_and_tail():
    expected = torch.full((2, 6, 4), -7.0)
    expected[:, :4] = 1.0
    cmp = build_comparator(PrefixTailCheck("o_local", valid_rows=4), mapping_shape=(), leading_rank_axis=True)
    assert isinstance(cmp, PrefixAndTail) and cmp.__name__ == "hca_output_prefix_and_tail(local_t=4)"
    assert cmp.evaluate(expected.clone(), expected).passed
    tail = expected.clone()
    tail[1, 5, 0] = 0.0
    v = cmp.evaluate(tail, expected)
    assert not v.passed and v.kind == "tail" and v.figures["tail_mismatch_by_rank"] == [0, 1]
    assert "inactive token tail mismatch count=1" in v.detail
    prefix = expected.clone()
    prefix[0, 1, 2] = 1.5
    v = cmp.evaluate(prefix, expected)
    assert not v.passed and v.kind == "budget" and v.label == cmp.__name__
    strict = PrefixAndTail(4, max_error_ratio=0.0, rank_axis=True)
    assert strict.__name__ == "output_prefix_and_tail(local_t=4, max_error_ratio=0.0)"
    assert not strict.evaluate(prefix, expected).passed


def test_allclose_check_shifts_the_valid_axis_past_the_rank_axis():
    cmp = build_comparator(AllcloseCheck("o_partial", 1e-4, 1 / 128, 0.0, valid_rows=3, zero_tail=True),
                           mapping_shape=(), leading_rank_axis=True)
    assert "valid_rows=3, valid_axis=1, zero_tail=True" in cmp.__name__
    expected = torch.zeros(2, 5, 4)
    actual = expected.clone()
    assert cmp.evaluate(actual, expected).passed
    actual[1, 4, 0] = float("nan")
    assert cmp.evaluate(actual, expected).kind == "zero_tail"
