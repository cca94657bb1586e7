"""Tests of launcher.verify's comparators: validate_golden's default allclose (§13.1) and compare_fn's
dispatch (§13.2).

Numeric rules are checked against the naive restatements of `tests.unit.comparator_helpers`.
"""

from __future__ import annotations

import math

import pytest
import torch

from launcher.verify import ratio_allclose, validate_golden

from .comparator_helpers import t


# -- §13.1 validate_golden (default allclose) --------------------------------------------------


def test_v1_v2_equal_and_within_tolerance():
    validate_golden({"x": t([1, 2, 3])}, {"x": t([1, 2, 3])})
    validate_golden({"x": t([1, 2, 3])}, {"x": t([1.001, 2.002, 3.003])}, rtol=1e-2, atol=1e-2)


def test_v3_v4_mismatch_messages():
    with pytest.raises(AssertionError, match="does not match golden"):
        validate_golden({"x": t([1, 2, 3])}, {"x": t([2, 3, 4])})
    with pytest.raises(AssertionError) as err:
        validate_golden({"x": t([1, 2, 3, 4])}, {"x": t([1, 200, 3, 400])})
    for s in ("Mismatched elements: 2/4", "actual=", "expected=", "'x' FAIL  shape=(4,) dtype=torch.float32"):
        assert s in str(err.value)


def test_v5_v6_several_outputs_name_the_failing_one():
    validate_golden({"a": t([1.0]), "b": t([2.0])}, {"a": t([1.0]), "b": t([2.0])})
    with pytest.raises(AssertionError) as err:
        validate_golden({"a": t([1.0]), "b": t([3, 4])}, {"a": t([1.0]), "b": t([30, 40])})
    assert str(err.value).startswith("Output(s) does not match golden: ['b']\n  'b' FAIL  shape=(2,)")


def test_v7_rule_is_abs_diff_le_atol_plus_rtol_abs_expected():
    validate_golden({"x": t([1.0])}, {"x": t([1.09])}, rtol=0.0, atol=0.1)
    with pytest.raises(AssertionError):
        validate_golden({"x": t([1.0])}, {"x": t([1.11])}, rtol=0.0, atol=0.1)


def test_v8_bf16_and_v12_defaults():
    x = torch.randn(5).to(torch.bfloat16)
    validate_golden({"x": x}, {"x": x.clone()})
    with pytest.raises(AssertionError):
        validate_golden({"x": t([1.0])}, {"x": t([1.1])})


def test_v9_missing_golden_key_is_key_error():
    with pytest.raises(KeyError):
        validate_golden({"x": t([1.0])}, {"y": t([1.0])})


def test_v10_shape_mismatch_fails_cleanly_naming_both_shapes():
    with pytest.raises(AssertionError) as err:
        validate_golden({"x": t([1.0, 2.0, 3.0])}, {"x": torch.zeros(2, 2)})
    assert "actual=(3,)" in str(err.value) and "expected=(2, 2)" in str(err.value)


def test_v11_nan_never_equals_nan():
    with pytest.raises(AssertionError, match="does not match golden"):
        validate_golden({"x": t([1.0, math.nan])}, {"x": t([1.0, math.nan])})


def test_validate_golden_prints_reference_lines(capsys):
    validate_golden({"a": t([1.0]), "b": t([2.0])}, {"a": t([1.0]), "b": t([2.0])},
                    compare_fn={"b": ratio_allclose()})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[RUN]   'a' PASS  shape=(1,) dtype=torch.float32"
    assert out[1] == f"[RUN]   'b' PASS  shape=(1,) dtype=torch.float32 ({ratio_allclose().__name__})"


# -- §13.2 compare_fn dispatch -----------------------------------------------------------------


def test_c1_c2_custom_comparators():
    always = lambda *a, **k: (True, "")  # noqa: E731
    validate_golden({"x": t([1, 2])}, {"x": t([100, 200])}, compare_fn={"x": always})
    never = lambda *a, **k: (False, "    custom-detail-marker")  # noqa: E731
    with pytest.raises(AssertionError, match="custom-detail-marker"):
        validate_golden({"x": t([1, 2])}, {"x": t([1, 2])}, compare_fn={"x": never})


def test_c3_comparator_sees_the_whole_context():
    seen = {}

    def record(actual, expected, *, actual_outputs, expected_outputs, inputs, rtol, atol):
        seen.update(a=set(actual_outputs), e=set(expected_outputs), i=set(inputs), rtol=rtol, atol=atol)
        return True, ""

    outs = {"a": t([1.0]), "b": t([2.0])}
    validate_golden(outs, dict(outs), rtol=1e-2, atol=1e-3, compare_fn={"a": record}, inputs={"x": t([0.0])})
    assert seen == {"a": {"a", "b"}, "e": {"a", "b"}, "i": {"x"}, "rtol": 1e-2, "atol": 1e-3}


def test_c4_override_one_output_default_for_the_other():
    ok = lambda *a, **k: (True, "")  # noqa: E731
    outs, gold = {"a": t([1.0]), "b": t([1.0])}, {"a": t([9.0]), "b": t([5.0])}
    with pytest.raises(AssertionError, match="'b'"):
        validate_golden(outs, gold, compare_fn={"a": ok})
    validate_golden(outs, gold, compare_fn={"a": ok, "b": ok})
