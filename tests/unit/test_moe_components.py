"""The MoE layer's math, layouts, fixture and golden on one process (spec moe.md).

The golden against the reference's own snapshot (bit for bit, §12), then each component's
rule from the spec on hand-made inputs: the gate (§4.2), the experts (§4.3, §4.5), the reduce
(§3.3), the two descriptions of the route layout (§3.1–3.2 vs §4.4), the fixture recipes (§6)
and the EP constants and case rules (§1.2).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from .. import moe_snapshot
from ..conftest import reference_snapshot
from layers.moe import layer as moe
from layers.components import moe as moe_math
from layers.components import moe_routing as routing
from layers.components.numerics import bf16, f32
from layers.contract.case import MoECase
from layers.contract.config import FLASH, PRESETS, SMALL, TINY, ConfigError
from layers.contract.tensors import Kind
from layers.moe import fixture


def _load(folder):
    return {p.stem: torch.load(p, weights_only=True) for p in sorted(folder.glob("*.pt"))}


# -- the golden against the reference ------------------------------------------------------------
def test_golden_reproduces_the_reference_snapshot_bitwise(two_threads):
    root = reference_snapshot("moe")
    inp, out = moe_snapshot.load(root / "in"), moe_snapshot.load(root / "out")
    p = inp["x_hc"].shape[0]
    case = moe_snapshot.snapshot_case(inp)
    case.validate()
    specs = moe.tensor_specs(case)
    assert set(inp) == {n for n, s in specs.items() if s.kind is Kind.INPUT} and set(out) == {"x_next"}
    for name, spec in specs.items():
        x = (inp | out)[name]
        assert x.dtype == spec.dtype and tuple(x.shape) == (spec.shape if not spec.shape else (p, *spec.shape)), name
    gap = moe_snapshot.golden_gap(case, inp, out["x_next"])
    assert gap.acceptable(), gap
    if not gap.exact:
        warnings.warn(f"this CPU's fp32 GEMMs round the MoE experts unlike the snapshot's machine: bit for bit "
                      f"but for {gap.moved} of {gap.active} (token, column) places, each with one expert output "
                      f"one bf16 step apart ({gap})")


def test_a_wrong_golden_is_not_explained_by_gemm_rounding(two_threads):
    """The gap check fails a golden whose defect survives the reference comparators: the routing
    weight applied after the routed expert's bf16 rounding instead of before (spec §4.5 step 4)."""
    root = reference_snapshot("moe")
    inp, out = moe_snapshot.load(root / "in"), moe_snapshot.load(root / "out")
    case = moe_snapshot.snapshot_case(inp)
    right = moe_math.routed_expert

    def weight_after_rounding(x8, xs, wr, *weights):
        return bf16(f32(right(x8, xs, torch.ones_like(wr), *weights)) * wr)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_math, "routed_expert", weight_after_rounding)
        gap = moe_snapshot.golden_gap(case, inp, out["x_next"])
    assert not gap.acceptable(), gap


# -- §4.2 gate ---------------------------------------------------------------------------------
def _gate_inputs(t=16, d=128, e=32, v=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "x_mixed": bf16(torch.randn(t, d, generator=g)),
        "norm_w": bf16(1 + 0.1 * torch.randn(d, generator=g)),
        "gate_w": torch.randn(e, d, generator=g) / d**0.5,
        "gate_bias": 0.3 * torch.randn(e, generator=g),
        "tid2eid": torch.argsort(torch.rand(v, e, generator=g), dim=1)[:, :6].to(torch.int32),
        "input_ids": torch.randint(0, v, (t,), generator=g),
    }


def _gate(x, layer_id, n, model=TINY):
    return moe_math.gate(x["x_mixed"], x["norm_w"], x["gate_w"], x["gate_bias"], x["tid2eid"], x["input_ids"],
                         layer_id, n, model)


def _scores(x):
    xg = f32(x["x_mixed"]) * f32(x["norm_w"])
    inv_rms = torch.rsqrt(f32(x["x_mixed"]).pow(2).mean(-1, keepdim=True) + 1e-6)
    logits = (xg @ x["gate_w"].t()) * inv_rms
    return torch.sqrt(torch.nn.functional.softplus(logits))


