"""What the three attention layers (swa, csa, hca) share: the front stages, the TP output half,
the O-weight fixture, the `AttentionLayer` base and the focused scopes of the output half."""
