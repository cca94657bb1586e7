"""What the implementation under test must keep to on a rank, checked by the harness: it returns
its outputs or raises (no `sys.exit()`, no KeyboardInterrupt of its own), replaces nothing the
golden and the judges run (`launcher.run.golden_guard`), returns the outputs the contract names
in their shapes and dtypes, and changes no pure input in place. A breach is an
`ImplContractError` naming the rank."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

import torch

from layers.contract.tensors import tensor_sha256

from launcher.run import golden_guard


class ImplContractError(RuntimeError):
    """The implementation under test returned something that breaks the layer's contract."""


_SIGINT_RECEIVED = threading.Event()


def note_sigint() -> None:
    """Note a real SIGINT before Python's handler turns it into KeyboardInterrupt (so that one
    the implementation raises itself can be told apart). Main thread only, where handlers live."""
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        return  # ignored or default: no signal becomes a KeyboardInterrupt

    def handler(signum, frame):
        _SIGINT_RECEIVED.set()
        previous(signum, frame)

    signal.signal(signal.SIGINT, handler)


@contextmanager
def implementation_contract(rank: int):
    """The implementation's code returns its outputs or raises an error. A `sys.exit()` or a
    KeyboardInterrupt of its own would end this rank without an error report while its peers
    wait in the next collective, and a peer's timeout would be blamed: both are contract errors
    of this rank. (A KeyboardInterrupt from a real Ctrl-C passes on.)"""
    try:
        yield
    except SystemExit as e:
        raise ImplContractError(f"rank {rank}: the implementation called sys.exit({e.code!r}) "
                                f"instead of returning its outputs or raising an error") from e
    except KeyboardInterrupt as e:
        if _SIGINT_RECEIVED.is_set():
            raise
        raise ImplContractError(f"rank {rank}: the implementation raised KeyboardInterrupt itself (no Ctrl-C "
                                f"reached this rank) instead of returning its outputs or raising an error") from e


def check_harness_untouched(rank: int, when: str) -> None:
    """Refuse to go on where a function the golden or the judges run was replaced
    (`golden_guard`): a golden computed with it would be the implementation's math."""
    changed = golden_guard.changes()
    if changed:
        raise ImplContractError(
            f"rank {rank}: functions the golden and the judges run changed {when}: {'; '.join(changed)}. The "
            "implementation must call its own functions, not replace the harness's or torch's")


def check_outputs(outputs, expected_specs: dict, rank: int) -> None:
    """Refuse, on the rank that produced it, an output the gather and comparators cannot take."""
    if not isinstance(outputs, dict):
        raise ImplContractError(f"rank {rank}: impl returned {type(outputs).__name__}, expected a dict of tensors")
    missing = [n for n in expected_specs if n not in outputs]
    if missing:
        raise ImplContractError(f"rank {rank}: impl did not return {', '.join(missing)}")
    for name, spec in expected_specs.items():
        t = outputs[name]
        if not isinstance(t, torch.Tensor):
            raise ImplContractError(f"rank {rank}: impl output '{name}' is {type(t).__name__}, expected a tensor")
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise ImplContractError(
                f"rank {rank}: impl output '{name}' has shape {tuple(t.shape)} dtype {t.dtype}, "
                f"expected shape {spec.shape} dtype {spec.dtype}"
            )


def check_inputs_unchanged(tensors: dict[str, torch.Tensor], digests: dict[str, str], rank: int) -> None:
    """Refuse an implementation that changed a pure input in place (only in-outs may change):
    `digests` are the inputs' sha256 taken when the fixture was built."""
    changed = [n for n, digest in digests.items() if tensor_sha256(tensors[n]) != digest]
    if changed:
        raise ImplContractError(f"rank {rank}: impl changed its pure input(s) {', '.join(changed)} in place "
                                "(the contract lets only the in-out caches and states change)")
