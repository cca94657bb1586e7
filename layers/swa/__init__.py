"""The SWA decode layer (compress ratio 0): its stage list and checks (`layer`), its fixture."""