def test_gate_hash_layer_keeps_the_table_order_and_ignores_the_bias():
    x = _gate_inputs()
    codes, scale, indices, weights = _gate(x, layer_id=2, n=16)
    assert torch.equal(indices, x["tid2eid"][x["input_ids"]])
    x_nobias = dict(x, gate_bias=torch.zeros_like(x["gate_bias"]))
    assert all(torch.equal(a, b) for a, b in zip((codes, scale, indices, weights), _gate(x_nobias, 2, 16)))
    v = _scores(x).gather(1, indices.long())
    torch.testing.assert_close(weights, v / v.sum(-1, keepdim=True) * 1.5, rtol=1e-5, atol=0)
    torch.testing.assert_close(weights.sum(-1), torch.full((16,), 1.5))


def test_gate_score_layer_chooses_by_biased_scores_weighs_by_unbiased_ones():
    x = _gate_inputs()
    _codes, _scale, indices, weights = _gate(x, layer_id=3, n=16)
    scores = _scores(x)
    biased = scores + x["gate_bias"]
    assert torch.equal(indices.long(), torch.topk(biased, 6, dim=1).indices)  # no ties here: the plain top-6
    v = scores.gather(1, indices.long())
    torch.testing.assert_close(weights, v / v.sum(-1, keepdim=True) * 1.5, rtol=1e-5, atol=0)
    # ties go to the lower expert id: every expert gets the same biased score
    tie = dict(x, gate_w=torch.zeros_like(x["gate_w"]), gate_bias=torch.zeros_like(x["gate_bias"]))
    assert torch.equal(_gate(tie, 3, 16)[2], torch.arange(6, dtype=torch.int32).expand(16, 6))


