"""The streamed fixture draws and weight quantizers give the bits of whole-tensor draws.

`layers.fixtures.draw` cuts a key's normal stream into row blocks drawn into one reused
buffer, and the weight quantizers of `layers.components.numerics` and the MoE / indexer
recipes walk a weight by row blocks: none may change a value against one `torch.randn` of
the whole tensor and the whole-tensor formulas, whatever the block size.
"""

from __future__ import annotations

import pytest
import torch

from layers.components import numerics
from layers.components.numerics import quant_weight_int8, quantize_weight_int8, weight_amax
from layers.contract.case import Case, MoECase
from layers.contract.config import TINY
from layers.csa import fixture as csa_fixture
from layers.fixtures import draw
from layers.fixtures.kept import forget_kept_weights
from layers.moe import fixture as moe_fixture
from layers.registry import get_layer

SHAPES = [(), (3,), (16,), (17,), (5, 7), (33, 1000), (4, 1025), (8, 32, 1, 64), (300, 1), (2, 3, 70001)]


def _whole(shape, seed, *key) -> torch.Tensor:
    """One draw of the whole tensor from the key's generator: what the stream must equal."""
    return torch.randn(shape, generator=draw.generator(seed, *key), dtype=torch.float32)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("block_values", [16, 1000, draw.BLOCK_VALUES])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_normal_is_one_draw_of_the_whole_tensor(shape, block_values, monkeypatch):
    monkeypatch.setattr(draw, "BLOCK_VALUES", block_values)
    ref = _whole(shape, 7, "w", 3)
    assert _same_bits(draw.normal(shape, 7, "w", 3), ref)
    assert _same_bits(draw.randn(shape, 7, "w", 3), ref)
    scaled = draw.normal(shape, 7, "w", 3, dtype=torch.bfloat16, transform=lambda b: b.mul_(0.3).add_(0.1))
    assert _same_bits(scaled, ref.clone().mul_(0.3).add_(0.1).to(torch.bfloat16))
    out = torch.empty(shape, dtype=torch.bfloat16)
    assert draw.normal(shape, 7, "w", 3, dtype=torch.bfloat16, out=out) is out
    assert _same_bits(out, ref.to(torch.bfloat16))


@pytest.mark.parametrize("whole_rows", [1, 3, 128])
@pytest.mark.parametrize("shape", [(1024, 48), (256, 1000), (7, 5), (384, 33)], ids=str)
def test_normal_blocks_cover_the_rows_in_order(shape, whole_rows):
    rows, row_len = shape
    seen = []
    for r0, r1, block in draw.normal_blocks(shape, 5, "k", block_values=4096, whole_rows=whole_rows):
        assert block.shape == (r1 - r0, row_len) and block.dtype == torch.float32
        seen.append((r0, r1, block.clone()))
    assert [r0 for r0, _, _ in seen] == [0] + [r1 for _, r1, _ in seen[:-1]] and seen[-1][1] == rows
    assert all(r0 % whole_rows == 0 for r0, _, _ in seen)
    assert _same_bits(torch.cat([b for _, _, b in seen]), _whole(shape, 5, "k"))


@pytest.mark.parametrize("rows,row_len", [(1, 5), (3, 5), (100, 7), (1000, 1), (17, 1), (10, 100000), (0, 4)])
def test_row_blocks_keep_the_normal_groups_whole(rows, row_len):
    blocks = draw.row_blocks(rows, row_len, block_values=64)
    assert sum(r1 - r0 for r0, r1 in blocks) == rows
    for r0, r1 in blocks[:-1]:
        assert (r1 - r0) * row_len % 16 == 0
    if blocks and rows * row_len >= 16:
        assert (blocks[-1][1] - blocks[-1][0]) * row_len >= 16


def test_draws_are_keyed_and_deterministic():
    a = draw.normal((64, 64), 1, "wq_a")
    assert _same_bits(a, draw.normal((64, 64), 1, "wq_a"))
    assert not torch.equal(a, draw.normal((64, 64), 2, "wq_a"))
    assert not torch.equal(a, draw.normal((64, 64), 1, "wq_a", 0))
    assert not torch.equal(draw.normal((64, 64), 1, "wo_a", 0), draw.normal((64, 64), 1, "wo_a", 1))


