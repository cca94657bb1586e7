"""The worker under an external launcher: `torchrun --nproc_per_node 4 -m launcher.torchrun layer=swa tp=4`.

torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT) starts the processes; each composes the same config from its command line, runs
the same preflight checks and the same per-rank worker. Rank 0 prints the report and writes
result.json; every rank exits with rank 0's verdict code (0 PASS, 1 FAIL).
"""

from __future__ import annotations

import os
import sys

from hydra import compose, initialize_config_module

from launcher.run.preflight import preflight
from launcher.report.console import render
from launcher.report.result import EXIT_ERROR, build_result, exit_code
from launcher.report.run_page import write_result_and_page
from launcher.run.worker import rank_main
from layers.contract.config import ConfigError


def main(argv: list[str]) -> int:
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=argv)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "external")
    output_dir = os.path.abspath(os.environ.get("DSV4_OUTPUT_DIR", os.path.join("outputs", f"torchrun-{run_id}")))
    try:
        spec = preflight(cfg, output_dir, argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    rank_result = rank_main(spec)
    result = build_result(spec, rank_result=rank_result, error=None, log_dir=output_dir, wall_s=0.0)
    if rank_result.get("reporting"):  # the comparing rank reports for the run
        write_result_and_page(output_dir, result)
        print(render(result))
    return exit_code(result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
