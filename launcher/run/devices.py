"""Backend and device selection: gloo on CPU, nccl on `cuda:<local_rank>`, hccl on `npu:<local_rank>`.

torch_npu is imported lazily, only when the hccl backend is chosen or probed for `auto`, so the
CPU and CUDA paths never need it. Device visibility (CUDA_VISIBLE_DEVICES,
ASCEND_RT_VISIBLE_DEVICES) is honoured because the runtime itself applies it before counting;
a job that holds a job slot sets it, and its cores, in each of its ranks (`enter_job_slot`).
"""

from __future__ import annotations

import datetime
import fcntl
import importlib
import importlib.util
import math
import os
import platform
import socket
import struct
import threading
import time

import torch

from layers.contract.config import ConfigError

from launcher.config.job_slot import JobSlot

DEVICE_TYPE = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}
VISIBLE_DEVICES_ENV = {"nccl": "CUDA_VISIBLE_DEVICES", "hccl": "ASCEND_RT_VISIBLE_DEVICES"}


def _torch_npu():
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise ConfigError(f"backend=hccl needs torch_npu (pip install 'dsv4-tp-harness[npu]'): {e}") from e


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    _torch_npu()
    return bool(torch.npu.is_available())  # attribute added by torch_npu


def resolve_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    if npu_available():
        return "hccl"
    if torch.cuda.is_available():
        return "nccl"
    return "gloo"


def device_count(backend: str) -> int | None:
    """Accelerators visible to this process; None for the CPU (no limit)."""
    if backend == "nccl":
        return torch.cuda.device_count()
    if backend == "hccl":
        _torch_npu()
        return int(torch.npu.device_count())
    return None


def check_devices(backend: str, nproc_per_node: int, slot: JobSlot | None = None) -> None:
    """Refuse more ranks on this node than devices they can see (in the job's slot, if it has one)."""
    if backend not in VISIBLE_DEVICES_ENV:
        return
    visible = VISIBLE_DEVICES_ENV[backend]
    if slot is not None and slot.device_env == visible:  # the slot sliced this backend's devices
        n, seen = len(slot.devices), f"in this job's slot ({slot.describe()})"
        advice = "lower tp or hydra.launcher.n_jobs"
    else:
        n, seen = device_count(backend), f"visible ({visible}={os.environ.get(visible, '<unset>')})"
        advice = "lower tp or use backend=gloo"
    if nproc_per_node > n:
        raise ConfigError(f"{nproc_per_node} ranks per node need {nproc_per_node} {DEVICE_TYPE[backend]} devices "
                          f"but {n} are {seen}; {advice}")


def node_devices() -> tuple[str, list[str]] | tuple[None, None]:
    """(visibility variable, ids) of the accelerators this node's runs would use (`auto`), as
    that variable names them: its own list where it is set, else 0..n-1; (None, None) on a CPU
    node."""
    backend = resolve_backend("auto")
    if backend not in VISIBLE_DEVICES_ENV:
        return None, None
    env = VISIBLE_DEVICES_ENV[backend]
    given = os.environ.get(env)
    if given is not None:
        return env, [d.strip() for d in given.split(",") if d.strip()]
    return env, [str(i) for i in range(device_count(backend))]


def cpu_affinity() -> list[int] | None:
    """The cores this process may run on; None where the platform does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def enter_job_slot(slot: JobSlot | None) -> None:
    """Confine this rank to its job's slot: its cores, and its devices before the runtime counts
    them. Set in each rank, since ranks fork from a forkserver that keeps the job process's
    affinity and environment from when it started."""
    if slot is None:
        return
    os.sched_setaffinity(0, slot.cpus)
    if slot.devices is not None:
        os.environ[slot.device_env] = ",".join(slot.devices)


# What CANN accepts: the connect timeout in [120, 7200] s; the execution timeout counts in
# steps of 68 s (a value between steps is rounded by the runtime).
HCCL_CONNECT_RANGE_S = (120, 7200)
HCCL_EXEC_STEP_S = 68


def collective_timeout_env(backend: str, timeout_s: float, environ: dict[str, str]) -> dict[str, str]:
    """Environment that maps the run's timeout onto the backend's own watchdogs, within the
    ranges the backend accepts; a variable the user set (in `environ`) is kept as it is.
    The launcher's own deadlines (timeout_s, twice that per rank) still bound the run."""
    if backend != "hccl":
        return {}
    low, high = HCCL_CONNECT_RANGE_S
    wanted = {"HCCL_CONNECT_TIMEOUT": str(min(high, max(low, math.ceil(timeout_s)))),
              "HCCL_EXEC_TIMEOUT": str(HCCL_EXEC_STEP_S * max(1, math.ceil(timeout_s / HCCL_EXEC_STEP_S)))}
    return {k: v for k, v in wanted.items() if k not in environ}


