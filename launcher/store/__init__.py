"""Tensors on disk: the reference snapshot layout and the golden cache."""
