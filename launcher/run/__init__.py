"""Orchestration: the checks against this machine, the elastic launch of one process per rank, and
what each rank does (fixture, golden, layer, gather, compare)."""