def test_gate_rmsnorm_is_deferred_and_inactive_rows_keep_their_codes():
    x = _gate_inputs()
    codes, scale, indices, weights = _gate(x, layer_id=0, n=10)
    xg = f32(x["x_mixed"]) * f32(x["norm_w"])
    # the codes quantize x·norm_w (inv_rms would cancel), the scale carries inv_rms
    amax = xg.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(f32(codes), torch.round(xg * (127 / amax)), rtol=0, atol=1)
    inv_rms = torch.rsqrt(f32(x["x_mixed"]).pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(scale[:10], ((1 / (127 / amax)) * inv_rms)[:10], rtol=1e-6, atol=0)
    # doubling x_mixed (exact in bf16) leaves the codes, halves nothing but the RMS: same routing
    doubled = _gate(dict(x, x_mixed=bf16(2 * f32(x["x_mixed"]))), 0, 10)
    assert torch.equal(doubled[0], codes) and torch.equal(doubled[2], indices)
    # t >= n: scale, indices, weights zero; the codes are not masked (pitfall 4)
    assert (scale[10:] == 0).all() and (indices[10:] == 0).all() and (weights[10:] == 0).all()
    assert torch.equal(codes[10:], _gate(x, 0, 16)[0][10:]) and codes[10:].abs().sum() > 0


def test_num_tokens_is_clamped_to_0_and_t():
    x = _gate_inputs()
    assert all(torch.equal(a, b) for a, b in zip(_gate(x, 0, 500), _gate(x, 0, 16)))
    assert (_gate(x, 0, -3)[1] == 0).all()
    assert moe_math.active_tokens(torch.tensor(200, dtype=torch.int32), 128) == 128


# -- §4.3 / §4.5 experts, §3.3 reduce ---------------------------------------------------------------
def _expert_weights(i=128, d=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: torch.randint(-127, 128, s, generator=g, dtype=torch.int8)  # noqa: E731
    s = lambda n: torch.rand(n, generator=g) * 2e-3  # noqa: E731
    return w(i, d), s(i), w(i, d), s(i), w(d, i), s(d)


def test_routed_expert_applies_the_weight_before_rounding_and_shared_is_the_unweighted_form():
    g = torch.Generator().manual_seed(2)
    x8 = torch.randint(-127, 128, (20, 128), generator=g, dtype=torch.int8)
    xs = torch.rand(20, 1, generator=g) * 1e-2
    w = _expert_weights()
    ones = moe_math.routed_expert(x8, xs, torch.ones(20, 1), *w, TINY)
    assert torch.equal(ones, moe_math.shared_expert(x8, xs, *w, TINY))
    wr = torch.rand(20, 1, generator=g)
    weighted = moe_math.routed_expert(x8, xs, wr, *w, TINY)
    assert not torch.equal(weighted, bf16(f32(ones) * wr))  # weight after rounding: other bits
    torch.testing.assert_close(f32(weighted), f32(ones) * wr, rtol=2 / 128, atol=1e-6)
    assert (moe_math.routed_expert(x8, xs, torch.zeros(20, 1), *w, TINY) == 0).all()
    assert (moe_math.shared_expert(x8, torch.zeros(20, 1), *w, TINY) == 0).all()  # inactive rows


def test_routed_experts_runs_each_expert_on_its_own_rows():
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([3, 0, 5] + [0] * 12 + [4])
    r = int(counts.sum())
    x8 = torch.randint(-127, 128, (r, 128), generator=g, dtype=torch.int8)
    aux = torch.rand(r, 2, generator=g) * 1e-2
    experts = [_expert_weights(seed=10 + e) for e in range(16)]
    stacked = [torch.stack([w[j] for w in experts]) for j in range(6)]
    y = moe_math.routed_experts(counts, x8, aux, *stacked, TINY)
    start = 0
    for e, c in enumerate(counts.tolist()):
        rows = slice(start, start + c)
        assert torch.equal(y[rows], moe_math.routed_expert(x8[rows], aux[rows, :1], aux[rows, 1:], *experts[e], TINY))
        start += c


def test_reduce_order_and_inactive_rows():
    t, k, d = 4, 6, 8
    sh = bf16(torch.full((t, d), 2.0**24))
    buf = torch.zeros(t * k, d, dtype=torch.bfloat16)
    buf[0::k] = 1.0  # k = 0
    buf[1::k] = -(2.0**24)  # k = 1
    # ((2^24 + 1) + (-2^24)) in fp32 is 0: sh first, then k ascending (any other order gives 1)
    assert (moe_math.reduce(sh, buf, 2)[:2] == 0).all()
    buf_nan = buf.clone()
    buf_nan[2 * k :] = float("nan")  # rows of inactive tokens are never read
    out = moe_math.reduce(sh, buf_nan, 2)
    assert torch.equal(out[2:], sh[2:]) and torch.equal(out[:2], moe_math.reduce(sh, buf, 2)[:2])


# -- §3.1–3.2 layouts: the forward's and the golden's agree --------------------------------------------
def _random_indices(p, t, k=6, e_per_rank=16, seed=4, unused=()):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(p, t, p * e_per_rank, generator=g)
    u[..., list(unused)] = 2.0
    return torch.topk(u, k, dim=-1, largest=False).indices.to(torch.int32)


@pytest.mark.parametrize("p,n", [(1, 128), (2, 100), (4, 0), (4, 128), (3, 7)])
def test_send_layout_and_transposes_give_the_replay_order(p, n):
    idx = _random_indices(p, 128, unused=(5, 16 * p - 1))
    sends = [routing.send_layout(idx[s], n, p, 16) for s in range(p)]
    for s, (meta, route) in enumerate(sends):
        eid = idx[s, :n].reshape(-1).long()[route.long()]
        assert (eid[1:] >= eid[:-1]).all()  # (dst, e) ascending
        same = eid[1:] == eid[:-1]
        assert (route[1:][same] > route[:-1][same]).all()  # ρ ascending within a lane
        assert meta.sum() == route.numel() == n * 6
    for d in range(p):
        # what rank d receives from each source, source-major: the source's rows for d's experts
        recv_meta = torch.stack([m[d] for m, _ in sends])
        per_src = [(s, r[sum(m[:d].sum(1)) : sum(m[: d + 1].sum(1))]) for s, (m, r) in enumerate(sends)]
        src = torch.cat([torch.full((len(r),), s) for s, r in per_src])
        rho = torch.cat([r.long() for _, r in per_src])
        order = routing.block_transpose(recv_meta)
        want_meta, want_src, want_rho = routing.replay_dispatch(d, idx, n, 16)
        assert torch.equal(recv_meta, want_meta)
        assert torch.equal(src[order], want_src) and torch.equal(rho[order], want_rho)
        back = routing.block_transpose(recv_meta.t())
        assert torch.equal(order[back], torch.arange(len(order)))  # the combine undoes the dispatch


def test_replay_combine_puts_every_route_back_and_leaves_inactive_rows_zero():
    p, n = 3, 50
    idx = _random_indices(p, 128)
    replays = [routing.replay_dispatch(d, idx, n, 16) for d in range(p)]
    # each routed row carries its source and ρ (as ρ // 16, ρ % 16: exact in bf16)
    ys = [bf16(torch.stack((s.float(), (r // 16).float(), (r % 16).float()), 1)) for _, s, r in replays]
    for s in range(p):
        buf = routing.replay_combine(s, 128, 6, replays, ys)
        rho = buf[: n * 6, 1].long() * 16 + buf[: n * 6, 2].long()
        assert (buf[: n * 6, 0] == s).all() and torch.equal(rho, torch.arange(n * 6))
        assert (buf[n * 6 :] == 0).all()


def test_send_layout_refuses_an_expert_id_out_of_range():
    idx = torch.full((4, 6), 32, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 32\)"):
        routing.send_layout(idx, 4, 2, 16)


# -- §6 fixture ---------------------------------------------------------------------------------
def test_fp4_lookup_is_the_spec_bucketize():
    g = torch.Generator().manual_seed(5)
    q = torch.cat((torch.rand(100000, generator=g) * 6, torch.tensor(fixture.FP4_MIDPOINTS), torch.arange(25) / 4))
    want = torch.tensor(fixture.FP4_LEVELS)[torch.bucketize(q, torch.tensor(fixture.FP4_MIDPOINTS)).clamp(max=7)]
    got = torch.take(fixture._FP4_BY_QUARTER, (q * 4).ceil().long())
    assert torch.equal(got, want)


def test_fixture_slices_are_rank_addressable_and_replicated_tensors_identical():
    case = MoECase(TINY, 4, 11, layer_id=3, num_tokens=100)
    r1, r2 = fixture.rank_inputs(case, 1), fixture.rank_inputs(case, 2)
    again = fixture.rank_inputs(case, 1)
    assert all(torch.equal(r1[n], again[n]) for n in r1)
    specs = moe.tensor_specs(case)
    assert set(r1) == {n for n, s in specs.items() if s.kind is Kind.INPUT}
    for n, s in specs.items():
        if n in r1:
            assert (tuple(r1[n].shape), r1[n].dtype) == (s.shape, s.dtype), n
    for n in ("hc_ffn_fn", "gate_w", "tid2eid", "shared_w1", "shared_w2_scale", "norm_w", "gate_bias"):
        assert torch.equal(r1[n], r2[n]), n
    for n in ("x_hc", "input_ids", "routed_w1", "routed_w2_scale"):
        assert not torch.equal(r1[n], r2[n]), n
    # any rank can draw any expert: rank 2's local expert 5 is global expert 37
    e37 = fixture.expert_weights(case, 37)
    assert all(torch.equal(r2[n][5], e37[n]) for n in e37)
    assert torch.equal(fixture.source_inputs(case, 2)["x_hc"], r2["x_hc"])
    assert int(r1["layer_id"]) == 3 and int(r1["num_tokens"]) == 100
    assert (r1["norm_w"] == 1).all() and (r1["gate_bias"] == 0).all()
    assert fixture.rank_inputs(MoECase(TINY, 4, 12), 1)["x_hc"].ne(r1["x_hc"]).any()  # the seed matters


def test_fixture_weights_follow_the_recipes():
    case = MoECase(TINY, 2, 3)
    w = fixture.expert_weights(case, 0)
    for name, std in fixture.ROUTED_STD.items():
        codes, scale = w[name], w[f"{name}_scale"]
        assert codes.abs().max() == 127 and (codes.abs().amax(1) == 127).all()  # per-row int8, clamp ±127
        want = fixture.weight_std(std, name, TINY)
        assert abs(torch.std(f32(codes) * scale[:, None]).item() - want) < 1e-3 * want  # rescaled to the target std
    r = fixture.replicated_inputs(case)
    for name, (std, _cv) in fixture.SHARED_STD.items():
        want = fixture.weight_std(std, name, TINY)
        assert abs(torch.std(f32(r[name]) * r[f"{name}_scale"][:, None]).item() - want) < 1e-3 * want
    # the stds are §6's at FLASH dims, scaled with the fan-ins below (FLASH-sized FFN outputs)
    assert all(fixture.weight_std(s, n, FLASH) == s for n, s in fixture.ROUTED_STD.items())
    assert fixture.weight_std(1.0, "routed_w1", TINY) == 4.0 and fixture.weight_std(1.0, "shared_w2", TINY) == 4.0
    tid2eid = r["tid2eid"]
    assert tid2eid.shape == (TINY.vocab_size, 6) and tid2eid.min() >= 0 and tid2eid.max() < 32
    assert (torch.sort(tid2eid, 1).values.diff(dim=1) > 0).all()  # six distinct experts per token id


@pytest.mark.parametrize("p,n", [(2, 128), (8, 64), (16, 8)])
def test_balanced_routing_gives_every_expert_the_same_rows(p, n):
    case = MoECase(TINY, p, 1, num_tokens=n, balanced_routing=True)
    case.validate()
    tid2eid = fixture.replicated_inputs(case)["tid2eid"]
    ids = torch.stack([fixture.source_inputs(case, s)["input_ids"] for s in range(p)])
    assert torch.equal(ids[1], n + torch.arange(128))
    per_expert = torch.bincount(tid2eid[ids[:, :n]].reshape(-1).long(), minlength=16 * p)
    assert (per_expert == p * n * 6 // (16 * p)).all()


# -- §1.2 constants and the case ---------------------------------------------------------------------
def test_ep_constants_are_derived_and_fixed():
    for p in (1, 2, 4, 8, 16):
        case = MoECase(FLASH, p, 0)
        assert (case.tokens, case.local_experts, case.routed_experts, case.recv_max) == (128, 16, 16 * p, 128 * p)
    assert SMALL.moe_intermediate_size == 256 and SMALL.hidden_size == 512
    assert (FLASH.moe_intermediate_size, FLASH.vocab_size, FLASH.num_experts_per_tok, FLASH.num_hash_layers) == (
        2048, 129280, 6, 3)
    assert all(m.moe_tokens == 128 and m.moe_local_experts == 16 for m in PRESETS.values())
    with pytest.raises(TypeError):
        FLASH.replace(moe_tokens=64)  # a derived constant, not a field


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(ep=0), r"ep=0 must be in \[1, 16\]"),
        (dict(ep=17), r"ep=17 must be in \[1, 16\]"),
        (dict(num_tokens=129), r"num_tokens=129 must be in \[0, 128\]"),
        (dict(num_tokens=-1), r"num_tokens=-1"),
        (dict(layer_id=-2), r"layer_id=-2 must be >= 0"),
        (dict(balanced_routing=True, layer_id=3), r"balanced routing needs a hash layer"),
        (dict(balanced_routing=True, num_tokens=12), r"num_tokens=12 must be a multiple of 8"),
        (dict(model=TINY.replace(vocab_size=1000), ep=16, balanced_routing=True), r"vocab_size=1000"),
        (dict(model=TINY.replace(moe_intermediate_size=96)), r"moe_intermediate_size=96"),
        (dict(model=TINY.replace(scoring_func="softmax")), r"only sqrtsoftplus"),
        (dict(model=TINY.replace(num_experts_per_tok=17)), r"num_experts_per_tok=17"),
    ],
)
def test_case_refuses_what_the_constants_forbid(kwargs, message):
    base = dict(model=TINY, ep=2, seed=0)
    with pytest.raises(ConfigError, match=message):
        MoECase(**(base | kwargs)).validate()


def test_tiny_keeps_the_structure_at_every_ep():
    for p in range(1, 17):
        MoECase(TINY, p, 0).validate()
        MoECase(TINY, p, 0, balanced_routing=True).validate()
        MoECase(TINY, p, 0, layer_id=TINY.num_hash_layers, num_tokens=100).validate()
