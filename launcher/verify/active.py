"""`ActiveRows`: a stage comparator on the rows of the active tokens only (moe.md §13.5).

Bisect judges the MoE layer's intermediates with the spec's masks: gate outputs on the n
active tokens, `routed_y_buf` on their n·K routes (an inactive token's rows are never read and
a device leaves them stale), and the top-k index rows as sets (tie order may differ), the
routing weights moving with their indices. The inner comparator does the judging; this one
only cuts and orders the rows it sees.
"""

from __future__ import annotations

import dataclasses

import torch

from launcher.verify.base import Comparator, Verdict


class ActiveRows(Comparator):
    """`inner` on the first `rows_per_token · n` rows, n = the 0-dim input `active`; with
    `order_by`, each side's rows in the ascending order of its own index rows."""

    def __init__(self, inner: Comparator, output: str, active: str, rows_per_token: int = 1,
                 order_by: str | None = None, rank_axis: bool = False):
        self.inner, self.output, self.active = inner, output, active
        self.rows_per_token, self.order_by, self.axis = rows_per_token, order_by, int(rank_axis)
        self.__name__ = f"{inner.label} on the active rows" + (f", sets of {order_by} rows" if order_by else "")

    def _kept(self, t: torch.Tensor, rows: int, outputs) -> torch.Tensor:
        t = t.narrow(self.axis, 0, min(rows, t.shape[self.axis]))
        if self.order_by is None:
            return t
        key = t if self.order_by == self.output else outputs.get(self.order_by)
        if key is None or key.shape[self.axis] < t.shape[self.axis]:
            return t  # no index rows that pair with these: the inner check sees them as they are
        key = key.narrow(self.axis, 0, t.shape[self.axis])
        if key.shape != t.shape:
            return t
        return torch.gather(t, -1, torch.argsort(key, dim=-1, stable=True))

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        if not inputs or self.active not in inputs:
            return Verdict(False, self.label, f"    the active-token count '{self.active}' is not among the inputs",
                           kind="config", category="contract")
        rows = self.rows_per_token * int(inputs[self.active])
        a = self._kept(actual, rows, actual_outputs or {self.output: actual})
        e = self._kept(expected, rows, expected_outputs or {self.output: expected})
        v = self.inner.evaluate(a, e, inputs=inputs, rtol=rtol, atol=atol)
        return dataclasses.replace(v, label=f"{v.label} on the {rows} active rows"
                                   + (f" (rows of {self.order_by} as sets)" if self.order_by else ""))


__all__ = ["ActiveRows"]
