"""What the compressed layers' prefill end-to-end tests assert of a launcher run: a defect
FAILs the named tensors on the named ranks and bisect locates it; a saved run replays with
golden_data alone, with our manifest or without it (as the reference writes its snapshots)."""

from __future__ import annotations


def assert_fails_and_located(run, compared: tuple[str, ...], failing: dict, located: tuple) -> None:
    """The run FAILs `failing` ({tensor: ranks with a bad element}, others may fail too) and bisect
    names `located` (stage, ranks)."""
    assert run.exit_code == 1, run
    bad = {t: [r["rank"] for r in run.verdict(t)["per_rank"] if r["n_bad"]] for t in compared}
    assert {t: bad[t] for t in failing} == failing, run
    assert (run.result["bisect"]["stage"], run.result["bisect"]["ranks"]) == located, run


def assert_saved_run_replays(tp_run, saved, layer: str, prefix: int, lens: list[int], names: set[str]) -> None:
    """A run of `layer` with `prefix` and segment lengths `lens` saved to `saved` holds the
    reference's tensor `names` and replays, the case read back from the manifest and without it."""
    first = tp_run(layer=layer, phase="prefill", cp=2, model="tiny", prefix=prefix,
                   segment_lens="[" + ",".join(map(str, lens)) + "]", save_data=str(saved))
    assert first.exit_code == 0, first
    held = {p.stem for p in (saved / "in").iterdir()}
    assert names <= held, held
    replay = tp_run(golden_data=str(saved))
    assert replay.exit_code == 0, replay
    case = replay.result["case"]
    assert (case["layer"], case["segment_lens"], case["prefix"]) == (layer, lens, prefix), replay
    (saved / "manifest.json").unlink()
    bare = tp_run(golden_data=str(saved))
    assert bare.exit_code == 0 and bare.result["case"]["layer"] == layer, bare
