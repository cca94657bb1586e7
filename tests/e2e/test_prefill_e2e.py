"""CP prefill end to end through the launcher: cases PASS, each CP-protocol defect FAILs naming
the tensor and the rank, bad keys are refused before any rank starts, and the reference's own
snapshots replay with golden_data alone (a perturbed copy FAILs)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from launcher.store import snapshot

from .. import defects
from ..conftest import reference_snapshot


@pytest.mark.parametrize("keys", [
    dict(cp=2), dict(cp=4, cp_layout="contiguous"), dict(cp=1),
    dict(cp=2, prefix=300, segment_lens="[128,40,30,200]"),
], ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_prefill_passes(tp_run, keys):
    run = tp_run(layer="swa", phase="prefill", model="tiny", **keys)
    assert run.exit_code == 0, run
    assert run.result["case"]["cp"] == keys["cp"]


@pytest.mark.parametrize("impl, keys, tensor, ranks", [
    (defects.PrefillMissingPredecessorTail, {}, "x_out", [1]),
    (defects.PrefillLocalRopePositions, {}, "x_out", [0, 1]),
    (defects.PrefillFinalWindowOnOwnerOnly, {}, "kv_cache", [1]),  # zigzag: rank 0 owns the last segment
    (defects.PrefillDroppedKeys, {"segment_lens": "[128,40,30,128]"}, "x_out", [0, 1]),  # segments 2 and 3 reach back past their predecessor
    (defects.PrefillAllGatherRingOrder, {"cp_layout": "contiguous"}, "x_out", [1]),
    (defects.PrefillAllGatherRingOrder, {"cp_layout": "contiguous"}, "kv_cache", [1]),
    (defects.PrefillFinalWindowOnOwnerOnly, {"cp_layout": "contiguous"}, "kv_cache", [0]),  # rank 1 owns the last segment
], ids=lambda x: getattr(x, "__name__", None))
def test_prefill_defect_fails_naming_tensor_and_rank(tp_run, impl, keys, tensor, ranks):
    run = tp_run(layer="swa", phase="prefill", cp=2, model="tiny", impl=impl, **keys)
    assert run.exit_code == 1, run
    v = run.verdict(tensor)
    assert not v["passed"], run
    assert [r["rank"] for r in v["per_rank"] if r["n_bad"]] == ranks, run


@pytest.mark.parametrize("impl, keys, stage, ranks", [
    (defects.PrefillMissingPredecessorTail, {}, "tail_exchange", [1]),
    (defects.PrefillLocalRopePositions, {}, "project", [0, 1]),
    (defects.PrefillFinalWindowOnOwnerOnly, {}, "final_window_commit", [1]),
    (defects.PrefillDroppedKeys, {"segment_lens": "[128,40,30,128]"}, "key_table", [0, 1]),
    (defects.PrefillAllGatherRingOrder, {"cp_layout": "contiguous"}, "kv_allgather", [1]),
    (defects.PrefillFinalWindowOnOwnerOnly, {"cp_layout": "contiguous"}, "final_window_commit", [0]),
], ids=lambda x: getattr(x, "__name__", None))
def test_bisect_names_the_defective_stage_and_ranks(tp_run, impl, keys, stage, ranks):
    run = tp_run(layer="swa", phase="prefill", cp=2, model="tiny", impl=impl, bisect=True, **keys)
    assert run.exit_code == 1, run
    located = run.result["bisect"]
    assert (located["stage"], located["ranks"]) == (stage, ranks), run


def test_dropped_keys_pass_when_every_segment_fills_the_window(tp_run):
    run = tp_run(layer="swa", phase="prefill", cp=2, model="tiny", impl=defects.PrefillDroppedKeys)
    assert run.exit_code == 0, run


@pytest.mark.parametrize("layout, output", [("zigzag", "logical_tails_out"), ("contiguous", "gathered_kv")])
def test_collectives_scope_passes(tp_run, layout, output):
    run = tp_run(layer="swa", phase="prefill", cp=4, cp_layout=layout, scope="collectives", model="tiny")
    assert run.exit_code == 0, run
    assert run.verdict(output)["passed"], run


@pytest.mark.parametrize("impl, layout, output, ranks", [
    (defects.PrefillMissingPredecessorTail, "zigzag", "logical_tails_out", [1]),
    (defects.PrefillTailsInRankMajorOrder, "zigzag", "logical_tails_out", [0, 1]),
    (defects.PrefillAllGatherRingOrder, "contiguous", "gathered_kv", [1]),
], ids=lambda x: getattr(x, "__name__", None))
def test_collectives_scope_defect_fails_naming_tensor_and_rank(tp_run, impl, layout, output, ranks):
    run = tp_run(layer="swa", phase="prefill", cp=2, cp_layout=layout, scope="collectives", model="tiny", impl=impl)
    assert run.exit_code == 1, run
    v = run.verdict(output)
    assert [r["rank"] for r in v["per_rank"] if r["n_bad"]] == ranks, run


@pytest.mark.parametrize("keys, words", [
    (dict(phase="prefill", tp=2), "tp=2 is a key of phase=decode"),
    (dict(phase="prefill", layer="moe"), "no prefill stage list"),
    (dict(cp=2), "cp=2 is a key of phase=prefill"),
    (dict(phase="prefill", segment_lens="[128,128]"), "2\\*cp = 4 segments"),
    (dict(phase="warmup"), "phase='warmup'"),
    (dict(phase="prefill", scope="output"), "scope=full or collectives"),
])
def test_bad_prefill_keys_refused(tp_run, keys, words):
    import re

    run = tp_run(model="tiny", **{"layer": "swa", **keys})
    assert run.exit_code != 0 and re.search(words, run.output), run


# -- the reference's own CP snapshots (tests/data/reference), replayed with golden_data alone -----
SNAPSHOTS = {layer: reference_snapshot(f"prefill-{layer}") for layer in ("swa", "hca", "csa")}


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_reference_snapshot_replays_and_passes(tp_run, name):
    run = tp_run(golden_data=str(SNAPSHOTS[name]), recompute_golden=True)
    assert run.exit_code == 0, run
    case = run.result["case"]
    assert (case["layer"], case["cp"], case["phase"]) == (name, 2, "prefill")
    assert {"phase", "cp", "segment_lens", "model"} <= set(run.result["snapshot"]["read"])


@pytest.mark.parametrize("name, tensor, rank", [("swa", "x_out", 1), ("swa", "kv_cache", 0), ("hca", "cmp_kv", 1),
                                               ("csa", "cmp_kv", 0)])
def test_perturbed_reference_snapshot_fails(tp_run, tmp_path, name, tensor, rank):
    copy = tmp_path / "snap"
    shutil.copytree(SNAPSHOTS[name], copy)
    for p in copy.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    path = copy / "out" / f"{tensor}.pt"
    t = torch.load(path, weights_only=True)
    rows = t[rank].view(-1, t.shape[-1])
    if tensor == "x_out":
        t[rank, 0, 0, :64] *= 1.05
    elif tensor == "kv_cache":  # one row of the final window
        rows[int(torch.load(copy / "in" / "final_slot_mapping.pt", weights_only=True)[7])] += 0.25
    else:  # the first compressed row the step wrote
        rows[int(torch.nonzero(rows.abs().sum(-1))[0])] += 0.25
    torch.save(t, path)
    run = tp_run(golden_data=str(copy))
    assert run.exit_code == 1, run
    v = run.verdict(tensor)
    assert [r["rank"] for r in v["per_rank"] if r["n_bad"]] == [rank], run


def test_a_ring_other_than_the_snapshots_is_refused(tp_run):
    run = tp_run(golden_data=str(SNAPSHOTS["swa"]), overrides=["model.prefill_ori_block_num=16"])
    assert run.exit_code != 0 and "contradicts the snapshot" in run.output and "prefill_ori_block_num=8" in run.output, run


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_saved_prefill_snapshot_replays(tp_run, tmp_path, layout):
    saved = tmp_path / "saved"
    first = tp_run(layer="swa", phase="prefill", cp=2, model="tiny", prefix=40, segment_lens="[128,60,200,128]",
                   cp_layout=layout, save_data=str(saved))
    assert first.exit_code == 0, first
    replay = tp_run(golden_data=str(saved))
    assert replay.exit_code == 0, replay
    assert replay.result["case"]["segment_lens"] == [128, 60, 200, 128] and replay.result["case"]["prefix"] == 40
    assert replay.result["case"]["cp_layout"] == layout


@pytest.mark.parametrize("layer, layout, output", [("swa", "contiguous", "gathered_kv"), ("hca", "zigzag", "cmp_kv"),
                                                  ("csa", "zigzag", "idx_kv_cache")])
def test_saved_collectives_snapshot_replays_and_a_perturbed_one_fails(tp_run, tmp_path, layer, layout, output):
    """An exchange's snapshot holds no segment tables: the reader takes the prefill case from
    its manifest (told by the sources it holds), replays it to PASS, and FAILs a perturbed
    output on its rank; without the manifest it says what is missing."""
    saved = tmp_path / "saved"
    first = tp_run(layer=layer, phase="prefill", cp=2, cp_layout=layout, scope="collectives", model="tiny", prefix=40,
                   segment_lens="[128,60,200,128]", save_data=str(saved))
    assert first.exit_code == 0, first
    replay = tp_run(golden_data=str(saved))
    assert replay.exit_code == 0, replay
    case = replay.result["case"]
    assert (case["layer"], case["scope"], case["cp_layout"], case["prefix"]) == (layer, "collectives", layout, 40), replay
    path = saved / "out" / f"{output}.pt"
    t = torch.load(path, weights_only=True)
    t[1].view(-1)[t[1].numel() // 2] += 1
    torch.save(t, path)
    manifest = json.loads((saved / "manifest.json").read_text())
    del manifest["sha256"][f"out/{output}.pt"]  # a perturbed copy, not a changed file: no sha256 to refuse it by
    (saved / "manifest.json").write_text(json.dumps(snapshot.sealed(manifest)))
    perturbed = tp_run(golden_data=str(saved))
    assert perturbed.exit_code == 1, perturbed
    assert [r["rank"] for r in perturbed.verdict(output)["per_rank"] if r["n_bad"]] == [1], perturbed
    (saved / "manifest.json").unlink()
    bare = tp_run(golden_data=str(saved))
    assert bare.exit_code != 0 and "must name scope, prefix, segment_lens" in bare.output, bare
    assert f"snapshot ({layer})" in bare.output, bare  # told by the sources it holds
