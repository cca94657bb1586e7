"""Context-parallel (CP) prefill of the attention layers (docs/prefill.md)."""
