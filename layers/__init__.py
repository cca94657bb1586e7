"""DeepSeek-V4-Flash decode layers, one package each (swa, csa, hca, moe), and what they share."""
