"""A CP prefill snapshot made by the public reference itself, at its own (flash) dims.

    python -O scripts/reference_prefill_snapshot.py --reference PATH --out DIR [--layer csa] [--cp 2]

PATH is a checkout of pypto-lib (https://github.com/hw-native-sys/pypto-lib); nothing of it is
copied here. The script imports the reference's `models/deepseek_v4_flash_mtp/prefill_cp_<layer>.py`
(its kernels stubbed: `reference_run.stub_pypto`) and calls, as its `__main__` does,

    specs = build_tensor_specs(cp)          # every rank's canonical fixture, rank-stacked
    golden_prefill_cp_<layer>(tensors)      # its golden, in place

then writes DIR in the reference golden-harness layout (`in/<name>.pt`: inputs, in-out tensors
before the golden; `out/<name>.pt`: the compared tensors after it), which
`python -m launcher golden_data=DIR` replays (docs/prefill.md §12). The canonical case is the
only one the reference builds (zigzag, no history, segments of 128). About 400 MB at cp=2.
"""

from __future__ import annotations

import argparse
import os
import sys

from reference_run import stub_pypto

LAYERS = ("csa", "hca")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="a pypto-lib checkout")
    ap.add_argument("--out", required=True, help="the snapshot folder to write")
    ap.add_argument("--layer", choices=LAYERS, default="csa")
    ap.add_argument("--cp", type=int, default=2, choices=(2, 4, 8))
    args = ap.parse_args()
    model_dir = os.path.join(os.path.abspath(args.reference), "models", "deepseek_v4_flash_mtp")
    if not os.path.isfile(os.path.join(model_dir, f"prefill_cp_{args.layer}.py")):
        raise SystemExit(f"{args.reference} is not a pypto-lib checkout with prefill_cp_{args.layer}.py")
    stub_pypto()
    sys.path[:0] = [model_dir, os.path.abspath(args.reference)]
    sys.argv = [sys.argv[0], "--cp", str(args.cp)]  # the reference reads its CP size at import
    import importlib

    import torch

    module = importlib.import_module(f"prefill_cp_{args.layer}")
    specs = module.build_tensor_specs(args.cp)
    tensors = {s.name: s.create_tensor() for s in specs}
    outputs = [s.name for s in specs if s.is_output]
    before = {n: t.clone() for n, t in tensors.items() if n != "x_out"}  # x_out: an output only
    getattr(module, f"golden_prefill_cp_{args.layer}")(tensors)
    for folder, held in (("in", before), ("out", {n: tensors[n] for n in outputs})):
        os.makedirs(os.path.join(args.out, folder), exist_ok=True)
        for name, t in held.items():
            torch.save(t.contiguous(), os.path.join(args.out, folder, f"{name}.pt"))
    print(f"{args.out}: {len(before)} inputs, {len(outputs)} outputs of prefill_cp_{args.layer} cp={args.cp}")


if __name__ == "__main__":
    main()
