"""Token counts and start positions that depend on the job's own tp and model, for the config.

The resolvers give sweep files (configs/tokens, configs/starts) values that depend on the
job's own tp and model:
`${capacity:}` is the rank capacity decode_batch*decode_seq/tp and `${capacity:1}` one row
block below it (a row block is lcm(8, decode_seq) tokens); `${row_block_below:}` is the
second token count the reference runs (validation.md §5.3), the capacity itself at tp = 1;
`${job_nodes:}` (for a Slurm launcher's `nodes`) is the job's nnodes, 1 when not given;
`${mixed_starts:}` is a start position per request of the TP group (`start_pos`'s group form),
drawn in turn from `mixed_pattern` so that every rank's requests start differently (swa.md P11).

`row_block` is the launcher's one statement of the row-block rule (whole requests, whole
8-row token tiles); the where-grids of a failing x_out use it too.
"""

from __future__ import annotations

import math
import os

from omegaconf import OmegaConf

from layers.contract.case import TOKEN_TILE
from layers.contract.config import ModelConfig

from launcher.config.output_dirs import fresh_dir


def row_block(decode_seq: int) -> int:
    """The token row block: lcm(TOKEN_TILE, decode_seq) tokens, whole requests and whole tiles."""
    return math.lcm(TOKEN_TILE, decode_seq)


def _model(root) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(root.model, resolve=True))


def tp_of(root) -> int:
    """The job's tp (a TP layer's key; its group gives the default)."""
    return int(root.tp)


def capacity(blocks_below: int = 0, *, _root_) -> int:
    """The rank capacity of the job's model and tp, less `blocks_below` row blocks."""
    m = _model(_root_)
    return m.decode_tokens // tp_of(_root_) - int(blocks_below) * row_block(m.decode_seq)


def row_block_below(*, _root_) -> int:
    """The second token count of validation.md §5.3: one row block below the capacity for
    tp > 1; at tp = 1 the reference runs the capacity alone, and so does this."""
    return capacity(0 if tp_of(_root_) == 1 else 1, _root_=_root_)


def mixed_pattern(m: ModelConfig) -> list[int]:
    """Starts of every layer's regimes: long context, cold start, the ratio-4 and ratio-128
    boundaries, window edges, state-page and cache-tile crossings (swa.md §7.1, csa.md §6.1,
    hca.md §5.1). Thirteen of them: prime, so no power-of-two rank batch repeats another's."""
    w = m.sliding_window
    return [m.decode_start_pos, 0, 2, 3, 7, 10, 31, 63, w - 1, w, 255, 511, 1023]


def mixed_starts(*, _root_) -> list[int]:
    """One start per request of the TP group, request i taking `mixed_pattern[i % 13]`."""
    m = _model(_root_)
    tp = tp_of(_root_)
    local_t = _root_.local_t if _root_.local_t is not None else m.decode_tokens // tp
    pattern = mixed_pattern(m)
    return [pattern[i % len(pattern)] for i in range(tp * (int(local_t) // m.decode_seq))]


def golden_cache_dir() -> str:
    """The golden cache's default folder: `$DSV4_TP_GOLDEN_CACHE` if set, else
    `$XDG_CACHE_HOME/dsv4-tp-harness/golden` (the XDG base directory rule: only an absolute
    XDG_CACHE_HOME counts), else `~/.cache/dsv4-tp-harness/golden`."""
    if os.environ.get("DSV4_TP_GOLDEN_CACHE"):
        return os.environ["DSV4_TP_GOLDEN_CACHE"]
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join("~", ".cache")
    return os.path.join(base, "dsv4-tp-harness", "golden")


def job_nodes(*, _root_) -> int:
    """The nodes a job spans (a Slurm launcher's `nodes`): `nnodes`, 1 when not given."""
    return int(_root_.nnodes) if _root_.get("nnodes") is not None else 1


def register_resolvers() -> None:
    """Make the resolvers known to OmegaConf (before any config is composed), with
    `${fresh_dir:BASE}` (`launcher.config.output_dirs`), resolved once per config."""
    OmegaConf.register_new_resolver("fresh_dir", fresh_dir, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("capacity", capacity, replace=True)
    OmegaConf.register_new_resolver("row_block_below", row_block_below, replace=True)
    OmegaConf.register_new_resolver("mixed_starts", mixed_starts, replace=True)
    OmegaConf.register_new_resolver("golden_cache_dir", golden_cache_dir, replace=True)
    OmegaConf.register_new_resolver("job_nodes", job_nodes, replace=True)
