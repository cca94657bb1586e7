"""The CSA decode layer (compress ratio 4, sparse indexer): its stage list and checks (`layer`), its fixture."""
