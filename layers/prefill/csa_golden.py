"""The independent CSA golden: CSA prefill on one device over the whole prompt (docs/prefill.md §12).

Built from positions alone, never from the CP tables the stage list reads. The SWA golden's
projection and window keys; both ratio-4 compressors over the prompt (`csa_math`): every
position's state rows, positions before the step from the pools' history; each block ending
in the step pooled into its main row and its int8 indexer row at logical slot (b + 1)/4 − 1.
Each query scores the compressed rows it may see (history rows, then the step's), attends to
its window and its top-k rows. Afterwards every rank's pools, each through the rank's own
tables: the step's compressed rows, both compressors' states of the step's last <= 8
positions, the final raw window.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..components import attention
from . import csa_math, csa_tables
from . import golden as swa_golden
from .case import PrefillCase
from .csa_fixture import POOLS, history_positions

STATE_POOLS = (("compress_state", "compress_state_block_table", csa_math.MAIN),
               ("inner_compress_state", "inner_compress_state_block_table", csa_math.INNER))


def logical_compressed(case: PrefillCase, w: Mapping[str, torch.Tensor], step: tuple) -> tuple[torch.Tensor, ...]:
    """Every compressed row a query may see in logical order, `(cmp, idx, idx_scale)`: the
    history's (read through the tables of `w`) then the step's `step`."""
    m = case.model
    slots = torch.arange(case.prefix // csa_tables.COMPRESS_RATIO)
    cmp = w["cmp_kv"].view(-1, m.head_dim)[csa_tables.cmp_rows(w["cmp_block_table"], slots)]
    rows = csa_tables.cmp_rows(w["idx_block_table"], slots)
    history = (cmp, w["idx_kv_cache"].view(-1, m.index_head_dim)[rows], w["idx_kv_scale"].view(-1, 1)[rows])
    return tuple(torch.cat(pair) for pair in zip(history, step))


def golden(case: PrefillCase, ranks: Sequence[Mapping[str, torch.Tensor]],
           prompt: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """The expected outputs of each rank whose tensors `ranks` holds (its pools and tables,
    weights replicated), from the whole prompt [total, HC, D]. The history is read through
    the first one's tables (every rank holds the same logical history)."""
    w, m = ranks[0], case.model
    positions = torch.arange(case.prefix, case.prefix + case.total)
    front = swa_golden.project(m, w, prompt, positions)
    history = history_positions(case)
    first = int(history[0]) if history.numel() else case.prefix
    states = {}
    for pool, table, which in STATE_POOLS:
        held = w[pool].view(-1, w[pool].shape[-1])[csa_tables.state_rows(w[table], history)]
        states[which] = torch.cat((held, csa_math.states(front["normed"], positions, w, which)))
    ends = csa_tables.boundaries(case.prefix, case.prefix + case.total)
    step = csa_math.compress(m, w, states[csa_math.MAIN], states[csa_math.INNER], first, ends)
    cmp, idx, idx_scale = logical_compressed(case, w, step)
    q, q_scale, weights = csa_math.query(m, w, front["qr"], front["qr_scale"], front["normed"], positions)
    seen = csa_math.visible(positions, torch.ones_like(positions, dtype=torch.bool))
    n = int(seen.max()) if seen.numel() else 0
    cmp_indices = csa_math.select(m, q, q_scale, weights, idx[:n], idx_scale[:n].view(-1), seen)
    # A prompt before its first compressed row selects none: one zero row stands for the empty pool.
    cmp_keys, cmp_valid = attention.gather_rows(cmp if cmp.shape[0] else cmp.new_zeros(1, m.head_dim), cmp_indices)
    win_keys, win_valid = swa_golden.window_keys(case, front["kv"], w["kv_cache"])
    keys, valid = torch.cat((win_keys, cmp_keys), dim=1), torch.cat((win_valid, cmp_valid), dim=1)
    x_out = swa_golden.attend_and_project(m, w, prompt, front, keys, valid)
    kv_cache = swa_golden.final_window(case, front["kv"], w["kv_cache"])
    slots = (torch.tensor(ends, dtype=torch.int64) + 1) // csa_tables.COMPRESS_RATIO - 1
    state_first, state_count = csa_tables.final_state_positions(case)
    final = torch.arange(state_first, state_first + state_count)
    outs = []
    for t in ranks:
        out = {"x_out": x_out, "kv_cache": kv_cache, **{p: t[p].clone() for p in POOLS}}
        out["cmp_kv"].view(-1, m.head_dim)[csa_tables.cmp_rows(t["cmp_block_table"], slots)] = step[0]
        rows = csa_tables.cmp_rows(t["idx_block_table"], slots)
        out["idx_kv_cache"].view(-1, m.index_head_dim)[rows] = step[1]
        out["idx_kv_scale"].view(-1, 1)[rows] = step[2]
        for pool, table, which in STATE_POOLS:
            width = out[pool].shape[-1]
            out[pool].view(-1, width)[csa_tables.state_rows(t[table], final)] = states[which][final - first]
        outs.append(out)
    return outs


__all__ = ["STATE_POOLS", "logical_compressed", "golden"]
