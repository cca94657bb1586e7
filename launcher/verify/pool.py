"""`mapped_pool_ratio_allclose` (§9): a block-major cache or state pool compared only where the
step's slot mapping wrote, every other row exactly, with the stray rows located and (given the
pool before the step) attributed to the side that changed them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from launcher.verify.base import (
    MAX_EXAMPLES,
    Comparator,
    Judgement,
    Locate,
    RankFigures,
    Verdict,
    base_figures,
    join_detail,
    mismatch_verdict,
    pooled_note,
    rank_lines,
    unravel,
)
from launcher.verify.ratio import RatioAllclose

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


# -- mapped_pool_ratio_allclose (§9) -----------------------------------------------------------


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def unchanged_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Rows of `[n, W]` tensors holding the same bits (a NaN left in place is unchanged).

    Bitwise, as "did this side write the row" is about storage; viewed as int64 words where
    the row's bytes allow it, so a whole pool is compared in a few milliseconds. The differing
    words of a row are counted rather than `all(dim=1)` taken: torch's boolean reduction over
    a short row is 2.4 times slower.
    """
    bx, by = x.contiguous().view(_BITS[x.element_size()]), y.contiguous().view(_BITS[y.element_size()])
    if bx.shape[1] * bx.element_size() % 8 == 0:
        bx, by = bx.view(torch.int64), by.view(torch.int64)
    return torch.count_nonzero(bx != by, dim=1) == 0


# which side's bits differ from the initial pool; index = actual_changed + 2 * expected_changed
_SIDES = ("neither", "actual", "expected", "both")


