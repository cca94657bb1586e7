"""The EP MoE layer: its stage list and checks (`layer`), its fixture, its collectives scope."""