def setup_device(backend: str, local_rank: int) -> torch.device:
    """Bind this process to its device and make fp32 GEMMs full precision there."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        # TF32 would change fp32 GEMM results well beyond summation-order noise.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", local_rank)
    if backend == "hccl":
        _torch_npu()
        torch.npu.set_device(local_rank)
        torch.npu.matmul.allow_hf32 = False  # HF32 is the Ascend analogue of TF32
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def local_address_towards(addr: str) -> str:
    """This host's address on the route to `addr` (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


def interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` (Linux), so gloo binds the same interface."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def check_port_free(addr: str, port: int) -> None:
    """Node 0 of a multi-node run binds the store at addr:port: refuse a port already taken.
    With SO_REUSEADDR, as the store binds: the previous run's connections in TIME_WAIT (a
    minute after it ended) do not make the port busy, a socket listening on it does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            raise ConfigError(f"master_port={port} on {addr} cannot be bound ({e.strerror}); choose a free port") from e


def wait_for_node0(addr: str, port: int, timeout_s: float, node_rank: int | None = None) -> None:
    """A node other than 0 waits (up to timeout_s) until node 0's rendezvous store accepts
    connections and answers its client's handshake, and claims its `node_rank` there (None:
    no claim, for a rank of an external launcher): refused with one line if the store never
    answers or another launcher holds that node_rank, before anything is started and without
    the store client's retry logs."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"node 0's rendezvous store at {addr}:{port} did not answer within timeout_s={timeout_s:.0f} s "
                    f"({e.strerror or e}): start node 0 (node_rank=0) with the same master_addr and master_port, or "
                    f"check that this host can reach it") from e
            time.sleep(0.25)
    _store_handshake(addr, port, deadline, timeout_s, node_rank)


# At least this long for the handshake when the connection itself took (nearly) all of timeout_s.
_HANDSHAKE_MIN_S = 1.0


def _store_handshake(addr: str, port: int, deadline: float, timeout_s: float, node_rank: int | None) -> None:
    """A store client's handshake with addr:port, within the deadline, and the claim of
    `node_rank`. torch's client waits for the server's answer with no timeout of its own, so a
    listener that is not a store (any other service on master_port) would hang this node, and
    the rendezvous after it, forever; the client runs in a thread (it releases the GIL) that
    is abandoned if it never answers."""
    import torch.distributed as dist

    left = max(_HANDSHAKE_MIN_S, deadline - time.monotonic())
    outcome: list[BaseException | str | None] = []

    def handshake() -> None:
        try:
            store = dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=left))
            outcome.append(_claim(store, node_rank) if node_rank is not None else None)
        except Exception as e:  # refused, reset, garbage: not node 0's store either
            outcome.append(e)

    thread = threading.Thread(target=handshake, name="store-handshake", daemon=True)
    thread.start()
    thread.join(left)
    if outcome and outcome[0] is None:
        return
    if outcome and isinstance(outcome[0], str):
        raise ConfigError(f"node_rank={node_rank} is already taken in the run at {addr}:{port} by {outcome[0]}: "
                          f"each node needs a node_rank of its own, 1 to nnodes-1 beside node 0")
    why = (f"its handshake failed ({' '.join(str(outcome[0]).split())[:200]})" if outcome
           else f"it did not answer a store client's handshake within timeout_s={timeout_s:.0f} s")
    raise ConfigError(f"{addr}:{port} accepts connections but is not node 0's rendezvous store: {why}; master_port is "
                      f"another service's, or node 0 is stuck: give node 0's master_addr and master_port")


_NODE_RANK_KEY = "dsv4_tp_harness/node_rank/{}"


def _claim(store, node_rank: int) -> str | None:
    """Claim `node_rank` in node 0's store for this launcher; None, or who holds it (a launcher
    of this host whose process is gone holds nothing: its claim is taken over)."""
    me = f"{socket.gethostname()} pid {os.getpid()}"
    key = _NODE_RANK_KEY.format(node_rank)
    holder = store.compare_set(key, "", me).decode()
    host, _, pid = holder.partition(" pid ")
    if holder != me and host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
        holder = store.compare_set(key, holder, me).decode()
    return None if holder == me else holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True


def machine_entry(requested_backend: str, local_ranks: int) -> dict:
    """A run's record of what it ran on: the backend and this node's devices (`device_names`)."""
    backend = resolve_backend(requested_backend)
    return {"backend": backend, "devices": device_names(backend, local_ranks)}


def device_names(backend: str, n: int) -> list[str]:
    """The names of the first `n` devices this node's ranks ran on (the CPU's model for gloo),
    for the record of a run; read after the ranks are gone."""
    if backend == "nccl" and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(min(n, torch.cuda.device_count()))]
    if backend == "hccl" and npu_available():
        return [torch.npu.get_device_name(i) for i in range(min(n, torch.npu.device_count()))]
    return [cpu_model()]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
