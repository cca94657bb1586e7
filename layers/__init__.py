"""DeepSeek-V4-Flash TP decode attention layers (SWA, CSA, HCA): goldens, fixtures, TP code."""
