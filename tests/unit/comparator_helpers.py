"""What the comparator tests share: the call context, a tensor shorthand, the pool and top-k
comparators as the tests build them, and naive, loop-based restatements of the spec's numeric
rules (numpy float32 scalars reproduce torch's fp32 ops with Python-float scalars)."""

from __future__ import annotations

import numpy as np
import torch

from launcher.verify import mapped_pool_ratio_allclose, topk_pair_compare

CTX = dict(actual_outputs={}, expected_outputs={}, inputs={}, rtol=1e-5, atol=1e-5)


def call(cmp, actual, expected, **overrides):
    return cmp(actual, expected, **{**CTX, **overrides})


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# -- naive restatements of the spec ------------------------------------------------------------

f32 = np.float32


def naive_ratio_allclose(a, e, atol, rtol, ratio):
    """§8.2 point by point: (passed, n_bad, threshold)."""
    n_bad = 0
    for x, y in zip(a.flatten().tolist(), e.flatten().tolist()):
        diff = abs(f32(x) - f32(y))
        tol = f32(atol) + f32(rtol) * abs(f32(y))
        n_bad += bool(diff > tol)
    threshold = round(ratio * a.numel())
    return n_bad <= threshold, n_bad, threshold


def naive_reldiff(a, e, diff_thd, pct_thd, cap):
    """§10.2 point by point: (passed, n_bad, worst rdiff)."""
    floor = f32((1.0 / 2**14) / diff_thd)
    n_bad, worst = 0, 0.0
    for x, y in zip(a.flatten().tolist(), e.flatten().tolist()):
        x, y = f32(x), f32(y)
        diff = abs(x - y)
        if diff < f32(diff_thd):
            rdiff = diff
        else:
            rdiff = diff / (max(abs(x), abs(y), floor) + f32(1e-9))
        if rdiff > f32(diff_thd):
            n_bad += 1
            worst = max(worst, float(rdiff))
    return n_bad <= round(pct_thd * a.numel()) and worst < cap, n_bad, worst


def naive_pool(actual, expected, mapping, block_size, atol, rtol, ratio):
    """§9.2 for a ranked pool with loops: stray rows per rank and the pooled numeric verdict."""
    ranks = actual.shape[0]
    rows = actual.shape[1] * block_size
    a = actual.reshape(ranks, rows, -1).tolist()
    e = expected.reshape(ranks, rows, -1).tolist()
    strays = {r: [] for r in range(ranks)}
    bad_by_rank = {r: 0 for r in range(ranks)}
    numel = 0
    for r in range(ranks):
        written = {m for m in mapping[r].tolist() if m >= 0}
        for row in range(rows):
            if row in written:
                for x, y in zip(a[r][row], e[r][row]):
                    numel += 1
                    bad_by_rank[r] += bool(abs(f32(x) - f32(y)) > f32(atol) + f32(rtol) * abs(f32(y)))
            elif any(not (x == y) for x, y in zip(a[r][row], e[r][row])):
                strays[r].append(row)
    n_bad = sum(bad_by_rank.values())
    passed = not any(strays.values()) and n_bad <= round(ratio * numel)
    return passed, strays, bad_by_rank


# -- the pool and top-k comparators as the tests call them -------------------------------------


def pool_cmp(mapping_shape, block_size=2, ranked=False, **kwargs):
    kwargs = {"atol": 0.0, "rtol": 0.0, "max_error_ratio": 0.0, **kwargs}
    return mapped_pool_ratio_allclose("m", mapping_shape=mapping_shape, block_size=block_size,
                                      leading_rank_axis=ranked, **kwargs)


def pool_call(cmp, actual, expected, mapping, **inputs):
    return cmp(actual, expected, actual_outputs={}, expected_outputs={}, inputs={"m": mapping, **inputs},
               rtol=0.0, atol=0.0)


def topk(idx_a, idx_e, vals, **kwargs):
    cmp = topk_pair_compare("vals", **kwargs)
    return cmp(t(idx_a, torch.int64), t(idx_e, torch.int64),
               actual_outputs={"vals": vals if isinstance(vals, torch.Tensor) else t(vals)},
               expected_outputs={}, inputs={}, rtol=1e-5, atol=1e-5)
