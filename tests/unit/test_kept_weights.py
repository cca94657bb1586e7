"""Replicated weights kept for a warm rank's next job (`layers.fixtures.kept`): the same bits
as a fresh draw, never a tensor that changed since it was drawn."""

from __future__ import annotations

import dataclasses

import pytest

from layers.contract.case import Case
from layers.contract.config import TINY
from layers.contract.tensors import tensor_sha256
from layers.csa import fixture as csa
from layers.hca import fixture as hca
from layers.swa import fixture as swa
from layers.fixtures.kept import forget_kept_weights, kept_sha256

WEIGHTS = {"swa": swa.replicated_weights, "csa": csa.replicated_weights, "hca": hca._replicated_weights}


def _digests(tensors: dict) -> dict:
    return {n: tensor_sha256(t) for n, t in tensors.items()}


@pytest.fixture(autouse=True)
def _nothing_kept():
    forget_kept_weights()
    yield
    forget_kept_weights()


@pytest.mark.parametrize("layer", sorted(WEIGHTS))
def test_the_same_key_gets_the_kept_tensors_with_the_bits_of_a_fresh_draw(layer):
    weights = WEIGHTS[layer]
    case = Case(layer, TINY, 2, 16, 11)
    first = weights(case)
    again = weights(dataclasses.replace(case, local_t=32, tp=4))  # another case of the same seed and model
    assert all(again[n] is first[n] for n in first)
    fresh = weights.__wrapped__(case)
    assert _digests(again) == _digests(fresh)


def test_a_kept_tensor_changed_in_place_is_drawn_again():
    case = Case("swa", TINY, 2, 16, 11)
    first = swa.replicated_weights(case)
    expected = tensor_sha256(first["wq_a"])
    first["wq_a"].add_(1)  # an implementation writing into its inputs after the harness checked them
    again = swa.replicated_weights(case)
    assert again["wq_a"] is not first["wq_a"] and tensor_sha256(again["wq_a"]) == expected


def test_another_seed_or_model_is_drawn_afresh():
    case = Case("csa", TINY, 2, 16, 11)
    first = csa.replicated_weights(case)
    other_seed = csa.replicated_weights(dataclasses.replace(case, seed=12))
    assert tensor_sha256(other_seed["wq_a"]) != tensor_sha256(first["wq_a"])
    other_model = csa.replicated_weights(dataclasses.replace(case, model=dataclasses.replace(TINY, rms_norm_eps=1e-5)))
    assert other_model["wq_a"] is not first["wq_a"]


def test_each_call_returns_a_dict_of_its_own():
    case = Case("hca", TINY, 2, 16, 11)
    mine = hca._replicated_weights(case)
    mine["x_hc"] = None
    assert "x_hc" not in hca._replicated_weights(case)


def test_a_process_keeps_one_draw():
    case = Case("swa", TINY, 2, 16, 11)
    first = swa.replicated_weights(case)
    csa.replicated_weights(dataclasses.replace(case, layer="csa"))  # another layer's weights replace them
    assert swa.replicated_weights(case)["wq_a"] is not first["wq_a"]


def test_the_digest_of_a_kept_tensor_is_its_own_and_no_copy_has_one():
    case = Case("csa", TINY, 2, 16, 11)
    weights = csa.replicated_weights(case)
    assert {n: kept_sha256(t) for n, t in weights.items()} == _digests(weights)
    assert kept_sha256(weights["wq_a"].clone()) is None
    forget_kept_weights()
    assert kept_sha256(weights["wq_a"]) is None  # no longer kept: the caller hashes it
