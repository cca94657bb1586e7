"""Slurm: the node keys from srun's environment, with real launchers on loopback given the
SLURM_* variables srun would set (two "nodes" share one output folder, as a Slurm job's nodes do);
the shipped submitit launcher config for Slurm."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest
import yaml

from launcher.config.slurm import PORT_BASE, PORT_SPAN, expand_nodelist, slurm_step, tasks_per_node
from layers.contract.config import ConfigError

from ..conftest import REPO

pytestmark = pytest.mark.timeout(300)


def test_compressed_node_lists_and_task_counts():
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("gpu-a[1-2]-b[3,5],login1") == ["gpu-a1-b3", "gpu-a1-b5", "gpu-a2-b3", "gpu-a2-b5", "login1"]
    assert expand_nodelist("127.0.0.[1-2]") == ["127.0.0.1", "127.0.0.2"]
    assert tasks_per_node("8(x2),4") == [8, 8, 4]
    with pytest.raises(ConfigError, match="unbalanced"):
        expand_nodelist("node[1-2")
    with pytest.raises(ConfigError, match="lo <= hi"):
        expand_nodelist("node[3-1]")


def test_a_batch_script_without_srun_is_no_step():
    # sbatch's batch step has the job's variables on its first node alone: no multi-node job.
    batch = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "2",
             "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert slurm_step(batch) is None
    step = slurm_step({**batch, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "node[1-2]"})
    assert (step.nnodes, step.node_rank, step.master_addr, step.tasks_here) == (2, 0, "node1", 1)
    assert step.master_port == PORT_BASE + 7


def _job_id_with_free_port() -> str:
    """A Slurm job id whose derived master port is free here."""
    for _ in range(100):
        job_id = random.randrange(10**6, 10**7)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", PORT_BASE + job_id % PORT_SPAN))
            except OSError:
                continue
        return str(job_id)
    pytest.skip("no free port in the derived range")


def _slurm_env(node: int, job_id: str, nnodes: int = 2, tasks: str = "1(x2)") -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), SLURM_JOB_ID=job_id, SLURM_STEP_ID="0", SLURM_PROCID=str(node),
                SLURM_NODEID=str(node),
                SLURM_LOCALID="0", SLURM_NNODES=str(nnodes), SLURM_NTASKS=str(nnodes),
                SLURM_JOB_NODELIST=f"127.0.0.[1-{nnodes}]", SLURM_STEP_TASKS_PER_NODE=tasks)


def _launcher(args, out, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher", *args, f"hydra.run.dir={out}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_one_command_per_node_under_srun_forms_one_job(tmp_path):
    job_id = _job_id_with_free_port()
    out = tmp_path / "job"  # one folder for both nodes, as a Slurm job's output folder is
    args = ["layer=swa", "tp=2", "model=tiny"]  # no per-node key at all
    procs = {node: _launcher(args, out, _slurm_env(node, job_id)) for node in (1, 0)}
    outs = {node: p.communicate(timeout=200)[0] for node, p in procs.items()}
    assert procs[0].returncode == 0 and "VERDICT: PASS" in outs[0], outs[0]
    assert procs[1].returncode == 0 and "node 1: rank 0 on node 0 compared; its verdict: PASS" in outs[1], outs[1]
    node0 = json.loads((out / "result.json").read_text())
    assert node0["node_rank"] == 0 and node0["verdicts"] and node0["passed"] is True
    node1 = json.loads((out / "node1" / "result.json").read_text())
    assert node1["node_rank"] == 1 and node1["compared_on_node"] == 0


def test_a_defect_under_srun_fails_both_nodes(tmp_path):
    job_id = _job_id_with_free_port()
    args = ["layer=swa", "tp=2", "model=tiny", "impl=tests.defects.PerturbRankTokens"]
    procs = {node: _launcher(args, tmp_path / "job", _slurm_env(node, job_id)) for node in (1, 0)}
    outs = {node: p.communicate(timeout=200)[0] for node, p in procs.items()}
    assert procs[0].returncode == 1 and procs[1].returncode == 1, outs
    assert "x_out FAIL" in outs[0]


@pytest.mark.parametrize("args, env_over, message", [
    (["nnodes=3"], {}, "error: nnodes=3 disagrees with the Slurm step of 2 nodes (127.0.0.1,127.0.0.2), where this "
                       "node's nnodes is 2"),
    (["node_rank=0"], {"SLURM_NODEID": "1", "SLURM_PROCID": "1"}, "error: node_rank=0 disagrees with the Slurm step"),
    ([], {"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4"},
     "error: srun started 2 tasks on this node, but python -m launcher starts the node's ranks itself"),
    ([], {"SLURM_JOB_NODELIST": "node[1-3]"}, "error: SLURM_JOB_NODELIST=node[1-3] names 3 hosts but SLURM_NNODES=2"),
])
def test_a_contradiction_with_slurm_is_refused_before_any_rank_starts(tmp_path, args, env_over, message):
    env = {**_slurm_env(0, "1234"), **env_over}
    p = subprocess.run([sys.executable, "-m", "launcher", "layer=swa", "tp=2", "model=tiny", *args,
                        f"hydra.run.dir={tmp_path}/out"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), p.stderr
    assert not (tmp_path / "out" / "logs").exists() or not any((tmp_path / "out" / "logs").iterdir())


def test_explicit_keys_win_where_they_agree(tmp_path):
    # master_addr given: taken as it is (the first host of the list would be 127.0.0.1 too).
    env = {**_slurm_env(0, "1234"), "SLURM_NNODES": "1", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "127.0.0.1",
           "SLURM_STEP_TASKS_PER_NODE": "1"}
    p = subprocess.run([sys.executable, "-m", "launcher", "layer=swa", "tp=2", "model=tiny", "nnodes=1",
                        "master_addr=127.0.0.1", f"hydra.run.dir={tmp_path}/out"], env=env, capture_output=True,
                       text=True, timeout=200)
    assert p.returncode == 0 and "VERDICT: PASS" in p.stdout, p.stdout + p.stderr


def test_launcher_torchrun_under_srun_one_task_per_rank(tmp_path):
    job_id = _job_id_with_free_port()
    procs = []
    for rank in (1, 0):
        env = dict(_slurm_env(0, job_id, nnodes=1, tasks="2"), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                   SLURM_NTASKS="2", SLURM_JOB_NODELIST="127.0.0.1", DSV4_OUTPUT_DIR=str(tmp_path / "out"))
        procs.append(subprocess.Popen([sys.executable, "-m", "launcher.torchrun", "layer=swa", "tp=2", "model=tiny"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "KeyError" not in "".join(outs) and "VERDICT: PASS" in outs[1], outs
    assert json.loads((tmp_path / "out" / "result.json").read_text())["passed"] is True


def test_the_slurm_launcher_config_composes_and_instantiates(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    p = subprocess.run([sys.executable, "-m", "launcher", "hydra/launcher=slurm", "layer=swa", "tp=8", "nnodes=2",
                        "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=4", "hydra.launcher.timeout_min=30",
                        "--cfg", "all", "-p", "hydra.launcher", "--resolve"],
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    launcher = yaml.safe_load(p.stdout.split("\n", 1)[1])  # after the `# @package` line
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["partition"], launcher["gpus_per_node"],
            launcher["timeout_min"]) == (2, 1, "gpu", 4, 30)
    # The options are the launcher's own: the plugin accepts every key.
    from hydra.utils import instantiate

    slurm = instantiate(launcher)
    assert slurm.params["nodes"] == 2 and slurm.params["partition"] == "gpu"
