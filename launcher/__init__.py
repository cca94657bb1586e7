"""The orchestrator: Hydra config -> checks -> elastic launch of one process per rank -> report."""
