"""Collectives on a TP process group: the one raw-byte wire format and the spec's data movements."""
