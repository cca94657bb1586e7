"""The public reference's own fixture and golden of one CP prefill case, on this CPU.

    python scripts/reference_prefill_run.py --reference PATH --layer swa|hca [--cp 2] [--threads N]

PATH is a checkout of pypto-lib (https://github.com/hw-native-sys/pypto-lib); nothing of it
is copied here: this script imports its `models/deepseek_v4_flash_mtp/prefill_cp_<layer>.py`
and `golden/` at run time and calls, as that module's own `__main__` does,

    built = build_tensor_specs(cp)                  # SWA: (specs, ctx); HCA: specs
    tensors = {spec.name: spec.create_tensor() ...}  # materialized, as golden.run_jit does
    golden_prefill_cp_<layer>(tensors)               # every rank's outputs (SWA: with _ctx = ctx)

with the real dims of its `config.py` (the canonical case: zigzag, segments of 128, no
history). Its kernels need pypto (a device compiler), which does not install here; the pypto
modules are stubbed as in `reference_run.py`. The module parses `--cp` from `sys.argv` at
import, so `sys.argv` is set around it.

Prints one JSON line: seconds (wall) and CPU-seconds (this process, every thread) of the
imports, the fixture and the golden, the golden's thread count and the peak RSS. `--threads`
sets `PYPTO_GOLDEN_NUM_THREADS` (the reference's `golden` package sets torch's thread count
from it at import, default 16). The process ends without the interpreter's teardown, as
`reference_run.py` does. Not part of the harness: `scripts/bench.py prefill --reference PATH`
runs it.
"""

from __future__ import annotations

import os
import resource
import sys
import time

from reference_run import emit, parser, stub_pypto

LAYERS = ("swa", "hca")


def run(reference: str, layer: str, cp: int, threads: int | None) -> dict:
    model_dir = os.path.join(reference, "models", "deepseek_v4_flash_mtp")
    module_name = f"prefill_cp_{layer}"
    if not os.path.isfile(os.path.join(model_dir, f"{module_name}.py")):
        raise SystemExit(f"{reference} is not a pypto-lib checkout with CP prefill: {model_dir}/{module_name}.py "
                         f"is missing")
    if threads is not None:
        os.environ["PYPTO_GOLDEN_NUM_THREADS"] = str(threads)
    t0, c0 = time.perf_counter(), time.process_time()
    stub_pypto()
    sys.path[:0] = [model_dir, reference]
    argv, sys.argv = sys.argv, [sys.argv[0], "--cp", str(cp)]
    try:
        import importlib

        import torch

        module = importlib.import_module(module_name)
        from golden import ScalarSpec
    finally:
        sys.argv = argv
    t_import, c_import = time.perf_counter(), time.process_time()
    built = module.build_tensor_specs(cp)
    specs, ctx = built if isinstance(built, tuple) else (built, None)
    tensors = {s.name: s.to_python() if isinstance(s, ScalarSpec) else s.create_tensor() for s in specs}
    t_fixture, c_fixture = time.perf_counter(), time.process_time()
    golden = getattr(module, f"golden_prefill_cp_{layer}")
    if ctx is not None:
        golden._ctx = ctx  # as its __main__ hands the golden the metadata context
    golden(tensors)
    t_golden, c_golden = time.perf_counter(), time.process_time()
    return {"layer": layer, "cp": cp, "threads": torch.get_num_threads(),
            "import_s": t_import - t0, "fixture_s": t_fixture - t_import, "golden_s": t_golden - t_fixture,
            "import_cpu_s": c_import - c0, "fixture_cpu_s": c_fixture - c_import, "golden_cpu_s": c_golden - c_fixture,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "x_out_finite": bool(torch.isfinite(tensors["x_out"]).all())}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--layer", choices=LAYERS, required=True)
    ap.add_argument("--cp", type=int, default=2)
    args = ap.parse_args()
    emit(run(os.path.abspath(args.reference), args.layer, args.cp, args.threads))

if __name__ == "__main__":
    main()
