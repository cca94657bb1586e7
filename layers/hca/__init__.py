"""The HCA decode layer (compress ratio 128): its stage list and checks (`layer`), its fixture."""
