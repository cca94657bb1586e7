"""`topk_pair_compare` (§11.1): top-k indices may differ only where the actual scores tie.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from launcher.verify.base import Comparator, RankFigures, Verdict, base_figures, join_detail, rank_lines, unravel


# -- topk_pair_compare (§11.1) -----------------------------------------------------------------


class TopkPairCompare(Comparator):
    """Index mismatches are legal where the actual scores stay ordered around them (exact)."""

    def __init__(self, vals_name: str, *, dim: int = -1, descending: bool = True, max_show: int = 10,
                 rank_axis: bool = False):
        self.vals_name, self.dim, self.descending, self.max_show, self.rank_axis = (
            vals_name, dim, descending, max_show, rank_axis)
        self.__name__ = "topk_pair_compare"

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        actual_outputs = actual_outputs or {}
        figures = base_figures(actual)
        if self.vals_name not in actual_outputs:
            return self._verdict(False, "config", (f"    compare_fn misconfigured: vals_name='{self.vals_name}' "
                                                   f"not found in actual outputs={list(actual_outputs)}"), figures)
        a_idx, e_idx = actual.cpu(), expected.cpu()
        a_vals = actual_outputs[self.vals_name].cpu().to(torch.float32)
        if a_idx.shape != e_idx.shape:
            return self._verdict(False, "shape", f"    idx shape mismatch: {tuple(a_idx.shape)} vs {tuple(e_idx.shape)}",
                                 figures)
        if a_idx.dtype != e_idx.dtype:
            return self._verdict(False, "dtype", f"    idx dtype mismatch: {a_idx.dtype} vs {e_idx.dtype}", figures)
        if a_idx.shape != a_vals.shape:
            return self._verdict(False, "shape", (f"    idx/vals shape mismatch: idx={tuple(a_idx.shape)} "
                                                  f"vs vals={tuple(a_vals.shape)}"), figures)
        ndim = a_idx.dim()
        dim_pos = self.dim if self.dim >= 0 else self.dim + ndim
        if not 0 <= dim_pos < ndim:
            return self._verdict(False, "config", f"    dim={self.dim} out of range for shape {tuple(a_idx.shape)}",
                                 figures)
        a2 = a_idx.movedim(dim_pos, -1).reshape(-1, a_idx.shape[dim_pos])
        e2 = e_idx.movedim(dim_pos, -1).reshape(-1, a_idx.shape[dim_pos])
        v2 = a_vals.movedim(dim_pos, -1).reshape(-1, a_idx.shape[dim_pos])
        n_rows, k = a2.shape
        mismatch = a2 != e2
        # a mismatch at i is legal iff the actual scores stay ordered with both neighbours
        breaks_order = torch.zeros_like(mismatch)
        if k >= 2:
            pair_broken = (v2[:, :-1] < v2[:, 1:]) if self.descending else (v2[:, :-1] > v2[:, 1:])
            pair_broken |= torch.isnan(v2[:, :-1]) | torch.isnan(v2[:, 1:])  # NaN is never ordered
            breaks_order[:, 1:] |= pair_broken
            breaks_order[:, :-1] |= pair_broken
        fail_mask = mismatch & breaks_order
        n_fail = int(fail_mask.sum())
        figures.update(numel=a_idx.numel(), n_rows=n_rows, k=k, n_mismatch=int(mismatch.sum()), n_bad=n_fail,
                       nan_actual_vals=int(torch.isnan(a_vals).sum()))
        per_rank = self._per_rank(fail_mask, a_idx.shape, dim_pos)
        leading = [d for d in range(ndim) if d != dim_pos]
        lead_shape = [a_idx.shape[d] for d in leading]

        def coord(row: int, pos: int) -> list[int]:
            full = [0] * ndim
            for axis, c in zip(leading, unravel(row, lead_shape)):
                full[axis] = c
            full[dim_pos] = pos
            return full

        fail_rc = fail_mask.nonzero()[: self.max_show].tolist()
        figures["first_bad"] = [
            {"at": coord(r, p), "actual_idx": int(a2[r, p]), "expected_idx": int(e2[r, p]),
             "actual_score": float(v2[r, p]), "window": v2[r, max(0, p - 1): min(k, p + 2)].tolist()}
            for r, p in fail_rc
        ]
        if not n_fail:
            return self._verdict(True, None, "", figures, per_rank)
        order = "descending" if self.descending else "ascending"
        lines = [f"    top-k idx mismatch via '{self.vals_name}' (dim={self.dim} order={order}): "
                 f"{n_fail} position(s) where a_vals breaks {order} order at the mismatch"]
        for (r, p), pt in zip(fail_rc, figures["first_bad"]):
            lo, hi = max(0, p - 1), min(k, p + 2)
            window = ", ".join(f"{v:.6g}" for v in pt["window"])
            lines.append(f"      [{','.join(str(c) for c in pt['at'])}] actual_idx={pt['actual_idx']} "
                         f"expected_idx={pt['expected_idx']} actual_score={pt['actual_score']:.6g} "
                         f"actual_vals[{lo}:{hi}]=[{window}]")
        if n_fail > self.max_show:
            lines.append(f"      ... and {n_fail - self.max_show} more")
        extras = [f"    {figures['n_mismatch']} position-wise idx difference(s) in all, {n_fail} illegal"]
        extras += rank_lines(per_rank)
        return self._verdict(False, "mismatch", join_detail("\n".join(lines), extras), figures, per_rank)

    def _per_rank(self, fail_mask: torch.Tensor, shape: Sequence[int], dim_pos: int) -> list[RankFigures]:
        if self.rank_axis and dim_pos != 0:
            per = fail_mask.view(shape[0], -1)
            return [RankFigures(rank=r, numel=per.shape[1], n_bad=int(n)) for r, n in enumerate(per.sum(dim=1).tolist())]
        return [RankFigures(rank=0, numel=fail_mask.numel(), n_bad=int(fail_mask.sum()))]


def topk_pair_compare(vals_name: str, *, dim: int = -1, descending: bool = True, max_show: int = 10,
                      rank_axis: bool = False) -> TopkPairCompare:
    return TopkPairCompare(vals_name, dim=dim, descending=descending, max_show=max_show, rank_axis=rank_axis)


