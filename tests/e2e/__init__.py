"""End-to-end tests: the launcher, its CLI, sweeps, nodes, snapshots and reports, as real processes."""
