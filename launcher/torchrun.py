"""The worker under an external launcher: `torchrun --nproc_per_node 4 -m launcher.torchrun layer=swa tp=4`.

torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT) starts the processes; each composes the same config from its command line, runs
the same preflight checks and the same per-rank worker. Rank 0 prints the report and writes
result.json; every rank exits with rank 0's verdict code (0 PASS, 1 FAIL).
"""

from __future__ import annotations

import json
import os
import sys

from hydra import compose, initialize_config_module

from . import report
from .cli import EXIT_ERROR, EXIT_FAIL, EXIT_PASS, preflight
from .run.launch import LaunchOutcome
from .run.worker import rank_main
from layers.contract.config import ConfigError


def main(argv: list[str]) -> int:
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=argv)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "external")
    output_dir = os.path.abspath(os.environ.get("DSV4_OUTPUT_DIR", os.path.join("outputs", f"torchrun-{run_id}")))
    try:
        spec = preflight(cfg, output_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    result = rank_main(spec)
    if result.get("comparisons") is None:
        return EXIT_PASS if result["passed"] else EXIT_FAIL
    full = report.build_result(spec, LaunchOutcome(result=result, failure=None, log_dir=output_dir), wall_s=0.0)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump(full, f, indent=1)
    print(report.render(full))
    return EXIT_PASS if full["passed"] else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
