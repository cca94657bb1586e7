"""The whole decoder layer, `layer=block`: attention in TP groups, then the MoE expert-parallel.
Its case (`case`, torch-free) and its layer (`layer`)."""
