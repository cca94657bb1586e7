"""Distributed tests: layers and scopes on real gloo ranks (tests/rank_harness.py), without the launcher."""
