"""The public reference's own fixture and golden of one CSA decode case, on this CPU.

    python scripts/reference_run.py --reference PATH [--tp 2] [--local-t 64] [--threads N]

PATH is a checkout of pypto-lib (https://github.com/hw-native-sys/pypto-lib); nothing of it
is copied here: this script imports its `models/deepseek_v4_flash_dspark/decode_csa.py` and
`golden/` at run time and calls, as its own `__main__` does for a TP run,

    specs = build_distributed_tensor_specs(local_t)         # the fixture of every TP rank
    tensors = {spec.name: spec.create_tensor() ...}           # materialized, as golden.run_jit does
    golden_decode_csa(tensors)                                # the TP1 golden of each rank's shard

with the flash dims of its `config.py`. Its kernels need pypto (a device compiler), which
does not install here; the fixture and golden are plain torch and only need pypto's modules to
import: `stub_pypto` puts permissive stand-ins for them into `sys.modules` for this process.
The reference module parses `--tp` from `sys.argv` at import, so `sys.argv` is set around it.

Prints one JSON line: seconds for the imports (torch, the reference modules), the fixture and
the golden, and the golden's thread count. `--threads` sets `PYPTO_GOLDEN_NUM_THREADS` (the
reference's `golden` package sets torch's thread count from it at import, default 16);
without it the reference's own default stands. The process then ends without the
interpreter's teardown (as the launcher does), so only the work above is timed by a caller.
Not part of the harness: `scripts/bench.py flash --reference PATH` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

T0 = time.perf_counter()


class _Anything:
    """Whatever the reference's kernel definitions ask of pypto at import: attributes, calls,
    subscripts (type annotations `pl.Tensor[...]`), arithmetic on dims, base classes. Used as a
    decorator (`@pl.jit.inline`, `@pl.function(...)`), it hands the function back unchanged."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Anything):
            return args[0]
        return _Anything()

    def __getitem__(self, key):
        return _Anything()

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)

    def _same(self, *args):
        return _Anything()

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _same
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _same
    __neg__ = __pow__ = __rpow__ = __or__ = __ror__ = __and__ = __rand__ = _same


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


# The pypto modules the reference's model files import at module level.
PYPTO_MODULES = ("pypto", "pypto.language", "pypto.language.distributed", "pypto.ir", "pypto.ir.distributed_compiled_program")


def stub_pypto() -> None:
    for name in PYPTO_MODULES:
        if name not in sys.modules:
            module = _StubModule(name)
            module.__path__ = []  # a package, so that its submodules import
            sys.modules[name] = module


def run(reference: str, tp: int, local_t: int, threads: int | None) -> dict:
    model_dir = os.path.join(reference, "models", "deepseek_v4_flash_dspark")
    if not os.path.isfile(os.path.join(model_dir, "decode_csa.py")):
        raise SystemExit(f"{reference} is not a pypto-lib checkout: {model_dir}/decode_csa.py is missing")
    if threads is not None:
        os.environ["PYPTO_GOLDEN_NUM_THREADS"] = str(threads)
    stub_pypto()
    sys.path[:0] = [model_dir, reference]
    argv, sys.argv = sys.argv, [sys.argv[0], "--tp", str(tp)]
    try:
        import torch

        import decode_csa
        from golden import ScalarSpec
    finally:
        sys.argv = argv
    t_import = time.perf_counter()
    specs = decode_csa.build_distributed_tensor_specs(local_t)
    tensors = {s.name: s.to_python() if isinstance(s, ScalarSpec) else s.create_tensor() for s in specs}
    t_fixture = time.perf_counter()
    decode_csa.golden_decode_csa(tensors)
    t_golden = time.perf_counter()
    return {"import_s": t_import - T0, "fixture_s": t_fixture - t_import, "golden_s": t_golden - t_fixture,
            "threads": torch.get_num_threads(), "tp": tp, "local_t": local_t,
            "x_out_finite": bool(torch.isfinite(tensors["x_out"]).all())}


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every reference runner takes: the checkout and the golden's threads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="a pypto-lib checkout")
    ap.add_argument("--threads", type=int, default=None, help="PYPTO_GOLDEN_NUM_THREADS (default: the reference's)")
    return ap


def emit(result: dict) -> None:
    """The one JSON line, then exit without the interpreter's teardown (torch's destructors):
    the caller times the work above."""
    print(json.dumps(result), flush=True)
    os._exit(0)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--local-t", type=int, default=64)
    args = ap.parse_args()
    emit(run(os.path.abspath(args.reference), args.tp, args.local_t, args.threads))


if __name__ == "__main__":
    main()
