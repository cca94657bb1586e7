"""The declaration contract: recognition order from `shadows`, and what a check's axes name."""

from __future__ import annotations

import pytest
import torch

from layers.contract.checks import RelDiffCheck
from layers.contract.declaration import Declaration, in_order
from launcher.verify.where import error_maps


def test_a_kind_is_recognised_before_the_kinds_it_shadows():
    base, mid, top = (Declaration("base", ("a",), ()), Declaration("mid", ("b",), (), shadows=("base",)),
                      Declaration("top", ("c",), (), shadows=("mid",)))
    assert [d.name for d in in_order([base, top, mid])] == ["top", "mid", "base"]


def test_declarations_that_shadow_each_other_are_refused():
    with pytest.raises(ValueError, match="cycle"):
        in_order([Declaration("a", (), (), shadows=("b",)), Declaration("b", (), (), shadows=("a",))])


def test_the_grids_are_named_by_the_checks_declared_axes():
    """A check's `axes` name the middle axes' grids; an undeclared one gets axis numbers."""
    e = torch.ones(2, 8, 3, 4)
    a = e.clone()
    a[1, 2, 1] = 2.0
    named = error_maps("y", RelDiffCheck("y", 3e-3, 0.008, 1, axes=("token", "head", "channel")), a, e, {}, seq=8)
    plain = error_maps("y", RelDiffCheck("y", 3e-3, 0.008, 1), a, e, {}, seq=8)
    assert [m["name"] for m in named] == ["rank x token block", "rank x head"]
    assert [m["name"] for m in plain] == ["rank x token block", "rank x axis2"]
