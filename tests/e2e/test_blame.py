"""The root cause named is the rank whose implementation broke the run, not a peer that timed
out waiting for it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("impl, message", [
    ("ExitOnRank1", "rank 1: the implementation called sys.exit(0) instead of returning its outputs"),
    ("InterruptOnRank1", "rank 1: the implementation raised KeyboardInterrupt itself"),
    ("ExtraCollectiveOnceRank0MovedOn", "rank 1 was left behind in phase 'layer' while ranks [0] had moved on to "
                                        "'gather': it entered a collective they never entered"),
])
def test_the_rank_that_broke_the_run_is_named(tp_run, tmp_path, impl, message):
    # The extra collective waits for rank 0's own progress event, so a loaded machine cannot make
    # rank 0 look left behind too; the timeout only has to outlast that one event.
    progress = [f"+impl.progress={tmp_path / 'run1' / 'progress' / 'rank0.jsonl'}"] if "MovedOn" in impl else []
    run = tp_run(layer="swa", tp=2, model="tiny", timeout_s=5, golden_cache=None,
                 overrides=[f"impl._target_=tests.defects.{impl}", *progress])
    assert run.exit_code == 2, run
    err = run.result["error"]
    assert (err["rank"], err["phase"]) == (1, "layer"), run
    assert message in err["message"], run