def test_normal_is_standard_normal():
    z = draw.normal((1024, 1024), 3, "dist").double()
    assert abs(z.mean().item()) < 5e-3 and abs(z.std().item() - 1) < 5e-3
    # Tail masses of N(0, 1): P(|z| > 1) = 0.3173, P(|z| > 2) = 0.0455, P(|z| > 3) = 0.0027.
    for k, p in ((1, 0.3173), (2, 0.0455), (3, 0.0027)):
        assert abs((z.abs() > k).double().mean().item() - p) < 0.05 * p + 1e-4, k
    rows = draw.normal((512, 256), 3, "rms", dtype=torch.bfloat16, transform=draw.unit_rms_rows(1e-6)).float()
    assert torch.allclose(rows.pow(2).mean(dim=-1), torch.ones(512), rtol=1e-2)


# -- the streamed quantizers against the whole-tensor formula ------------------------------------
def _quant_whole(w: torch.Tensor, axis: int, half_away_from_zero: bool):
    v = w.to(torch.float32, copy=True)
    amax = v.abs().amax(dim=axis, keepdim=True).clamp_min(numerics.INT8_AMAX_EPS)
    scale_quant = numerics.INT8_SCALE_MAX / amax
    v = v * scale_quant
    v = torch.trunc(v + torch.full((), 0.5).copysign(v)) if half_away_from_zero else torch.round(v)
    return v.clamp(-127, 127).to(torch.int8), (1.0 / scale_quant).squeeze(axis)


@pytest.mark.parametrize("half_away_from_zero", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,axis", [((3,), -1), ((2, 3), 0), ((2, 3), -1), ((256, 1000), 0), ((256, 1000), -1),
                                        ((4, 6, 50), -1), ((1, 5000), 0)])
def test_streamed_weight_quant_is_the_whole_tensor_formula(shape, axis, dtype, half_away_from_zero, monkeypatch):
    monkeypatch.setattr(numerics, "_QUANT_BLOCK_VALUES", 4096)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 0.05).to(dtype)
    if w.dim() == 2:  # exact ties at ±k.5 and zeros: where the two roundings differ
        w[0, : min(3, w.shape[1])] = torch.tensor([1.0, -0.25, 0.0])[: min(3, w.shape[1])].to(dtype)
    q, scale = quant_weight_int8(w, axis=axis, half_away_from_zero=half_away_from_zero)
    q_ref, scale_ref = _quant_whole(w, axis, half_away_from_zero)
    assert _same_bits(q, q_ref) and _same_bits(scale, scale_ref)


@pytest.mark.parametrize("half_away_from_zero", [False, True])
def test_quantize_with_a_wider_amax_into_columns(half_away_from_zero):
    """A block of columns quantized with the whole rows' amax, into its columns of the whole
    weight, is that part of the whole weight's quantization (how wo_b is built)."""
    g = torch.Generator().manual_seed(2)
    whole = (torch.randn(64, 96, generator=g) * 0.02).to(torch.bfloat16)
    amax = weight_amax(whole, axis=-1)
    assert _same_bits(amax, whole.float().abs().amax(dim=-1, keepdim=True))
    out = torch.empty(64, 96, dtype=torch.int8)
    for c in range(0, 96, 32):
        _, scale = quantize_weight_int8(whole[:, c : c + 32], amax, axis=-1,
                                        half_away_from_zero=half_away_from_zero, out=out[:, c : c + 32])
    q_ref, scale_ref = _quant_whole(whole, -1, half_away_from_zero)
    assert _same_bits(out, q_ref) and _same_bits(scale, scale_ref)


