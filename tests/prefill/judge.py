"""Judge a CP prefill group's outputs against the golden with the layer's comparators."""

from __future__ import annotations

from launcher.verify.build import build_compare_fn, compare_outputs


def failures(checks, outputs: list[dict], expected: list[dict]) -> list[tuple[int, str]]:
    """(rank, tensor) of every failing output."""
    fn = build_compare_fn(checks, mapping_shape=(), leading_rank_axis=False)
    bad = []
    for rank, (got, want) in enumerate(zip(outputs, expected)):
        for name, verdict in compare_outputs(got, want, compare_fn=fn).items():
            if not verdict.passed:
                bad.append((rank, name))
    return bad
