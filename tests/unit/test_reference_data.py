"""The shipped reference snapshots (tests/data/reference) are the files their maker recorded,
made at the dims of the presets that replay them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from layers.contract.config import PRESETS
from layers.prefill.case import PREFILL_BLOCK_ROWS

from ..conftest import REFERENCE_DATA, reference_snapshot

LAYERS = ("swa", "csa", "hca", "moe", "prefill-swa", "prefill-hca", "prefill-csa")
# The reference's deployment constants and the preset fields that hold them.
CONSTANT_FIELDS = {
    "DECODE_BATCH": "decode_batch", "DECODE_SEQ": "decode_seq", "DECODE_START_POS": "decode_start_pos",
    "BLOCK_SIZE": "block_size", "KV_ORI_BLOCK_NUM": "kv_ori_block_num", "KV_CMP_BLOCK_NUM": "kv_cmp_block_num",
    "IDX_CACHE_BLOCK_NUM": "idx_cache_block_num", "HCA_STATE_PHYSICAL_BLOCKS": "hca_state_physical_blocks",
    "CSA_STATE_PHYSICAL_BLOCKS": "csa_state_physical_blocks",
    "CSA_INNER_STATE_PHYSICAL_BLOCKS": "csa_inner_state_physical_blocks",
}
# The prefill's (the mtp tree's config.py): its raw-KV ring's pages (kv_cache's page count).
PREFILL_CONSTANT_FIELDS = {"PREFILL_ORI_MAX_BLOCKS": "prefill_ori_block_num",
                           "C128_COMPRESSOR_BLOCK_SIZE": "c128_state_block_size"}


def changed_files(folder: Path) -> list[str]:
    """The files of `folder` whose sha256 is not the one its reference.json records."""
    recorded = json.loads((folder / "reference.json").read_text())["sha256"]
    present = {str(p.relative_to(folder)) for p in folder.glob("*/*.pt")}
    return sorted(name for name in recorded.keys() | present
                  if name not in recorded or name not in present
                  or hashlib.sha256((folder / name).read_bytes()).hexdigest() != recorded[name])


@pytest.mark.parametrize("layer", LAYERS)
def test_the_files_are_those_the_reference_made(layer):
    assert changed_files(reference_snapshot(layer)) == []


def test_a_changed_file_is_named(tmp_path):
    copy = tmp_path / "swa"
    shutil.copytree(reference_snapshot("swa"), copy)
    x_hc = torch.load(copy / "in" / "x_hc.pt", weights_only=True)
    torch.save(x_hc + 1, copy / "in" / "x_hc.pt")
    assert changed_files(copy) == ["in/x_hc.pt"]


# The fields the MoE layer's tensors depend on (moe.md §1): the rest of `tiny` is attention's;
# the expert count (16 per rank) the reference's MoE module sets itself.
MOE_DIMS = {"hidden_size", "moe_intermediate_size", "vocab_size", "hc_mult", "num_experts_per_tok",
            "num_hash_layers", "scoring_func", "routed_scaling_factor", "swiglu_limit", "n_shared_experts",
            "rms_norm_eps", "hc_sinkhorn_iters", "hc_eps"}


def _record(layer: str) -> dict:
    return json.loads((reference_snapshot(layer) / "reference.json").read_text())


def differences_from_preset(record: dict) -> dict:
    """Each field or constant the reference ran with that its replaying preset holds otherwise."""
    fields = PRESETS[record["model"]["name"]].fields()
    used = {k: v for k, v in record["model"].items() if k in fields and k != "name"
            and (record["layer"] != "moe" or k in MOE_DIMS)}
    if record.get("phase") == "prefill":
        used |= {PREFILL_CONSTANT_FIELDS[k]: v for k, v in record["constants"].items() if k in PREFILL_CONSTANT_FIELDS}
    elif record["layer"] != "moe":
        used |= {CONSTANT_FIELDS[k]: v for k, v in record["constants"].items() if k in CONSTANT_FIELDS}
        used["long_context_max_seq_len"] = record["long_context_max_seq_len"]
    return {k: v for k, v in used.items() if fields[k] != (tuple(v) if isinstance(v, list) else v)}


@pytest.mark.parametrize("layer", LAYERS)
def test_the_reference_ran_at_the_dims_of_the_preset_that_replays_it(layer):
    assert differences_from_preset(_record(layer)) == {}


def test_a_dim_the_preset_does_not_hold_is_named():
    record = _record("csa")
    record["model"]["index_topk"] += 1
    record["constants"]["KV_CMP_BLOCK_NUM"] += 1
    assert set(differences_from_preset(record)) == {"index_topk", "kv_cmp_block_num"}


def test_a_prefill_pool_the_preset_does_not_hold_is_named():
    record = _record("prefill-swa")
    record["constants"]["PREFILL_ORI_MAX_BLOCKS"] = 128
    assert differences_from_preset(record) == {"prefill_ori_block_num": 128}


@pytest.mark.parametrize("layer", ["prefill-swa", "prefill-hca"])
def test_the_prefill_pages_are_the_harness_page(layer):
    """The reference's prefill page (its BLOCK_SIZE) is the harness's fixed PREFILL_BLOCK_ROWS."""
    assert _record(layer)["constants"]["BLOCK_SIZE"] == PREFILL_BLOCK_ROWS


def test_every_shipped_folder_is_a_tested_snapshot():
    assert {p.name for p in REFERENCE_DATA.iterdir() if p.is_dir()} == {reference_snapshot(n).name for n in LAYERS}
