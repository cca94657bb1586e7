"""Multi-node runs with two "nodes" on this machine: two launchers, torchrun-style keys."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

from hydra import compose, initialize_config_module

from launcher.config.spec import run_spec
from launcher.run import devices, nodes
from layers.contract.config import ConfigError

from ..conftest import REPO

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher(args: list[str], out, prefix: list[str] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "launcher", *args, f"hydra.run.dir={out}"],
        env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _two_nodes(tmp_path, common: list[str], node_args=({}, {}), prefixes=((), ()), addr="127.0.0.1"):
    port = _free_port()
    procs = []
    for node in (1, 0):  # the non-host node first: it waits for node 0 at the rendezvous
        extra = [f"{k}={v}" for k, v in node_args[node].items()]
        args = [*common, "nnodes=2", f"node_rank={node}", f"master_addr={addr}", f"master_port={port}", *extra]
        procs.append(_launcher(args, tmp_path / f"node{node}", prefixes[node]))
    outs = [p.communicate(timeout=150)[0] for p in procs]
    return {1: (procs[0].returncode, outs[0]), 0: (procs[1].returncode, outs[1])}


def test_two_nodes_on_loopback_pass_and_agree_on_the_verdict(tmp_path):
    res = _two_nodes(tmp_path, ["layer=swa", "tp=2", "model=tiny"])
    assert res[0][0] == 0 and "VERDICT: PASS" in res[0][1], res[0][1]
    assert res[1][0] == 0 and "node 1: rank 0 on node 0 compared; its verdict: PASS" in res[1][1], res[1][1]


def test_a_defect_on_node_1_fails_both_nodes(tmp_path):
    res = _two_nodes(tmp_path, ["layer=swa", "tp=2", "model=tiny", "impl=tests.defects.PerturbRankTokens"])
    assert res[0][0] == 1 and res[1][0] == 1, res
    assert "x_out FAIL" in res[0][1]


@pytest.mark.parametrize("key, value", [("seed", 5), ("scope", "tp1")])
def test_nodes_with_different_configs_are_refused_on_both(tmp_path, key, value):
    res = _two_nodes(tmp_path, ["layer=swa", "tp=2", "model=tiny"], node_args=({}, {key: value}))
    for node in (0, 1):
        assert res[node][0] == 2, res[node][1]
        assert f"nodes disagree on {key}: node 0" in res[node][1] and f"has {key}={value}" in res[node][1]


def _changed(value):
    """Another value of the same kind."""
    if value is None:
        return "/elsewhere"
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, dict):
        return {**value, "extra": 1}
    if isinstance(value, tuple):
        return (*value, 1)
    if dataclasses.is_dataclass(value):  # its first field changed
        first = dataclasses.fields(value)[0].name
        return dataclasses.replace(value, **{first: _changed(getattr(value, first))})
    raise TypeError(type(value))


def test_every_key_of_the_run_is_agreed_on_unless_it_is_the_nodes_own():
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=["layer=swa", "tp=2", "model=tiny", "nnodes=2", "save_data=/x"])
    spec = run_spec(cfg, "/out")
    base = nodes.fingerprint(spec)
    for f in dataclasses.fields(spec):
        if f.name == "case":
            for g in dataclasses.fields(spec.case):
                case = dataclasses.replace(spec.case, **{g.name: _changed(getattr(spec.case, g.name))})
                assert nodes.fingerprint(dataclasses.replace(spec, case=case)) != base, g.name
            continue
        changed = nodes.fingerprint(dataclasses.replace(spec, **{f.name: _changed(getattr(spec, f.name))}))
        if f.name in nodes.NODE_LOCAL or f.name == "save_data":  # save_data: set on both, in another folder
            assert changed == base, f.name
        else:
            assert changed != base, f.name


def test_a_node_that_never_joins_times_out_clearly(tmp_path):
    p = _launcher(["layer=swa", "tp=2", "model=tiny", "nnodes=2", "node_rank=0", f"master_port={_free_port()}", "timeout_s=4"],
                  tmp_path / "node0")
    out = p.communicate(timeout=240)[0]  # the run ends after 4 s; the margin is for a loaded machine
    assert p.returncode == 2, out
    assert "timed out after 4 s: not all 2 nodes joined" in out


def test_a_node_whose_node_0_gave_up_on_a_missing_node_says_so(tmp_path):
    # nnodes=3, node 2 never starts. Node 1 is started first and waits for node 0's store;
    # node 0 (the shorter timeout_s) gives up on node 2 and closes its store under node 1.
    port = _free_port()
    common = ["layer=swa", "tp=1", "dp=3", "model=tiny", "nnodes=3", f"master_port={port}"]
    node1 = _launcher([*common, "node_rank=1", "timeout_s=120"], tmp_path / "node1")
    node0 = _launcher([*common, "node_rank=0", "timeout_s=15"], tmp_path / "node0")
    outs = {0: node0.communicate(timeout=240)[0], 1: node1.communicate(timeout=240)[0]}
    assert node0.returncode == 2 and "timed out after 15 s: not all 3 nodes joined" in outs[0], outs[0]
    assert node1.returncode == 2, outs[1]
    assert f"node 1 reached node 0's rendezvous store at 127.0.0.1:{port}, which then failed before all 3 nodes joined" \
        in outs[1], outs[1]
    assert "could not reach" not in outs[1]


def test_a_node_rank_started_twice_is_refused_and_the_run_goes_on(tmp_path):
    # Both node_rank=1 launchers wait for node 0's store; whichever claims node_rank=1 first
    # runs with node 0, the other is refused before it starts anything.
    port = _free_port()
    common = ["layer=swa", "tp=2", "model=tiny", "nnodes=2", f"master_port={port}", "timeout_s=60"]
    twins = [_launcher([*common, "node_rank=1"], tmp_path / f"node1-{k}") for k in (0, 1)]
    node0 = _launcher([*common, "node_rank=0"], tmp_path / "node0")
    outs = [p.communicate(timeout=240)[0] for p in (node0, *twins)]
    assert node0.returncode == 0 and "VERDICT: PASS" in outs[0], outs[0]
    codes = sorted((p.returncode, out) for p, out in zip(twins, outs[1:]))
    (ran, ran_out), (refused, refused_out) = codes
    assert ran == 0 and "its verdict: PASS" in ran_out, ran_out
    assert refused == 2 and f"node_rank=1 is already taken in the run at 127.0.0.1:{port} by" in refused_out, refused_out
    assert "is_failed" not in refused_out


def test_a_node_dying_mid_run_is_named_by_the_other(tmp_path):
    common = ["layer=swa", "tp=4", "model=tiny", "timeout_s=8", "fault.kind=exit", "fault.rank=3"]
    res = _two_nodes(tmp_path, common)
    assert res[0][0] == 2 and res[1][0] == 2
    assert "a rank on another node failed or stopped during phase 'layer': node 1 (ranks 2-3)" in res[0][1], res[0][1]
    assert "rank 3" in res[1][1] and "phase 'layer'" in res[1][1], res[1][1]


def test_a_node_without_node_0_is_refused_with_one_line_before_launch(tp_run):
    port = _free_port()
    run = tp_run(layer="swa", tp=2, model="tiny", timeout_s=2, overrides=["nnodes=2", "node_rank=1", f"master_port={port}"])
    assert run.exit_code == 2 and run.status == "config-error", run
    assert f"node 0's rendezvous store at 127.0.0.1:{port} did not answer within timeout_s=2 s" in run.report, run
    assert not os.path.exists(os.path.join(run.output_dir, "logs"))  # nothing was launched


def test_a_master_port_that_is_another_service_is_refused_not_waited_on_forever(tmp_path):
    # A listener of our own that accepts and never answers, as any other service would treat
    # a store client's handshake: the TCP connection succeeds, the store's answer never comes.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        p = _launcher(["layer=swa", "tp=2", "model=tiny", "nnodes=2", "node_rank=1", f"master_port={port}", "timeout_s=2"],
                      tmp_path / "n1")
        try:
            out = p.communicate(timeout=120)[0]  # a safety net: without the handshake's deadline it never ends
        finally:
            p.kill()
            p.wait()
    assert p.returncode == 2, out
    assert f"127.0.0.1:{port} accepts connections but is not node 0's rendezvous store" in out, out
    assert "within timeout_s=2 s" in out, out
    assert not (tmp_path / "n1" / "logs").exists()  # nothing was launched


def test_a_port_in_time_wait_is_free_but_a_listening_one_is_not():
    # As the rendezvous store does: a listener with SO_REUSEADDR, whose side of a connection
    # closes first, so that the connection lingers in TIME_WAIT on the store's port for a
    # minute after the run (a back-to-back run on the same master_port then finds it).
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = server.accept()
            conn.close()  # node 0's side closes first: its end of the connection is in TIME_WAIT
        with pytest.raises(ConfigError, match=f"master_port={port} on 127.0.0.1 cannot be bound"):
            devices.check_port_free("127.0.0.1", port)  # still listening
    devices.check_port_free("127.0.0.1", port)


def test_master_port_in_use_is_refused_before_launch(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = _launcher(["layer=swa", "tp=2", "model=tiny", "nnodes=2", "node_rank=0", f"master_port={port}"], tmp_path / "n0")
        out = p.communicate(timeout=60)[0]
    assert p.returncode == 2 and f"master_port={port} on 127.0.0.1 cannot be bound" in out, out


@pytest.mark.parametrize("bad, message", [
    (["nnodes=2", "node_rank=2"], "node_rank=2 must be in [0, 2)"),
    (["nnodes=3"], "x nnodes=3 must equal tp=2"),
    (["nnodes=2", "master_port=0"], "master_port=0 must be a TCP port"),
])
def test_bad_node_keys(tp_run, bad, message):
    run = tp_run(layer="swa", tp=2, model="tiny", overrides=bad)
    assert run.exit_code == 2 and message in run.report


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, each with its own address."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns, veth = [f"dsv4a{tag}", f"dsv4b{tag}"], [f"va{tag}", f"vb{tag}"]
    addrs = ["10.231.7.1", "10.231.7.2"]
    run = lambda *cmd: subprocess.run(cmd, check=True, capture_output=True)  # noqa: E731
    try:
        for n in ns:
            run("ip", "netns", "add", n)
            run("ip", "-n", n, "link", "set", "lo", "up")
        run("ip", "link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1], "netns", ns[1])
        for n, v, a in zip(ns, veth, addrs):
            run("ip", "-n", n, "addr", "add", f"{a}/24", "dev", v)
            run("ip", "-n", n, "link", "set", v, "up")
    except subprocess.CalledProcessError as e:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    yield ns, addrs
    for n in ns:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_two_hosts_in_network_namespaces(tmp_path, two_hosts):
    ns, addrs = two_hosts
    prefixes = (["ip", "netns", "exec", ns[0]], ["ip", "netns", "exec", ns[1]])
    res = _two_nodes(tmp_path, ["layer=swa", "tp=2", "model=tiny"], prefixes=prefixes, addr=addrs[0])
    assert res[0][0] == 0 and "VERDICT: PASS" in res[0][1], res[0][1]
    assert res[1][0] == 0 and "its verdict: PASS" in res[1][1], res[1][1]
