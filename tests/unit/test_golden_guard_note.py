"""The note of what the golden can reach names each way an implementation can change it:
a replaced function, a function whose code was swapped, a method added to torch.Tensor or
replaced in a harness class, a torch mode left active; and nothing when nothing changed."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

import layers.components.numerics
import layers.components.qkv
from launcher.run import golden_guard
from layers.tp import TorchTP

from .. import defects


@pytest.fixture
def guard():
    golden_guard.record()
    assert golden_guard.changes() == []


def _add_half(*args):
    return None


def test_a_replaced_harness_function_is_named(guard, monkeypatch):
    monkeypatch.setattr(layers.components.qkv, "rms_norm", defects.fast_rms_norm)
    assert golden_guard.changes() == ["layers.components.qkv.rms_norm was replaced by tests.defects.norm_patches.fast_rms_norm"]


def test_swapped_code_is_named_once(guard, monkeypatch):
    # bf16 is imported by many harness modules: one line, naming the function.
    monkeypatch.setattr(layers.components.numerics.bf16, "__code__", _add_half.__code__)
    changed = golden_guard.changes()
    assert len(changed) == 1 and changed[0].startswith(
        "layers.components.numerics.bf16 had its code replaced by that of _add_half in "), changed


def test_a_method_added_to_tensor_or_replaced_in_a_harness_class_is_named(guard, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "rsqrt", _add_half, raising=False)  # shadows the C method
    monkeypatch.setattr(TorchTP, "run_stage", _add_half)
    assert sorted(golden_guard.changes()) == [
        f"layers.tp.TorchTP.run_stage was replaced by {__name__}._add_half",
        f"torch.Tensor.rsqrt was added: {__name__}._add_half",
    ]


def test_a_torch_function_replaced_by_one_from_outside_torch_is_named(guard, monkeypatch):
    @functools.wraps(torch.nn.functional.silu)  # names copied from torch's: its code is still here
    def silu(x, inplace=False):
        return x

    monkeypatch.setattr(torch.nn.functional, "softmax", _add_half)
    monkeypatch.setattr(torch.nn.functional, "silu", silu)
    monkeypatch.setattr(torch, "rsqrt", math.sqrt)
    assert sorted(golden_guard.changes()) == [
        f"torch.nn.functional.silu was replaced by torch.nn.functional.silu (the code of "
        f"{silu.__code__.co_qualname} in {__file__})",
        f"torch.nn.functional.softmax was replaced by {__name__}._add_half",
        "torch.rsqrt was replaced by math.sqrt",
    ]


def test_torch_rebinding_its_own_names_is_not_a_change(guard, monkeypatch):
    # torch.set_default_dtype rebinds torch.Storage; importing torch._dynamo wraps torch.manual_seed.
    monkeypatch.setattr(torch, "Storage", torch.DoubleStorage)
    monkeypatch.setattr(torch, "manual_seed", torch.random.manual_seed)
    assert golden_guard.changes() == []


def test_a_torch_function_mode_left_active_is_named(guard):
    mode = TorchFunctionMode()
    mode.__enter__()
    try:
        changed = golden_guard.changes()
    finally:
        mode.__exit__(None, None, None)
    assert changed == ["a torch function or dispatch mode was left active (mode stack depths (0, 0) before, (1, 0) now)"]
    assert golden_guard.changes() == []
