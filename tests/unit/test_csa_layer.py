"""The CSA layer: inventory, fixture, validation, key list and the compressors (the properties
every layer shares are in tests/conformance).

Reference data (tests/data/reference/csa-tp2-mini) pins the tensor inventory and every integer
metadata tensor the fixture derives (starts, tables, slot mappings, window indices, the
sentinel rows of both state pools). Loop re-statements in this file pin the attention key
list and the RoPE positions of the two compressors.
"""

from __future__ import annotations

import pytest
import torch

from layers.csa import layer as csa
from layers.components import hc, qkv
from layers.components.numerics import bf16
from layers.contract.case import Case
from layers.contract.checks import HIDDEN_AXES, PoolCheck, RelDiffCheck
from layers.contract.config import FLASH, MINI, SMALL, TINY, ConfigError
from layers.contract.tensors import Kind
from layers.csa import fixture as csa_fixture
from layers.registry import validated

from ..conftest import reference_snapshot
from .test_csa_compressor import naive_compressor_step

SEQ = TINY.decode_seq
INOUTS = ("compress_state", "inner_compress_state", "kv_cache", "cmp_kv", "idx_kv_cache", "idx_kv_scale")


def _load(name: str, kind: str = "in") -> torch.Tensor:
    return torch.load(reference_snapshot("csa") / kind / f"{name}.pt", weights_only=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dim() else t


def _golden_inputs(case: Case, rank: int) -> dict[str, torch.Tensor]:
    x = csa.LAYER.rank_inputs(case, rank)
    x["wo_a"], x["wo_b"] = csa.LAYER.full_o_weights(case)
    return x


# -- inventory and fixture vs the reference snapshot ----------------------------------------
def test_tensor_specs_match_the_snapshot():
    case = Case("csa", MINI, 2, 32, seed=0)
    specs = csa.LAYER.tensor_specs(case)
    folder = reference_snapshot("csa")
    ins = {p.stem for p in (folder / "in").glob("*.pt")}
    outs = {p.stem for p in (folder / "out").glob("*.pt")}
    assert set(specs) == ins | outs
    for name, spec in specs.items():
        ref = _load(name, "out" if name == "x_out" else "in")
        shape = tuple(ref.shape) if name == "local_t" else tuple(ref.shape[1:])
        assert (spec.shape, spec.dtype) == (shape, ref.dtype), name
        expected = Kind.OUTPUT if name not in ins else Kind.INOUT if name in outs else Kind.INPUT
        assert spec.kind is expected, name


def test_fixture_metadata_equals_the_snapshot():
    """Starts, tables, mappings and windows are deterministic: the reference's, value for value."""
    case = Case("csa", MINI, 2, 32, seed=0)
    specs = csa.LAYER.tensor_specs(case)
    integer = [n for n, s in specs.items() if s.dtype in (torch.int32, torch.int64) and n != "local_t"]
    assert len(integer) == 13
    for rank in range(2):
        x = csa.LAYER.rank_inputs(case, rank)
        for name in integer:
            assert torch.equal(x[name], _load(name)[rank]), (rank, name)
        for pool in ("compress_state", "inner_compress_state"):
            ref = _load(pool)[rank]
            # The same rows hold the −inf sentinel (never-written score halves).
            assert torch.equal(torch.isinf(x[pool]), torch.isinf(ref)), (rank, pool)
            assert torch.equal(x[pool] == 0, ref == 0), (rank, pool)
        for name in ("freqs_cos", "freqs_sin", "hadamard_idx", "hc_attn_scale", "hc_attn_base", "attn_sink"):
            assert torch.equal(x[name], _load(name)[rank]), name


def test_sentinel_rows_hold_minus_inf_and_survive_the_step():
    """§6.3 / pitfall 4: never-written rows are kv 0 / score −inf; the step leaves them as they are."""
    case = Case("csa", TINY, 2, 64, seed=3)
    x = _golden_inputs(case, 1)
    before = {n: x[n].clone() for n in ("compress_state", "inner_compress_state")}
    out = csa.golden_decode_csa_tp1(TINY, x)
    pools = (("compress_state", "state_slot_mapping"), ("inner_compress_state", "inner_state_slot_mapping"))
    for pool, mapping in pools:
        rows = before[pool].view(-1, before[pool].shape[-1])
        out_dim = rows.shape[1] // 2
        sentinel = torch.isinf(rows[:, out_dim:]).all(dim=1)
        assert sentinel.any() and (rows[sentinel, :out_dim] == 0).all()
        assert not torch.isinf(rows[~sentinel]).any()
        written = x[mapping]
        after = out[pool].view(rows.shape)
        keep = torch.ones(rows.shape[0], dtype=torch.bool)
        keep[written] = False
        assert torch.equal(after[keep], rows[keep])
        assert torch.isfinite(after[written]).all()
    assert torch.isfinite(out["x_out"]).all()


def test_global_batch_structure():
    """Rank r holds global requests r·batch …: its starts continue the global pattern (§7.1)."""
    case = Case("csa", TINY, 2, 64, seed=0)
    starts = csa_fixture.global_starts(case)
    assert starts[:10] == [8192, 0, 2, 3, 7, 127, 128, 63, 255, 511]
    for rank in range(2):
        x = csa.LAYER.rank_inputs(case, rank)
        assert x["position_ids"][::SEQ].tolist() == starts[rank * 8 : rank * 8 + 8]
    # The replicated pools are the same on every rank, history rows of all ranks included.
    assert torch.equal(csa.LAYER.rank_inputs(case, 0)["compress_state"], x["compress_state"])


def test_o_weight_shards_reassemble():
    case = Case("csa", TINY, 4, 32, seed=2)
    wo_a, wo_b = csa.LAYER.full_o_weights(case)
    shards = [csa.LAYER.rank_inputs(case, r) for r in range(4)]
    assert torch.equal(torch.cat([s["wo_a"] for s in shards]), wo_a)
    assert torch.equal(torch.cat([s["wo_b"] for s in shards], dim=1), wo_b)
    # wo_b is quantized half away from zero per full row (csa.md §6.7).
    w = torch.cat([csa_fixture.wo_b_block(case, g) for g in range(TINY.o_groups)], dim=1).float()
    sq = 127.0 / w.abs().amax(dim=1, keepdim=True).clamp_min(1e-4)
    v = w * sq
    assert torch.equal(wo_b.int(), (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127).int())
    assert torch.equal(shards[2]["wo_b_scale"], (1.0 / sq).reshape(-1))


# -- validation ------------------------------------------------------------------------------
def test_validate_accepts_the_presets():
    cases = ((TINY, 1, 128), (TINY, 8, 16), (TINY, 2, 56), (SMALL, 2, 64), (MINI, 2, 32), (FLASH, 8, 64), (FLASH, 2, 248))
    for model, tp, local_t in cases:
        validated(Case("csa", model, tp, local_t, seed=0))


@pytest.mark.parametrize(
    "case, message",
    [
        (Case("csa", TINY, 2, 64, 0, start_pos=16380), "context ceiling 16384"),
        (Case("csa", TINY.replace(csa_state_physical_blocks=40), 1, 128, 0), "cannot hold the current rows"),
        (Case("csa", TINY.replace(kv_ori_block_num=8), 1, 128, 0), "needs more than 8 physical pages"),
        (Case("csa", TINY.replace(q_lora_rank=192), 1, 128, 0), "multiple of 128"),
        (Case("csa", TINY.replace(decode_batch=8), 8, 8, 0), "must be >= 16"),
        (Case("csa", TINY, 2, 60, 0), "local_t=60"),
    ],
)
def test_validate_rejects(case, message):
    with pytest.raises(ConfigError, match=message) as info:
        validated(case)
    assert "\n" not in str(info.value)


def test_validate_rejects_aliased_write_rows(monkeypatch):
    """Without the re-placement the default raw table wraps (8 pages, 16 requests): rows collide."""
    monkeypatch.setattr(csa_fixture, "injective_cache_table", lambda default, *a, **k: default)
    with pytest.raises(ConfigError, match=r"rank 0: .*ori_slot_mapping write kv_cache row .*distinct write rows"):
        validated(Case("csa", TINY.replace(kv_ori_block_num=8), 1, 128, 0))


def test_checks_follow_the_validation_order():
    checks = csa.LAYER.checks(Case("csa", TINY, 2, 64, 0))
    assert [c.output for c in checks] == list(INOUTS) + ["x_out"]
    pools = {
        c.output: (c.mapping, c.block_size, c.atol, c.rtol, c.max_error_ratio)
        for c in checks
        if isinstance(c, PoolCheck)
    }
    assert pools == {
        "compress_state": ("state_slot_mapping", 2, 1e-3, 1e-3, 0.005),
        "inner_compress_state": ("inner_state_slot_mapping", 2, 1e-3, 1e-3, 0.005),
        "kv_cache": ("ori_slot_mapping", 32, 1e-4, 1 / 128, 0.005),
        "cmp_kv": ("cmp_slot_mapping", 32, 1e-4, 1 / 128, 0.005),
        "idx_kv_cache": ("idx_slot_mapping", 32, 1, 0, 0.01),
        "idx_kv_scale": ("idx_slot_mapping", 32, 1e-4, 1 / 128, 0.01),
    }
    # The indexer's top-k flips for a token whose scores moved: its x_out row may gather bad points.
    assert checks[-1] == RelDiffCheck("x_out", diff_thd=4e-3, pct_thd=0.008, max_diff_hd=1, concentrates_in=("token",), axes=HIDDEN_AXES)


# -- the step on one rank ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tp1():
    case = Case("csa", TINY, 1, 128, seed=13)
    x = _golden_inputs(case, 0)
    golden = csa.golden_decode_csa_tp1(TINY, {n: v.clone() for n, v in x.items()})
    return case, x, golden


def test_compressors_use_their_own_rope_positions(tiny_tp1):
    """Pitfall 5: main compressor at 4·floor(first/4), inner compressor at first (§4.2)."""
    case, x, golden = tiny_tp1
    positions = x["position_ids"]
    first = positions.long()[::SEQ]
    x_mixed, _, _ = hc.hc_pre(x["x_hc"], x["hc_attn_fn"], x["hc_attn_scale"], x["hc_attn_base"], TINY)
    x_normed = qkv.rms_norm(x_mixed, x["attn_norm_w"], TINY.rms_norm_eps)
    cmp_pos, cos, sin = first - first % 4, x["freqs_cos"], x["freqs_sin"]
    assert (cmp_pos != first).any()

    def naive(prefix, state, table, mapping, rope_pos):
        return naive_compressor_step(
            TINY, x_normed, x[f"{prefix}_wkv"], x[f"{prefix}_wgate"], x[f"{prefix}_ape"], x[f"{prefix}_norm_w"],
            x[state].clone(), x[table], x[mapping], positions, cos[rope_pos], sin[rope_pos],
        )  # fmt: skip

    main = naive("cmp", "compress_state", "compress_state_block_table", "state_slot_mapping", cmp_pos)
    main_wrong = naive("cmp", "compress_state", "compress_state_block_table", "state_slot_mapping", first)
    inner_args = ("inner", "inner_compress_state", "inner_compress_state_block_table", "inner_state_slot_mapping")
    inner, inner_wrong = naive(*inner_args, first), naive(*inner_args, cmp_pos)
    had = x["hadamard_idx"].float()

    def quantized(v):
        h = (bf16(v).float() @ had).bfloat16().float()
        return torch.round(h * (127.0 / h.abs().max().clamp_min(1e-4))).to(torch.int8)

    cmp_rows = golden["cmp_kv"].view(-1, TINY.head_dim)
    idx_rows = golden["idx_kv_cache"].view(-1, TINY.index_head_dim)
    shifted_main = shifted_inner = 0
    for b, (boundary, y) in main.items():
        committed = cmp_rows[int(x["cmp_slot_mapping"][b * SEQ + boundary])].float()
        assert (committed - bf16(y).float()).abs().max() <= 2**-6
        shifted_main += int((committed - bf16(main_wrong[b][1]).float()).abs().max() > 2**-6)
        irow = int(x["idx_slot_mapping"][b * SEQ + boundary])
        assert (idx_rows[irow].int() - quantized(inner[b][1]).int()).abs().max() <= 1
        shifted_inner += int((quantized(inner_wrong[b][1]).int() - idx_rows[irow].int()).abs().max() > 1)
    # Each commit moves when rotated at the other compressor's position instead.
    assert shifted_main and shifted_inner, "main rows rotate at 4·floor(first/4), inner rows at first"


def naive_key_rows(idx_topk, cmp_block_table, positions, window):
    """§4.9 step 2 restated: window rows, then each selected slot's physical cmp_kv row (or −1)."""
    out = []
    for t in range(idx_topk.shape[0]):
        b, p = t // SEQ, int(positions[t])
        row = [("kv", int(r)) for r in window[t]]
        for raw in idx_topk[t].tolist():
            if 0 <= raw < (p + 1) // 4:
                row.append(("cmp", int(cmp_block_table[b, raw // 32]) * 32 + raw % 32))
            else:
                row.append(("cmp", -1))
        out.append(row)
    return out


def test_compressed_key_rows_are_causal_slot_rows(tiny_tp1):
    case, x, _ = tiny_tp1
    g = torch.Generator().manual_seed(0)
    positions = x["position_ids"]
    raw = torch.randint(-1, 3000, (case.local_t, TINY.index_topk), generator=g, dtype=torch.int32)
    p = positions.long()
    # The causal edge: slot (p+1) div 4 − 1 is visible, (p+1) div 4 and p div 4 + 1 are not.
    edge = torch.stack(((p + 1) // 4 - 1, (p + 1) // 4, p // 4 + 1, p // 4, torch.zeros_like(p)), dim=1)
    raw[:, : edge.shape[1]] = edge.to(torch.int32)
    got = csa.compressed_key_rows(raw, x["cmp_block_table"], positions, SEQ, TINY.block_size)
    expected = naive_key_rows(raw, x["cmp_block_table"], positions, x["window_swa_indices"])
    w = TINY.sliding_window
    assert got.tolist() == [[r for _, r in row[w:]] for row in expected]
    assert (got >= 0).any() and (got < 0).any()


def test_attention_masks_invalid_keys(tiny_tp1):
    """Masked keys (window −1, non-causal or −1 slots) cannot reach the output, even as NaN rows."""
    case, x, _ = tiny_tp1
    g = torch.Generator().manual_seed(1)
    q = bf16(torch.randn(case.local_t, TINY.num_attention_heads, TINY.head_dim, generator=g))
    raw = torch.randint(-1, 40, (case.local_t, TINY.index_topk), generator=g, dtype=torch.int32)
    args = (x["window_swa_indices"], x["cmp_kv"], x["cmp_block_table"], raw, x["position_ids"], x["attn_sink"])
    o = csa.csa_attention(TINY, q, x["kv_cache"], *args)
    rows = csa.compressed_key_rows(raw, x["cmp_block_table"], x["position_ids"], SEQ, TINY.block_size)
    used_cmp = set(rows[rows >= 0].tolist())
    used_kv = set(x["window_swa_indices"][x["window_swa_indices"] >= 0].tolist())
    poisoned_cmp, poisoned_kv = x["cmp_kv"].clone(), x["kv_cache"].clone()
    for pool, used in ((poisoned_cmp, used_cmp), (poisoned_kv, used_kv)):
        rows = pool.view(-1, TINY.head_dim)
        rows[[r for r in range(rows.shape[0]) if r not in used]] = float("nan")
    o2 = csa.csa_attention(TINY, q, poisoned_kv, x["window_swa_indices"], poisoned_cmp, *args[2:])
    assert torch.equal(o, o2)