def test_gen_shared_weight_is_the_whole_weight_recipe():
    """The banded indexer wq_b recipe against the whole-weight formula of csa.md §6.7."""
    out_f, in_f, std, cv = 384, 256, 0.108, 0.56
    q, scale = csa_fixture.gen_shared_weight(out_f, in_f, std, cv, 9, "idx")
    w = _whole((out_f, in_f), 9, "idx", "source") * torch.exp(cv * _whole((out_f, 1), 9, "idx", "channel"))
    wb = w.reshape(out_f // 128, 128, in_f // 128, 128)
    s = torch.exp2(torch.ceil(torch.log2(torch.clamp(wb.abs().amax(dim=(1, 3), keepdim=True) / 448.0, min=1e-20))))
    wq = ((wb / s).to(torch.float8_e4m3fn).float() * s).reshape(out_f, in_f)
    sc = wq.abs().amax(dim=1, keepdim=True).clamp_min(1e-4) / 127.0
    q_ref = torch.clamp(torch.round(wq / sc), -127, 127)
    scale_ref = (sc * (std / (q_ref * sc).std())).reshape(out_f)
    assert _same_bits(q, q_ref.to(torch.int8)) and _same_bits(scale, scale_ref)
    assert abs((q.float() * scale[:, None]).std().item() - std) < 1e-6


@pytest.mark.parametrize("layer", ["swa", "csa", "hca"])
def test_fixture_values_do_not_depend_on_the_block_size(layer, monkeypatch):
    case = Case(layer, TINY, 2, 16, 11)
    lay = get_layer(layer)
    forget_kept_weights()
    ref, (ref_a, ref_b) = lay.rank_inputs_and_full_o(case, 1)
    monkeypatch.setattr(draw, "BLOCK_VALUES", 256)
    monkeypatch.setattr(numerics, "_QUANT_BLOCK_VALUES", 256)
    forget_kept_weights()  # drawn again, in the small blocks
    small, (a, b) = lay.rank_inputs_and_full_o(case, 1)
    assert list(small) == list(ref)
    assert [n for n in ref if not _same_bits(small[n], ref[n])] == []
    assert _same_bits(a, ref_a) and _same_bits(b, ref_b)


# -- the MoE recipes (moe.md §6), streamed against the whole-weight formulas -----------------------
def _int8_per_row_whole(wq: torch.Tensor, std: float):
    cs = wq.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4) / 127.0
    codes = torch.clamp(torch.round(wq / cs), -127, 127)
    return codes.to(torch.int8), (cs * (std / torch.std(codes * cs))).squeeze(-1)


def _pow2(amax: torch.Tensor, top: float) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2((amax / top).clamp_min(1e-20))))


def _g4_whole(shape, std, seed, *key):
    out_dim, in_dim = shape
    groups = _whole(shape, seed, *key).view(out_dim, in_dim // 32, 32)
    gs = _pow2(groups.abs().amax(dim=-1, keepdim=True), 6.0)
    levels = torch.tensor(moe_fixture.FP4_LEVELS)
    q = levels[torch.bucketize(groups.abs() / gs, torch.tensor(moe_fixture.FP4_MIDPOINTS), right=False)]
    return _int8_per_row_whole((q * gs).copysign(groups).view(shape), std)


def _g8_whole(shape, std, cv, seed, *key):
    out_dim, in_dim = shape
    gen = draw.generator(seed, *key)
    w = torch.randn(shape, generator=gen)
    w = w * torch.exp(cv * torch.randn(out_dim, 1, generator=gen))
    blocks = w.view(out_dim // 128, 128, in_dim // 128, 128)
    bs = _pow2(blocks.abs().amax(dim=(1, 3), keepdim=True), 448.0)
    return _int8_per_row_whole(((blocks / bs).to(torch.float8_e4m3fn).float() * bs).view(shape), std)


@pytest.mark.parametrize("block_values", [4096, draw.BLOCK_VALUES])
@pytest.mark.parametrize("shape", [(256, 512), (512, 256), (384, 128)], ids=str)
def test_moe_weights_are_the_whole_weight_recipes(shape, block_values, monkeypatch):
    monkeypatch.setattr(draw, "BLOCK_VALUES", block_values)
    codes, scale = moe_fixture.g4(shape, 0.02, 4, "moe", "w", 1)
    ref_codes, ref_scale = _g4_whole(shape, 0.02, 4, "moe", "w", 1)
    assert _same_bits(codes, ref_codes) and _same_bits(scale, ref_scale)
    codes, scale = moe_fixture.g8(shape, 0.01, 0.5, 4, "moe", "s")
    ref_codes, ref_scale = _g8_whole(shape, 0.01, 0.5, 4, "moe", "s")
    assert _same_bits(codes, ref_codes) and _same_bits(scale, ref_scale)
    out = torch.empty(shape, dtype=torch.int8)
    assert moe_fixture.g4(shape, 0.02, 4, "moe", "w", 1, out=out)[0] is out


def test_moe_fixture_does_not_depend_on_the_block_size(monkeypatch):
    case = MoECase(TINY, 2, 11)
    ref = moe_fixture.rank_inputs(case, 1)
    monkeypatch.setattr(draw, "BLOCK_VALUES", 2048)
    small = moe_fixture.rank_inputs(case, 1)
    assert list(small) == list(ref)
    assert [n for n in ref if not _same_bits(small[n], ref[n])] == []


def test_e4m3_rounding_is_the_fp8_cast():
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(100000, generator=g) * s for s in (1e-3, 1.0, 100.0, 448.0)])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-9, 2.0**-10, 1.0625, 1.1875, 3 * 2.0**-10])])
    assert _same_bits(numerics.round_to_e4m3(x), x.to(torch.float8_e4m3fn).to(torch.float32))
