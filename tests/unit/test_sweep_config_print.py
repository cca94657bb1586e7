"""`-m ... --cfg hydra`: every job's printed config carries the command line's Hydra choices."""

from __future__ import annotations

import pytest
import yaml

from launcher.sweep_config import print_sweep_configs


def test_a_chosen_launcher_and_its_keys_hold_in_every_jobs_config(capsys):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    refusal = print_sweep_configs(["-m", "hydra/launcher=slurm", "layer=swa,hca", "tp=8", "nnodes=2",
                                   "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=30", "--cfg", "hydra"])
    assert refusal is None
    jobs = capsys.readouterr().out.split("# job ")[1:]
    assert len(jobs) == 2
    for job in jobs:
        launcher = yaml.safe_load(job.split("\n", 1)[1])["hydra"]["launcher"]
        assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
        assert (launcher["partition"], launcher["timeout_min"]) == ("gpu", 30)
