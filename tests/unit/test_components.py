"""The shared front-end components against loop-based re-statements of components.md §2–§8.

Exact re-statements (the spec fixes every operation and its order) are compared bitwise:
the cube emulation, the RoPE rotations, hc_post, the token-local RoPE rows. Where the spec
leaves a reduction order to torch (softmax, means, GEMMs), the re-statement runs in fp64 and
the comparison allows one bf16 ulp on a small fraction of elements. Each re-statement is also
shown to reject a plausible wrong variant (transposed comb, NeoX rotation, gamma after RoPE).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from layers.contract.config import FLASH, MINI, TINY
from layers.components.hc import a2a3_cube_linear, hc_post, hc_pre
from layers.components.numerics import bf16, int8_quant_per_row, quant_weight_int8
from layers.components.qkv import qkv_proj_rope, rms_norm
from layers.components.rope import apply_inverse_rope, apply_rope, inv_freq, precompute_freqs_cos_sin, rope_profile, rope_rows

from ..conftest import REFERENCE_DATA, REPO, reference_snapshot


# Real hc scale/base vectors (§3.6): layer-8 standalone and the SWA layer-0 values (whose comb
# logits reach −30, far from a uniform Sinkhorn input).
HC_LAYER8 = (
    [0.075997, 0.032345, 0.226238],
    [5.9169, -3.6226, -2.9309, -3.3122, -3.9082, -0.9381, -3.3257, -2.5300, 2.0703, -2.5724, 0.1430, -3.9461,
     -3.8868, 3.4623, -3.3815, -2.6056, -2.7185, -2.4849, 2.0391, -0.4999, -3.5994, -2.7508, -3.3496, 3.1573],
)
HC_SWA0 = (
    [2.076026, 0.018729, 0.245936],
    [3.9083, -2.0399, -2.2033, -2.017, -2.4443, -10.3158, -8.9943, -6.3581, 9.8577, -9.5177, -24.8724, -22.8929,
     -21.545, 0.7791, -3.386, 1.1948, -20.9605, -0.7702, 1.4218, -4.8994, 1.5177, -29.7663, -30.1413, -1.2413],
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- naive helpers ---------------------------------------------------------------------------


def np_bf16(v) -> np.ndarray:
    """Round fp32 values to bf16 (nearest, ties to even) by bit manipulation, as fp32."""
    bits = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def assert_bf16_close(actual: torch.Tensor, expected: np.ndarray, min_exact: float = 0.99) -> None:
    """Every element within one bf16 ulp of an fp64 re-statement, and most of them equal."""
    a = actual.float().numpy().astype(np.float64)
    e = np_bf16(np.asarray(expected, dtype=np.float32)).astype(np.float64)
    ulp = np.maximum(np.abs(e), 1e-30) * 2.0**-7
    assert np.all(np.abs(a - e) <= ulp + 1e-30), f"max excess {np.max(np.abs(a - e) - ulp)}"
    assert np.mean(a == e) >= min_exact, f"only {np.mean(a == e):.4f} identical"


def naive_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Interleaved rotation of x [T, ..., R] (fp32) element by element, each result bf16."""
    x = np.asarray(x, dtype=np.float32)
    out = np.empty_like(x)
    r = x.shape[-1]
    for idx in np.ndindex(*x.shape[:-1]):
        t = idx[0]
        for i in range(r // 2):
            e, o = x[idx + (2 * i,)], x[idx + (2 * i + 1,)]
            c, s = np.float32(cos[t, i]), np.float32(sin[t, i])
            if inverse:
                out[idx + (2 * i,)], out[idx + (2 * i + 1,)] = e * c + o * s, o * c - e * s
            else:
                out[idx + (2 * i,)], out[idx + (2 * i + 1,)] = e * c - o * s, e * s + o * c
    return np_bf16(out)


def naive_cube_linear(xf: np.ndarray, w: np.ndarray, rows) -> np.ndarray:
    """§3.3 literally: per (t, m, split), fp64 sums of 4 products added group by group, fp32 rounded."""
    k = xf.shape[1]
    ks, out = k // 4, np.zeros((len(rows), w.shape[0]), dtype=np.float32)
    for ti, t in enumerate(rows):
        for m in range(w.shape[0]):
            parts = []
            for s in range(4):
                acc = 0.0
                for g in range(ks // 4):
                    k0 = s * ks + 4 * g
                    p = sum(float(xf[t, k0 + c]) * float(w[m, k0 + c]) for c in range(4))
                    acc = float(np.float32(acc + p))
                parts.append(np.float32(acc))
            out[ti, m] = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    return out


def naive_sinkhorn(c: np.ndarray, iters: int, eps: float) -> np.ndarray:
    c = np.exp(c - c.max(axis=1, keepdims=True))
    c = c / c.sum(axis=1, keepdims=True) + eps
    c = c / (c.sum(axis=0, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=1, keepdims=True) + eps)
        c = c / (c.sum(axis=0, keepdims=True) + eps)
    return c


def naive_hc_pre(x: np.ndarray, fn: np.ndarray, scale, base, model, transpose_comb: bool = False):
    t, hc, d = x.shape
    xf = x.reshape(t, hc * d)
    mixes_raw = naive_cube_linear(xf, fn, range(t)).astype(np.float64)
    post, comb, y = [], [], []
    for ti in range(t):
        ssq = sum(float(np.sum(xf[ti, k0 : k0 + 512].astype(np.float64) ** 2)) for k0 in range(0, hc * d, 512))
        mix = mixes_raw[ti] / math.sqrt(ssq / (hc * d) + model.rms_norm_eps)
        sig = lambda v: 1.0 / (1.0 + np.exp(-v))  # noqa: E731
        p = sig(mix[:4] * scale[0] + np.asarray(base[:4])) + model.hc_eps
        post.append(2 * sig(mix[4:8] * scale[1] + np.asarray(base[4:8])))
        logits = (mix[8:] * scale[2] + np.asarray(base[8:])).reshape(4, 4)
        if transpose_comb:
            logits = logits.T
        comb.append(naive_sinkhorn(logits, model.hc_sinkhorn_iters, model.hc_eps).reshape(16))
        xs = x[ti].astype(np.float64)
        y.append((xs[0] * p[0] + xs[1] * p[1]) + (xs[2] * p[2] + xs[3] * p[3]))
    return np.array(y), np.array(post), np.array(comb)


def naive_hc_post(x: np.ndarray, residual: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    t, hc, d = residual.shape
    y = np.zeros((t, hc, d), dtype=np.float32)
    for ti in range(t):
        for o in range(hc):
            acc = x[ti].astype(np.float32) * np.float32(post[ti, o])
            for i in range(hc):
                acc = acc + residual[ti, i] * np.float32(comb[ti, hc * i + o])
            y[ti, o] = acc
    return y


def naive_qkv(x, wq_a, wq_b, wq_b_scale, wkv, cos, sin, gamma_cq, gamma_ckv, model, rope_mode="interleaved", gamma_after=False):
    """§6.2–§6.4 token by token in fp64; returns fp64 q/kv (pre-bf16), int qr and qr_scale."""
    h, hd, n, r = model.num_attention_heads, model.head_dim, model.nope_head_dim, model.qk_rope_head_dim
    eps = model.rms_norm_eps
    f64 = lambda v: v.double().numpy()  # noqa: E731
    xs, wa, wb, wk = f64(x), f64(wq_a), wq_b.numpy().astype(np.int64), f64(wkv)
    cq, ckv, bscale = f64(gamma_cq), f64(gamma_ckv), f64(wq_b_scale)
    c, s = f64(cos)[:, : r // 2], f64(sin)[:, : r // 2]

    def rot(v, t):  # v [..., R]
        out = np.empty_like(v)
        if rope_mode == "interleaved":
            e, o = v[..., 0::2], v[..., 1::2]
            out[..., 0::2], out[..., 1::2] = e * c[t] - o * s[t], e * s[t] + o * c[t]
        else:  # NeoX half split: a plausible wrong layout
            e, o = v[..., : r // 2], v[..., r // 2 :]
            out[..., : r // 2], out[..., r // 2 :] = e * c[t] - o * s[t], e * s[t] + o * c[t]
        return out

    q, kv, qr, qr_scale = [], [], [], []
    for t in range(xs.shape[0]):
        a = xs[t] @ wa
        qr_f = a / math.sqrt(np.mean(a * a) + eps) * cq
        amax = max(np.max(np.abs(qr_f)), 1e-4)
        sq = np.float32(127.0) / np.float32(amax)
        qi = np.round(qr_f * sq).astype(np.int64)  # numpy rounds half to even
        qr.append(qi)
        qr_scale.append(1.0 / sq)
        qf = (qi @ wb).astype(np.float64) * float(1.0 / sq) * bscale
        qf = qf.reshape(h, hd)
        qf = qf / np.sqrt(np.mean(qf * qf, axis=-1, keepdims=True) + eps)
        qf[:, n:] = rot(qf[:, n:], t)
        q.append(qf)
        k = xs[t] @ wk
        k = k / math.sqrt(np.mean(k * k) + eps)
        if gamma_after:
            k[n:] = rot(k[n:], t)
            k = k * ckv
        else:
            k = k * ckv
            k[n:] = rot(k[n:], t)
        kv.append(k)
    return np.array(q), np.array(kv), np.array(qr), np.array(qr_scale)


# -- §2 int8 quantization examples -----------------------------------------------------------


def test_int8_quant_per_row_examples():
    q, scale = int8_quant_per_row(torch.tensor([[1.0, -2.0, 0.5], [3e-5, -1e-5, 0.0], [0.0, 0.0, 0.0]]))
    assert q.dtype == torch.int8 and scale.shape == (3, 1) and scale.dtype == torch.float32
    assert q.tolist() == [[64, -127, 32], [38, -13, 0], [0, 0, 0]]  # 63.5 -> 64 half-even
    assert scale[0, 0].item() == 0.015748031437397003
    assert scale[1, 0].item() == scale[2, 0].item() == 7.874015750530816e-07


def test_weight_quant_per_row_example():
    q, scale = quant_weight_int8(torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0]]), axis=-1)
    assert q.tolist() == [[127, -64, 32], [0, 0, 0]]  # -63.5 -> -64
    assert torch.allclose(scale, torch.tensor([0.007874016, 7.874e-07]), rtol=1e-4, atol=0)


# -- §8.11 RoPE / YaRN tables -----------------------------------------------------------------


def test_inv_freq_reference_values():
    swa = inv_freq(64, 0, FLASH.rope_theta, FLASH.rope_factor, FLASH.beta_fast, FLASH.beta_slow)
    assert swa.dtype == torch.float32
    assert swa[:2].tolist() == pytest.approx([1.0, 0.7498942], rel=1e-7)
    assert swa[31].item() == pytest.approx(1.3335e-4, rel=1e-4)
    plain = inv_freq(64, 0, FLASH.compress_rope_theta, FLASH.rope_factor, 32, 1)
    assert plain[:3].tolist() == pytest.approx([1.0, 0.68765604, 0.4728708], rel=1e-7)
    assert plain[31].item() == pytest.approx(9.0888e-6, rel=1e-4)
    base, original = rope_profile(FLASH, 4)
    assert (base, original) == (160000.0, 65536) and rope_profile(FLASH, 0) == (10000.0, 0)
    yarn = inv_freq(64, original, base, FLASH.rope_factor, FLASH.beta_fast, FLASH.beta_slow)
    assert yarn[15].item() == plain[15].item() == pytest.approx(3.6355385e-3, rel=1e-7)
    assert yarn[16].item() == pytest.approx(2.2656249e-3, rel=1e-7)
    assert yarn[31].item() == pytest.approx(5.6805294e-7, rel=1e-7)
    cos, _ = rope_rows(FLASH, torch.tensor([8192]), 4, dtype="fp32")
    assert cos[0, :4].tolist() == pytest.approx([0.29280183, -0.9200092, -0.98493016, 0.96694654], rel=1e-7)


@pytest.mark.parametrize("dim,low,high", [(16, 3, 7), (32, 7, 13), (64, 15, 25)])
def test_yarn_correction_range(dim, low, high):
    plain = inv_freq(dim, 0, 160000.0, 16.0, 32, 1)
    yarn = inv_freq(dim, 65536, 160000.0, 16.0, 32, 1)
    for i in range(dim // 2):
        if i <= low:
            assert yarn[i] == plain[i]
        elif i >= high:
            assert yarn[i] == plain[i] / 16
        else:
            assert plain[i] / 16 < yarn[i] < plain[i]


def test_tables_match_naive_formula():
    dim, seqlen = 16, 300
    cos, sin = precompute_freqs_cos_sin(dim, seqlen, 65536, 160000.0, 16.0, 32, 1, dtype=torch.float32)
    assert cos.shape == sin.shape == (seqlen, dim)
    cd = lambda r: dim * math.log(65536 / (r * 2 * math.pi)) / (2 * math.log(160000.0))  # noqa: E731
    low, high = max(math.floor(cd(32)), 0), min(math.ceil(cd(1)), dim - 1)
    for p in range(0, seqlen, 37):
        for i in range(dim // 2):
            inv = 1.0 / 160000.0 ** (2 * i / dim)
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            inv = inv / 16 * ramp + inv * (1 - ramp)
            # fp32 angles (P7) carry ~1e-7 relative error of the angle itself.
            tol = 2e-6 + 3e-7 * p * inv
            for col in (i, i + dim // 2):  # the second half duplicates the first
                assert cos[p, col].item() == pytest.approx(math.cos(p * inv), abs=tol)
                assert sin[p, col].item() == pytest.approx(math.sin(p * inv), abs=tol)


def test_table_arguments_validated():
    for bad_dim in (0, 7, -2):
        with pytest.raises(ValueError, match="dim"):
            precompute_freqs_cos_sin(bad_dim, 4, 0, 1e4, 16.0, 32, 1)
    with pytest.raises(ValueError, match="seqlen"):
        precompute_freqs_cos_sin(8, 0, 0, 1e4, 16.0, 32, 1)
    with pytest.raises(ValueError, match="dtype"):
        precompute_freqs_cos_sin(8, 4, 0, 1e4, 16.0, 32, 1, dtype="int8")
    for name, dtype in (("BF16", torch.bfloat16), ("float32", torch.float32), ("torch.float16", torch.float16)):
        assert precompute_freqs_cos_sin(8, 4, 0, 1e4, 16.0, 32, 1, dtype=name)[0].dtype == dtype


@pytest.mark.parametrize("ratio", [0, 4])
def test_token_rows_equal_full_table_rows(ratio):
    base, original = rope_profile(FLASH, ratio)
    full_cos, full_sin = precompute_freqs_cos_sin(64, 16384, original, base, FLASH.rope_factor, FLASH.beta_fast, FLASH.beta_slow)
    g = gen(ratio)
    for positions in (
        torch.arange(8189, 8196),
        torch.randint(0, 16384, (100,), generator=g),
        torch.randint(0, 16384, (1000,), generator=g),
        torch.tensor([[16383, 0, 1], [127, 128, 8192]], dtype=torch.int32),
    ):
        cos, sin = rope_rows(FLASH, positions, ratio)
        flat = positions.reshape(-1).long()
        assert torch.equal(cos, full_cos[flat]) and torch.equal(sin, full_sin[flat])


def test_rope_rows_reproduce_snapshots():
    """The snapshots' token rows (SWA plain profile, HCA compressed + YaRN), the HCA
    compressed-block rows and the CSA full table, bit for bit."""
    for layer, ratio in (("swa", 0), ("hca", 128)):
        snap = reference_snapshot(layer)
        load = lambda n, snap=snap: torch.load(snap / "in" / f"{n}.pt", weights_only=True)  # noqa: E731
        for r in range(2):
            cos, sin = rope_rows(MINI, load("position_ids")[r], ratio)
            assert torch.equal(cos, load("freqs_cos")[r]) and torch.equal(sin, load("freqs_sin")[r])
    snap = reference_snapshot("hca")
    starts = torch.load(snap / "in" / "position_ids.pt", weights_only=True)[0].view(-1, MINI.decode_seq)[:, 0]
    batch = starts.numel()
    cos, sin = rope_rows(MINI, starts - starts % 128, 128)
    half = MINI.qk_rope_head_dim // 2
    assert torch.equal(cos[:, :half].float(), torch.load(snap / "in" / "cmp_freqs_cos.pt", weights_only=True)[0, :batch])
    assert torch.equal(sin[:, :half].float(), torch.load(snap / "in" / "cmp_freqs_sin.pt", weights_only=True)[0, :batch])
    snap = reference_snapshot("csa")
    base, original = rope_profile(MINI, 4)
    cos, sin = precompute_freqs_cos_sin(MINI.qk_rope_head_dim, MINI.max_position_embeddings, original, base, MINI.rope_factor,
                                        MINI.beta_fast, MINI.beta_slow)
    assert torch.equal(cos, torch.load(snap / "in" / "freqs_cos.pt", weights_only=True)[0])
    assert torch.equal(sin, torch.load(snap / "in" / "freqs_sin.pt", weights_only=True)[0])


# -- §6.4 rotations ---------------------------------------------------------------------------


def test_apply_rope_matches_naive():
    g = gen(1)
    t, h, r = 5, 3, 16
    x = torch.randn(t, h, r, generator=g)
    cos, sin = rope_rows(TINY, torch.tensor([0, 3, 127, 8192, 16383]), 4)
    got = apply_rope(x, cos, sin)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h, r)
    want = naive_rope(x.numpy(), cos.float().numpy(), sin.float().numpy())
    assert np.array_equal(got.float().numpy(), want)
    inv = apply_inverse_rope(x, cos, sin)
    assert np.array_equal(inv.float().numpy(), naive_rope(x.numpy(), cos.float().numpy(), sin.float().numpy(), inverse=True))
    assert not torch.equal(inv, got)  # the inverse is a different rotation (wrong sign is caught)
    # Inverse undoes forward up to the bf16 roundings.
    assert torch.allclose(apply_inverse_rope(got.float(), cos, sin).float(), x, atol=2e-2, rtol=2e-2)


def test_apply_rope_reads_only_first_half_of_rows():
    g = gen(2)
    x = torch.randn(4, 2, 8, generator=g)
    cos, sin = torch.rand(4, 8, generator=g), torch.rand(4, 8, generator=g)  # random, not trigonometric
    junk_cos, junk_sin = cos.clone(), sin.clone()
    junk_cos[:, 4:], junk_sin[:, 4:] = 9.0, -9.0
    ref = apply_rope(x, cos, sin)
    assert torch.equal(apply_rope(x, junk_cos, junk_sin), ref)
    assert torch.equal(apply_rope(x, cos[:, :4], sin[:, :4]), ref)  # half-width rows
    assert torch.equal(apply_rope(x[:, 0], cos, sin), ref[:, 0])  # no head axis
    with pytest.raises(ValueError, match="rope rows"):
        apply_rope(x, cos[:3], sin[:3])


# -- §3 hc_pre, §4 hc_post ----------------------------------------------------------------------


def test_cube_linear_matches_naive_emulation():
    """Bitwise, at a K with a partial 64-group block and a T that crosses the token tile."""
    g = gen(3)
    t, k = 345, 16 * 80
    xf = torch.empty(t, k).uniform_(-1, 1, generator=g)
    w = torch.randn(24, k, generator=g) * 0.05
    got = a2a3_cube_linear(xf, w)
    rows = [0, 1, 340, 341, 344]
    want = naive_cube_linear(xf.numpy(), w.numpy(), rows)
    assert np.array_equal(got[rows].numpy(), want)
    assert not torch.equal(got[rows], (xf @ w.T)[rows])  # the emulation is not a plain fp32 GEMM


@pytest.mark.parametrize("hc_vectors", [HC_LAYER8, HC_SWA0], ids=["layer8", "swa_layer0"])
def test_hc_pre_matches_naive(hc_vectors):
    g = gen(4)
    m = TINY
    t = 6
    x = torch.empty(t, 4, m.hidden_size).uniform_(-1, 1, generator=g)
    fn = torch.randn(m.mix_hc, m.hc_dim, generator=g) * 0.039
    scale, base = torch.tensor(hc_vectors[0]), torch.tensor(hc_vectors[1])
    x_mixed, post, comb = hc_pre(x, fn, scale, base, m)
    assert (x_mixed.dtype, post.dtype, comb.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert x_mixed.shape == (t, m.hidden_size) and post.shape == (t, 4) and comb.shape == (t, 16)
    y, post_n, comb_n = naive_hc_pre(x.numpy(), fn.numpy(), hc_vectors[0], hc_vectors[1], m)
    assert np.allclose(post.numpy(), post_n, rtol=1e-5, atol=1e-7)
    assert np.allclose(comb.numpy(), comb_n, rtol=1e-5, atol=1e-7)
    assert_bf16_close(x_mixed, y, min_exact=0.995)
    # Columns are normalized last (≈ 1); a transposed comb is a different, plausible answer (P2).
    assert np.allclose(comb.view(t, 4, 4).sum(1).numpy(), 1.0, atol=1e-5)
    _, _, comb_t = naive_hc_pre(x.numpy(), fn.numpy(), hc_vectors[0], hc_vectors[1], m, transpose_comb=True)
    assert not np.allclose(comb.numpy(), comb_t, rtol=1e-3, atol=1e-4)


def test_hc_pre_rejects_other_stream_counts():
    with pytest.raises(ValueError, match="4 streams"):
        hc_pre(torch.zeros(2, 2, 8), torch.zeros(8, 16), torch.zeros(3), torch.zeros(8), TINY)


def test_hc_post_matches_naive():
    g = gen(5)
    t, d = 5, TINY.hidden_size
    x = bf16(torch.randn(t, d, generator=g) * 0.05)
    residual = torch.randn(t, 4, d, generator=g) * 0.05
    post = 2 * torch.sigmoid(torch.randn(t, 4, generator=g))
    c = torch.rand(t, 4, 4, generator=g) + 0.1
    comb = (c / c.sum(-1, keepdim=True)).reshape(t, 16)
    y = hc_post(x, residual, post, comb)
    assert y.dtype == torch.float32 and y.shape == (t, 4, d)
    args = (x.float().numpy(), residual.numpy(), post.numpy())
    assert np.array_equal(y.numpy(), naive_hc_post(*args, comb.numpy()))
    transposed = comb.view(t, 4, 4).transpose(1, 2).reshape(t, 16).numpy()
    assert not np.allclose(y.numpy(), naive_hc_post(*args, transposed), rtol=1e-3, atol=1e-3)


# -- §5 RMSNorm, §6 qkv_proj_rope --------------------------------------------------------------


def test_rms_norm_matches_naive():
    g = gen(6)
    x = bf16(torch.randn(7, TINY.hidden_size, generator=g) - 0.5)
    w = bf16(torch.randn(TINY.hidden_size, generator=g) * 0.1 + 1.0)
    out = rms_norm(x, w, TINY.rms_norm_eps)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    xs = x.double().numpy()
    want = xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + TINY.rms_norm_eps) * w.double().numpy()
    assert_bf16_close(out, want)


def _qkv_inputs(model, t, seed):
    g = gen(seed)
    d, ql, h, hd, r = model.hidden_size, model.q_lora_rank, model.num_attention_heads, model.head_dim, model.qk_rope_head_dim
    u = lambda shape, lo, hi: bf16(torch.empty(shape).uniform_(lo, hi, generator=g))  # noqa: E731
    wq_b, wq_b_scale = quant_weight_int8(u((ql, h * hd), -0.1, 0.1), axis=0)
    x = u((t, d), -1, 1)
    wq_a, wkv = u((d, ql), -0.1, 0.1), u((d, hd), -0.1, 0.1)
    cos, sin = u((t, r), -1, 1), u((t, r), -1, 1)  # random rows, as the standalone fixture (§6.6)
    gamma_cq, gamma_ckv = u((ql,), -1, 1), u((hd,), -1, 1)
    return x, wq_a, wq_b, wq_b_scale, wkv, cos, sin, gamma_cq, gamma_ckv


def test_qkv_proj_rope_matches_naive():
    m, t = TINY, 6
    args = _qkv_inputs(m, t, 7)
    q, kv, qr, qr_scale = qkv_proj_rope(*args, m)
    h, hd, ql = m.num_attention_heads, m.head_dim, m.q_lora_rank
    assert (q.shape, kv.shape, qr.shape, qr_scale.shape) == ((t, h, hd), (t, hd), (t, ql), (t, 1))
    assert (q.dtype, kv.dtype, qr.dtype, qr_scale.dtype) == (torch.bfloat16, torch.bfloat16, torch.int8, torch.float32)
    q_n, kv_n, qr_n, scale_n = naive_qkv(*args, m)
    assert np.max(np.abs(qr.numpy().astype(np.int64) - qr_n)) <= 1 and np.mean(qr.numpy() == qr_n) > 0.99
    assert np.allclose(qr_scale.numpy()[:, 0], scale_n, rtol=1e-6, atol=0)
    assert_bf16_close(q, q_n)
    assert_bf16_close(kv, kv_n)
    # The re-statement rejects a half-split (NeoX) rotation and gamma applied after RoPE (P4, P6).
    q_neox, kv_neox, _, _ = naive_qkv(*args, m, rope_mode="neox")
    with pytest.raises(AssertionError):
        assert_bf16_close(q, q_neox)
    _, kv_late, _, _ = naive_qkv(*args, m, gamma_after=True)
    with pytest.raises(AssertionError):
        assert_bf16_close(kv, kv_late)


# -- the chain on the reference snapshot --------------------------------------------------------


def _swa_rank0():
    snap = reference_snapshot("swa")
    return {p.stem: torch.load(p, weights_only=True)[0] for p in (snap / "in").glob("*.pt") if p.stem != "local_t"}


def test_chain_on_swa_snapshot_shapes():
    x = _swa_rank0()
    m = MINI
    t = x["x_hc"].shape[0]
    x_mixed, post, comb = hc_pre(x["x_hc"], x["hc_attn_fn"], x["hc_attn_scale"], x["hc_attn_base"], m)
    x_normed = rms_norm(x_mixed, x["attn_norm_w"], m.rms_norm_eps)
    q, kv, qr, qr_scale = qkv_proj_rope(
        x_normed, x["wq_a"], x["wq_b"], x["wq_b_scale"], x["wkv"], x["freqs_cos"], x["freqs_sin"],
        x["gamma_cq"], x["gamma_ckv"], m,
    )
    expect = {
        "x_mixed": (x_mixed, (t, m.hidden_size), torch.bfloat16),
        "post": (post, (t, 4), torch.float32),
        "comb": (comb, (t, 16), torch.float32),
        "x_normed": (x_normed, (t, m.hidden_size), torch.bfloat16),
        "q": (q, (t, m.num_attention_heads, m.head_dim), torch.bfloat16),
        "kv": (kv, (t, m.head_dim), torch.bfloat16),
        "qr": (qr, (t, m.q_lora_rank), torch.int8),
        "qr_scale": (qr_scale, (t, 1), torch.float32),
    }
    for name, (value, shape, dtype) in expect.items():
        assert value.shape == shape and value.dtype == dtype, name
        assert torch.isfinite(value.float()).all(), name


# The reference's fp32 GEMMs ran through MKL's AVX2 strict code path; MKL reads MKL_CBWR
# once, at its first GEMM, so the bitwise check runs in a fresh interpreter.
_KV_ROWS_SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(2)
from pathlib import Path
from layers.contract.config import MINI
from layers.components.hc import hc_pre
from layers.components.qkv import qkv_proj_rope, rms_norm
data = Path(sys.argv[1])
bad = {}
for layer, mapping in (("swa", "swa_slot_mapping"), ("hca", "ori_slot_mapping"), ("csa", "ori_slot_mapping")):
    snap = data / f"{layer}-tp2-mini"
    load = lambda name, part="in": torch.load(snap / part / f"{name}.pt", weights_only=True)
    x = {n: load(n) for n in ("x_hc", "hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm_w", "wq_a", "wq_b",
                             "wq_b_scale", "wkv", "gamma_cq", "gamma_ckv", "freqs_cos", "freqs_sin", "position_ids", mapping)}
    cache = load("kv_cache", "out")
    for r in range(2):
        g = {n: v[r] for n, v in x.items()}
        cos, sin = g["freqs_cos"], g["freqs_sin"]
        if cos.shape[0] != g["position_ids"].shape[0]:  # CSA ships the full table
            cos, sin = cos[g["position_ids"].long()], sin[g["position_ids"].long()]
        xm, _, _ = hc_pre(g["x_hc"], g["hc_attn_fn"], g["hc_attn_scale"], g["hc_attn_base"], MINI)
        xn = rms_norm(xm, g["attn_norm_w"], MINI.rms_norm_eps)
        _, kv, _, _ = qkv_proj_rope(xn, g["wq_a"], g["wq_b"], g["wq_b_scale"], g["wkv"], cos, sin,
                                    g["gamma_cq"], g["gamma_ckv"], MINI)
        written = cache[r].reshape(-1, MINI.head_dim)[g[mapping]]
        bad[f"{layer}/rank{r}"] = int((written != kv).sum())
print(json.dumps(bad))
"""


@pytest.mark.slow  # a fresh interpreter
def test_chain_kv_bitwise_on_snapshots():
    """The kv rows each step wrote into the snapshots' caches equal hc_pre → rms_norm →
    qkv_proj_rope of the snapshot inputs, bit for bit (MKL's AVX2 strict GEMM path)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), MKL_CBWR="AVX2,STRICT")
    proc = subprocess.run(
        [sys.executable, "-c", _KV_ROWS_SCRIPT, str(REFERENCE_DATA)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    bad = json.loads(proc.stdout.strip().splitlines()[-1])
    assert bad and all(v == 0 for v in bad.values()), bad
