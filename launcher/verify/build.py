"""From the layers' checks to comparators, and over a run's outputs: `build_comparator` turns a
check (`layers.contract.checks`, data) into its comparator; `compare_outputs` and
`validate_golden` judge every output of a run the reference's way (§6.2).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from layers.contract.checks import (
    ActiveRowsCheck,
    AllcloseCheck,
    Check,
    ExactCheck,
    PoolCheck,
    PrefixTailCheck,
    RelDiffCheck,
    StageCheck,
)

from launcher.verify.active import ActiveRows
from launcher.verify.base import Comparator, Verdict, base_figures, initial_key
from launcher.verify.exact import AllClose, PrefixAndTail, SentinelExact
from launcher.verify.pool import mapped_pool_ratio_allclose
from launcher.verify.ratio import RatioAllclose, ratio_reldiff


# -- dispatch over a run's outputs (§6.2) ------------------------------------------------------


def compare_outputs(outputs: Mapping[str, torch.Tensor], golden: Mapping[str, torch.Tensor], *,
                    rtol: float = 1e-5, atol: float = 1e-5, compare_fn: Mapping[str, Callable] | None = None,
                    inputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, Verdict]:
    """One Verdict per device output, in `outputs` order (a name missing in `golden`: KeyError).

    Outputs without a comparator get `AllClose(rtol, atol)`; a foreign comparator (a plain
    callable with the reference convention) is wrapped into a Verdict without figures.
    """
    compare_fn, inputs = compare_fn or {}, inputs or {}
    verdicts = {}
    for name, actual_tensor in outputs.items():
        actual, expected = actual_tensor.cpu(), golden[name].cpu()
        fn = compare_fn.get(name)
        context = dict(actual_outputs=outputs, expected_outputs=golden, inputs=inputs, rtol=rtol, atol=atol)
        if fn is None:
            verdicts[name] = AllClose(rtol, atol).evaluate(actual, expected, **context)
        elif isinstance(fn, Comparator):
            verdicts[name] = fn.evaluate(actual, expected, **context)
        else:
            ok, detail = fn(actual, expected, **context)
            verdicts[name] = Verdict(passed=bool(ok), label=getattr(fn, "__name__", "custom"),
                                     detail="" if ok else detail, kind=None if ok else "custom",
                                     category=None if ok else "implementation", figures=base_figures(actual))
    return verdicts


def validate_golden(outputs: Mapping[str, torch.Tensor], golden: Mapping[str, torch.Tensor],
                    rtol: float = 1e-5, atol: float = 1e-5, compare_fn: Mapping[str, Callable] | None = None,
                    inputs: Mapping[str, torch.Tensor] | None = None) -> None:
    """The reference's validate_golden: print one line per output, raise AssertionError on failures."""
    compare_fn = compare_fn or {}
    verdicts = compare_outputs(outputs, golden, rtol=rtol, atol=atol, compare_fn=compare_fn, inputs=inputs)
    failures = {}
    for name, v in verdicts.items():
        t = outputs[name]
        where = f"shape={tuple(t.shape)} dtype={t.dtype}"
        if name in compare_fn:
            print(f"[RUN]   '{name}' {'PASS' if v.passed else 'FAIL'}  {where} ({v.label})")
            if not v.passed:
                failures[name] = f"  '{name}' FAIL ({v.label})  {where}\n{v.detail}"
        else:
            print(f"[RUN]   '{name}' {'PASS' if v.passed else 'FAIL'}  {where}")
            if not v.passed:
                failures[name] = f"  '{name}' FAIL  {where}\n{v.detail}"
    if failures:
        raise AssertionError(f"Output(s) does not match golden: {list(failures)}\n" + "\n".join(failures.values()))


# -- from the layers' check data ---------------------------------------------------------------


def build_comparator(check: Check, *, mapping_shape: Sequence[int], leading_rank_axis: bool) -> Comparator:
    """The comparator a layer's check describes (§12): pools by their mapping, x_out by ratio_reldiff.

    Pools get `initial_name=initial_key(check.output)` so a pre-step snapshot in `inputs` is used.
    """
    if isinstance(check, PoolCheck):
        return mapped_pool_ratio_allclose(
            check.mapping, mapping_shape=tuple(mapping_shape), block_size=check.block_size,
            leading_rank_axis=leading_rank_axis, pool_name=check.pool_name, atol=check.atol, rtol=check.rtol,
            max_error_ratio=check.max_error_ratio, initial_name=initial_key(check.output))
    if isinstance(check, RelDiffCheck):
        return ratio_reldiff(check.diff_thd, check.pct_thd, check.max_diff_hd, rank_axis=leading_rank_axis)
    if isinstance(check, StageCheck):  # the scopes' and bisect's stage-level checks (§12.5)
        return build_stage_comparator(check, leading_rank_axis=leading_rank_axis)
    if isinstance(check, ActiveRowsCheck):  # bisect's masked MoE stage checks (moe.md §13.5)
        return ActiveRows(build_stage_comparator(check.check, leading_rank_axis=leading_rank_axis), check.output,
                          check.active, check.rows_per_token, check.order_by, rank_axis=leading_rank_axis)
    raise TypeError(f"no comparator for check {check!r}")


def build_compare_fn(checks: Sequence[Check], *, mapping_shape: Sequence[int],
                     leading_rank_axis: bool) -> dict[str, Comparator]:
    """`compare_fn` for validate_golden / compare_outputs from a layer's checks."""
    return {c.output: build_comparator(c, mapping_shape=mapping_shape, leading_rank_axis=leading_rank_axis)
            for c in checks}


def build_stage_comparator(check: StageCheck, *, leading_rank_axis: bool) -> Comparator:
    """The comparator of a stage-level check; `valid_axis` is shifted past the rank axis."""
    if isinstance(check, ExactCheck):
        return SentinelExact(check.sentinel, check.poison, rank_axis=leading_rank_axis)
    if isinstance(check, AllcloseCheck):
        return RatioAllclose(check.atol, check.rtol, check.max_error_ratio, valid_rows=check.valid_rows,
                             valid_axis=check.valid_axis + int(leading_rank_axis), zero_tail=check.zero_tail,
                             rank_axis=leading_rank_axis)
    if isinstance(check, PrefixTailCheck):
        return PrefixAndTail(check.valid_rows, check.atol, check.rtol, check.max_error_ratio, check.valid_axis,
                             rank_axis=leading_rank_axis)
    raise TypeError(f"no comparator for stage check {check!r}")
