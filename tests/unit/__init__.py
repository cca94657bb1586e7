"""Unit tests: the spec's math, fixtures, comparators, config and report pages, in one process."""