class MappedPoolRatioAllclose(Comparator):
    """A block-major pool compared only where the step's slot mapping wrote (§9.2).

    Unmapped rows must be exactly equal (`==`); mapped rows of all ranks share one
    ratio_allclose budget. `initial_name` names the `inputs` entry holding the pool before the
    step (optional, diagnostics only: it never changes the verdict).
    """

    def __init__(self, mapping_name: str, *, mapping_shape: Sequence[int], block_size: int,
                 leading_rank_axis: bool = False, pool_name: str = "pool", atol: float | None = None,
                 rtol: float | None = None, max_error_ratio: float = 0.005, initial_name: str | None = None):
        mapping_shape = tuple(mapping_shape)
        if not mapping_shape or any(d <= 0 for d in mapping_shape):
            raise ValueError(f"mapping_shape must contain positive dimensions, got {mapping_shape}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if leading_rank_axis and len(mapping_shape) < 2:
            raise ValueError("leading_rank_axis requires mapping_shape to include a rank axis "
                             f"and at least one mapped-item axis, got {mapping_shape}")
        self.numeric = RatioAllclose(atol=atol, rtol=rtol, max_error_ratio=max_error_ratio)
        self.mapping_name, self.mapping_shape, self.block_size = mapping_name, mapping_shape, block_size
        self.leading_rank_axis, self.pool_name, self.initial_name = leading_rank_axis, pool_name, initial_name
        self.__name__ = (f"mapped_pool_ratio_allclose(mapping={mapping_name}, shape={mapping_shape}, "
                         f"block_size={block_size}, leading_rank_axis={leading_rank_axis}, "
                         f"atol={atol}, rtol={rtol}, max_error_ratio={max_error_ratio})")

    def evaluate(self, actual, expected, *, inputs=None, actual_outputs=None, expected_outputs=None,
                 rtol=1e-5, atol=1e-5) -> Verdict:
        inputs = inputs or {}
        mismatch = mismatch_verdict(self, actual, expected, f"{self.pool_name} ")
        if mismatch:
            return mismatch
        figures = {**base_figures(actual), "pool": self.pool_name, "mapping": self.mapping_name}
        fail = lambda kind, text: self._verdict(False, kind, text, figures)  # noqa: E731
        ranked, bs, name = self.leading_rank_axis, self.block_size, self.mapping_name
        block_axis = 2 if ranked else 1
        if actual.dim() < block_axis + 1 or actual.shape[block_axis] != bs:
            layout = "[ranks, blocks, block_size, ...]" if ranked else "[blocks, block_size, ...]"
            return fail("layout", f"    expected block-major {self.pool_name} layout {layout} with "
                                  f"block_size={bs}, got {tuple(actual.shape)}")
        mapping = inputs.get(name)
        if mapping is None:
            return fail("config", f"    compare_fn misconfigured: missing input '{name}'")
        if mapping.dtype not in _INTEGER_DTYPES:
            return fail("mapping", f"    '{name}' must have an integer dtype, got {mapping.dtype}")
        if tuple(mapping.shape) != self.mapping_shape:
            return fail("mapping", f"    '{name}' must have shape {self.mapping_shape}, got {tuple(mapping.shape)}")
        n_ranks = self.mapping_shape[0] if ranked else 1
        if ranked and actual.shape[0] != n_ranks:
            return fail("layout", f"    leading rank count of {self.pool_name} must be {n_ranks}, got {actual.shape[0]}")
        rows = actual.shape[block_axis - 1] * bs
        a_rows = actual.cpu().reshape(n_ranks * rows, -1)
        e_rows = expected.cpu().reshape(n_ranks * rows, -1)
        width = a_rows.shape[1]
        m = mapping.cpu().to(torch.int64).reshape(n_ranks, -1)
        figures.update(row_width=width, rows_per_rank=rows)

        def loc(r: int, i: int) -> str:
            return f"[{r}, {i}]" if ranked else f"[{i}]"

        negative = (m < -1).nonzero()
        if len(negative):
            r, i = negative[0].tolist()
            return fail("mapping", f"    '{name}'{loc(r, i)}={int(m[r, i])} is invalid; only -1 is a negative sentinel")
        valid = m >= 0
        outside = (valid & (m >= rows)).nonzero()
        if len(outside):
            r, i = outside[0].tolist()
            return fail("mapping", f"    '{name}'{loc(r, i)}={int(m[r, i])} is outside physical row range [0, {rows})")
        # key = rank * rows + physical row, in row-major (rank, item) order
        keys = (torch.arange(n_ranks).unsqueeze(1) * rows + m)[valid]
        items = torch.arange(m.shape[1]).expand_as(m)[valid]
        sorted_keys = keys.sort().values
        dup_keys = sorted_keys[1:][sorted_keys[1:] == sorted_keys[:-1]].unique()
        if len(dup_keys):
            r, row = divmod(int(dup_keys[0]), rows)
            dup_items = (m[r] == row).nonzero().flatten().tolist()
            figures.update(duplicate_rows=len(dup_keys), first_duplicate={"rank": r, "row": row, "items": dup_items})
            where = f" on rank {r}" if ranked else ""
            text = (f"    '{name}' contains duplicate physical row {row}{where}\n"
                    f"    items of '{name}'{'[' + str(r) + ']' if ranked else ''} mapping to it: {dup_items}; "
                    f"{len(dup_keys)} duplicated row(s) in all (a fixture error, not the implementation's)")
            return fail("mapping", text)
        written = torch.zeros(n_ranks * rows, dtype=torch.bool)
        written[keys] = True
        item_of = torch.full((n_ranks * rows,), -1, dtype=torch.int64)
        item_of[keys] = items
        initial = self._initial(inputs, actual, figures)
        init_rows = initial.cpu().reshape(n_ranks * rows, -1) if initial is not None else None

        stray_keys = (~written & ~(a_rows == e_rows).all(dim=1)).nonzero().flatten()
        stray = self._strays(stray_keys, a_rows, e_rows, init_rows, n_ranks, rows, figures)

        written_keys = written.nonzero().flatten()  # (rank, row) row-major: each rank contiguous
        per_rank_rows = torch.bincount(written_keys // rows, minlength=n_ranks).tolist()
        starts = [sum(per_rank_rows[:r]) for r in range(n_ranks + 1)]
        bounds = [(starts[r], starts[r + 1]) for r in range(n_ranks)]
        figures["n_written_rows"] = len(written_keys)
        a_g, e_g = a_rows[written_keys], e_rows[written_keys]
        nonfinite_refs = []
        if a_g.is_floating_point():
            for side, t in (("actual", a_g), ("expected", e_g)):
                n = int((~torch.isfinite(t)).sum())
                figures[f"nonfinite_mapped_{side}"] = n
                if n:
                    nonfinite_refs.append(f"    {side} mapped rows in {self.pool_name} from '{name}' "
                                          f"contain {n} non-finite value(s)")
        unwritten = None
        if init_rows is not None and len(written_keys):
            i_g = init_rows[written_keys]
            unwritten = unchanged_rows(a_g, i_g) & ~unchanged_rows(e_g, i_g)
            figures["unwritten_rows"] = int(unwritten.sum())

        if len(written_keys):
            locate = self._locator(written_keys, item_of, rows, width, actual.shape[block_axis + 1:])
            eff_atol, eff_rtol = self.numeric.effective(rtol, atol)
            j = self.numeric.judge(a_g.to(torch.float32), e_g.to(torch.float32), eff_atol, eff_rtol, bounds,
                                    locate, located=True)
            figures.update(j.figures)
            per_rank = j.per_rank
        else:
            j = Judgement(True, None, "", [], {}, [])
            figures.update(numel=0, n_bad=0)
            per_rank = [RankFigures(rank=r) for r in range(n_ranks)]
        self._rank_pool_figures(per_rank, per_rank_rows, stray, unwritten, bounds)

        # the reference reports the first failing check only: stray rows, non-finite, numeric
        if stray["count"]:
            kind, reference = "stray", stray["reference"]
        elif nonfinite_refs:
            kind, reference = "nonfinite", nonfinite_refs[0]
        elif not j.passed:
            kind, reference = j.kind, f"    mapped rows in {self.pool_name} from '{name}':\n{j.reference}"
        else:
            return self._verdict(True, None, "", figures, per_rank, pooled_note(per_rank, True))
        extras = list(stray["lines"])
        if kind == "nonfinite":
            extras.append(j.reference)  # the per-side NaN / Inf counts of the mapped rows
        elif not j.passed and j.kind != kind:
            extras += [f"    mapped rows in {self.pool_name} from '{name}' (also failing):", j.reference]
        extras += j.extras + rank_lines(per_rank)
        if unwritten is not None and figures["unwritten_rows"]:
            extras.append(f"    {figures['unwritten_rows']} mapped row(s) still hold their initial value in the "
                          "actual pool but not in the golden (writes the implementation skipped)")
        return self._verdict(False, kind, join_detail(reference, extras), figures, per_rank)

    def _initial(self, inputs: Mapping[str, torch.Tensor], actual: torch.Tensor, figures: dict) -> torch.Tensor | None:
        initial = inputs.get(self.initial_name) if self.initial_name else None
        figures["initial"] = initial is not None
        if initial is not None and (initial.shape != actual.shape or initial.dtype != actual.dtype):
            figures["initial"] = (f"ignored: {tuple(initial.shape)} {initial.dtype} vs the pool's "
                                  f"{tuple(actual.shape)} {actual.dtype}")
            return None
        return initial

    def _strays(self, stray_keys: torch.Tensor, a_rows: torch.Tensor, e_rows: torch.Tensor,
                init_rows: torch.Tensor | None, n_ranks: int, rows: int, figures: dict) -> dict[str, Any]:
        """Every changed unmapped row: counts per rank, first examples, which side changed it."""
        count = len(stray_keys)
        figures["stray_rows"] = count
        out: dict[str, Any] = {"count": count, "lines": [], "reference": "", "per_rank": [0] * n_ranks,
                               "examples": [[] for _ in range(n_ranks)], "sides": None}
        if not count:
            figures.update(stray_examples=[], stray_by_side=None)
            return out
        a_s, e_s = a_rows[stray_keys], e_rows[stray_keys]
        rank_of = stray_keys // rows
        out["per_rank"] = torch.bincount(rank_of, minlength=n_ranks).tolist()
        side = None
        if init_rows is not None:
            i_s = init_rows[stray_keys]
            side = (~unchanged_rows(a_s, i_s)).long() + 2 * (~unchanged_rows(e_s, i_s)).long()
            by = torch.bincount(rank_of * 4 + side, minlength=4 * n_ranks).view(n_ranks, 4).tolist()
            out["sides"] = [dict(zip(_SIDES, b)) for b in by]
            figures["stray_by_side"] = dict(zip(_SIDES, torch.bincount(side, minlength=4).tolist()))
        else:
            figures["stray_by_side"] = None
        figures["stray_nan"] = {"actual": int(torch.isnan(a_s).sum()), "expected": int(torch.isnan(e_s).sum())}
        start = 0
        for r in range(n_ranks):  # one iteration per rank (P is a handful): its first few strays
            stop = start + out["per_rank"][r]
            for g in range(start, min(stop, start + MAX_EXAMPLES)):
                row = int(stray_keys[g]) - r * rows
                ex = {"rank": r, "block": row // self.block_size, "intra": row % self.block_size, "row": row,
                      "changed_values": int((a_s[g] != e_s[g]).sum())}
                if side is not None:
                    ex["changed_side"] = _SIDES[int(side[g])]
                out["examples"][r].append(ex)
            start = stop
        first_examples = [ex for r in range(n_ranks) for ex in out["examples"][r]]
        figures["stray_examples"] = first_examples[:MAX_EXAMPLES]
        first = out["examples"][int(rank_of[0])][0]
        rank_detail = f" rank={first['rank']}" if self.leading_rank_axis else ""
        out["reference"] = (f"    unmapped physical {self.pool_name} row changed:{rank_detail} "
                            f"row={first['row']} changed_values={first['changed_values']} mapping='{self.mapping_name}'")
        per = ", ".join(f"rank {r}: {c}" for r, c in enumerate(out["per_rank"]))
        lines = [f"    {count} unmapped row(s) changed in all ({per})"]
        for ex in first_examples[:MAX_EXAMPLES]:
            side_text = f" changed by {ex['changed_side']}" if "changed_side" in ex else ""
            lines.append(f"      (rank={ex['rank']}, block={ex['block']}, intra={ex['intra']}) "
                         f"row={ex['row']} changed_values={ex['changed_values']}{side_text}")
        if figures["stray_by_side"]:
            s = figures["stray_by_side"]
            lines.append(f"    vs the initial pool: actual changed {s['actual']}, golden changed {s['expected']}, "
                         f"both {s['both']}, neither {s['neither']} (both sides as before, e.g. a NaN kept in place)")
        out["lines"] = lines
        return out

    def _locator(self, written_keys: torch.Tensor, item_of: torch.Tensor, rows: int, width: int,
                 trailing: Sequence[int]) -> Locate:
        keys, items, bs, ranked = written_keys.tolist(), item_of, self.block_size, self.leading_rank_axis

        def pool_point(flat: int) -> dict[str, Any]:
            g, col = divmod(flat, width)
            key = keys[g]
            r, row = divmod(key, rows)
            block, intra = divmod(row, bs)
            at = ((r,) if ranked else ()) + (block, intra) + unravel(col, trailing)
            return {"at": at, "rank": r, "block": block, "intra": intra, "item": int(items[key]), "col": col}

        return pool_point

    @staticmethod
    def _rank_pool_figures(per_rank: list[RankFigures], mapped_rows: Sequence[int], stray: Mapping[str, Any],
                           unwritten: torch.Tensor | None, bounds: Sequence[tuple[int, int]]) -> None:
        for rf in per_rank:
            r = rf.rank
            rf.mapped_rows = mapped_rows[r]
            rf.stray_rows = stray["per_rank"][r]
            rf.stray_examples = stray["examples"][r]
            rf.stray_by_side = stray["sides"][r] if stray["sides"] else None
            if unwritten is not None:
                s, stop = bounds[r]
                rf.unwritten_rows = int(unwritten[s:stop].sum())


def mapped_pool_ratio_allclose(mapping_name: str, *, mapping_shape: Sequence[int], block_size: int,
                               leading_rank_axis: bool = False, pool_name: str = "pool",
                               atol: float | None = None, rtol: float | None = None,
                               max_error_ratio: float = 0.005,
                               initial_name: str | None = None) -> MappedPoolRatioAllclose:
    return MappedPoolRatioAllclose(mapping_name, mapping_shape=mapping_shape, block_size=block_size,
                                   leading_rank_axis=leading_rank_axis, pool_name=pool_name, atol=atol,
                                   rtol=rtol, max_error_ratio=max_error_ratio, initial_name=initial_name)


