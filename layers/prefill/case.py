"""One validated CP prefill step: model, CP size, layout, prompt history and segment lengths.

The prompt is cut into `2·cp` logical segments (docs/prefill.md §1). Every rank owns two of
them (`tables.owner_segments`); a segment holds at most `MAX_SEGMENT_TILES` tiles of
`window` rows. `prefix` rows of history sit in the paged KV cache before the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..contract.case import group_seed
from ..contract.config import HCA_COMPRESS_RATIO, ConfigError, ModelConfig

LAYOUTS = ("zigzag", "contiguous")
PREFILL_LAYERS = ("swa", "hca", "csa")  # the layers with a prefill stage list (layers/prefill/registry.py)
SCOPES = ("full", "collectives")  # the whole step, or its CP exchange alone (layers/prefill/collectives.py)
# Query tiles per segment (the reference's MAX_SEGMENT_TILES): a segment is 1..2 windows long.
MAX_SEGMENT_TILES = 2
# CSA's compressors: ratio 4, each block pooled with the one before it (8 positions).
CSA_COMPRESS_RATIO, CSA_POOLED_POSITIONS = 4, 8
# Rows of one page of the raw-KV ring: the reference's prefill page (its mtp BLOCK_SIZE), 128
# positions in every preset, as the segments' window is; the model sets the pages
# (`ModelConfig.prefill_ori_block_num`).
PREFILL_BLOCK_ROWS = 128
DEFAULT_CP = 2  # the CP size when `cp` is not given (the reference's default)


@dataclass(frozen=True)
class PrefillCase:
    group_key: ClassVar[str] = "cp"
    # The run config's keys of the phase (top level, beside the layer's group): refused in a
    # run of another phase, and the only case keys a prefill run takes.
    config_keys: ClassVar[tuple[str, ...]] = ("cp", "cp_layout", "prefix", "segment_lens")
    snapshot_keys: ClassVar[tuple[str, ...]] = ("layer", "scope", "cp", "cp_layout", "prefix", "segment_lens")

    layer: str
    model: ModelConfig
    cp: int
    seed: int | None
    cp_layout: str = "zigzag"
    prefix: int = 0
    # One length per logical segment; None: every segment one window long (the reference's).
    segment_lens: tuple[int, ...] | None = None
    scope: str = "full"
    phase = "prefill"  # not a field: what the registry looks the layer up by

    @classmethod
    def from_config(cls, keys: Mapping[str, Any], model: ModelConfig, layer: str, scope: str,
                    whole_requests: bool = True) -> "PrefillCase":
        """The case of a context-parallel prefill from the phase's config keys (`config_keys`)."""
        lens = keys["segment_lens"]
        if lens is not None and not isinstance(lens, (int, Sequence)):
            raise ConfigError(f"segment_lens={lens} must be a list of 2*cp lengths (or one length for every segment)")
        cp = int(keys["cp"]) if keys["cp"] is not None else DEFAULT_CP
        if isinstance(lens, int):
            lens = [lens] * (2 * cp)
        return cls(layer=layer, model=model, cp=cp, seed=int(keys["seed"]), cp_layout=str(keys["cp_layout"]),
                   prefix=int(keys["prefix"]), segment_lens=None if lens is None else tuple(int(n) for n in lens),
                   scope=scope)

    @property
    def local_t(self) -> int:
        """Rows of one rank's layout: two parts of MAX_SEGMENT_TILES query tiles (some inactive)."""
        return 2 * MAX_SEGMENT_TILES * self.window

    @property
    def seq(self) -> int:
        """Tokens come one per row (an output fault corrupts one row)."""
        return 1

    def describe(self) -> dict:
        """The keys that define the step beside the model (result.json's case, manifests)."""
        return {"layer": self.layer, "phase": self.phase, "scope": self.scope, "cp": self.cp,
                "cp_layout": self.cp_layout, "prefix": self.prefix, "segment_lens": list(self.lengths),
                "seed": self.seed}

    def of_group(self, group: int) -> "PrefillCase":
        """The case of CP group `group` of a launch of several: its own prompt and weights."""
        return self if group == 0 else dataclasses.replace(self, seed=group_seed(self.seed, group))

    @property
    def group_size(self) -> int:
        """Ranks of the CP group (what a RankContext calls its group's size)."""
        return self.cp

    @property
    def window(self) -> int:
        return self.model.sliding_window

    @property
    def num_segments(self) -> int:
        return 2 * self.cp

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.segment_lens if self.segment_lens is not None else (self.window,) * self.num_segments

    @property
    def starts(self) -> tuple[int, ...]:
        """Global position of each segment's first token (history first, then segments in order)."""
        out, pos = [], self.prefix
        for n in self.lengths:
            out.append(pos)
            pos += n
        return tuple(out)

    @property
    def total(self) -> int:
        """Tokens of the step (the prompt after its history)."""
        return sum(self.lengths)

    @property
    def cache_rows(self) -> int:
        """Rows of the raw-KV ring (position p lives in row p mod cache_rows): the model's
        `prefill_ori_block_num` pages of PREFILL_BLOCK_ROWS."""
        return self.model.prefill_ori_block_num * PREFILL_BLOCK_ROWS

    @property
    def canonical(self) -> bool:
        """The one case the reference kernels run: zigzag, no history, segments of one window."""
        return self.cp_layout == "zigzag" and self.prefix == 0 and self.lengths == (self.window,) * self.num_segments

    def validate(self) -> None:
        w, lens = self.window, self.lengths
        if self.layer not in PREFILL_LAYERS:
            raise ConfigError(f"phase=prefill runs layer={'|'.join(PREFILL_LAYERS)}; layer={self.layer} has no "
                              f"prefill stage list yet")
        if self.scope not in SCOPES:
            raise ConfigError(f"phase=prefill runs scope={' or '.join(SCOPES)}, not scope={self.scope}")
        if self.cp < 1:
            raise ConfigError(f"cp={self.cp} must be >= 1")
        if self.cp_layout not in LAYOUTS:
            raise ConfigError(f"cp_layout={self.cp_layout!r} must be one of {', '.join(LAYOUTS)}")
        if self.prefix < 0:
            raise ConfigError(f"prefix={self.prefix} must be >= 0")
        if len(lens) != self.num_segments:
            raise ConfigError(f"segment_lens has {len(lens)} lengths; cp={self.cp} cuts the prompt into "
                              f"2*cp = {self.num_segments} segments")
        bad = [n for n in lens if not 1 <= n <= MAX_SEGMENT_TILES * w]
        if bad:
            raise ConfigError(f"segment_lens {list(lens)}: every length must be in [1, {MAX_SEGMENT_TILES * w}] "
                              f"({MAX_SEGMENT_TILES} tiles of the {w}-row window)")
        if self.prefix + self.total > self.model.max_position_embeddings:
            raise ConfigError(f"prefix + prompt = {self.prefix + self.total} exceeds the RoPE table of "
                              f"{self.model.max_position_embeddings} rows of model {self.model.name!r}")

    def beyond_reference(self) -> list[str]:
        """What about this case the reference kernels would refuse (said in the verdict)."""
        notes = []
        if self.cp_layout != "zigzag":
            notes.append("the contiguous layout (the reference runs zigzag)")
        if self.prefix:
            notes.append(f"prefix={self.prefix} (the reference runs no history)")
        if self.lengths != (self.window,) * self.num_segments:
            notes.append("segment lengths other than one window")
            if min(self.lengths) < self.window:
                notes.append("a segment shorter than the window (the reference's tables drop the keys "
                             "of every predecessor but the first)")
        if self.cp not in (2, 4, 8):
            notes.append(f"cp={self.cp} (the reference accepts 2, 4, 8)")
        if self.layer == "hca" and self._compressor_window_reaches_two_back(HCA_COMPRESS_RATIO, HCA_COMPRESS_RATIO):
            notes.append("a compressor window reaching past its segment's predecessor (the reference's scratch "
                         "pool holds the predecessor's tail only)")
        if self.layer == "csa" and self._compressor_window_reaches_two_back(CSA_COMPRESS_RATIO, CSA_POOLED_POSITIONS):
            notes.append("a compressor window reaching past its segment's predecessor (the reference seeds a "
                         "segment's compressors from the predecessor's rows only)")
        return notes

    def _compressor_window_reaches_two_back(self, ratio: int, pooled: int) -> bool:
        """Whether the `pooled` positions of a block (of `ratio`) ending in segment s ≥ 2 start
        before segment s − 1."""
        starts = self.starts
        for b in range(self.prefix, self.prefix + self.total):
            if (b + 1) % ratio == 0:
                s = max(i for i, st in enumerate(starts) if st <= b)
                if s >= 2 and b + 1 - pooled < starts[s - 1]:
                    return True
        return False


__all__ = ["DEFAULT_CP", "LAYOUTS", "PREFILL_LAYERS", "SCOPES", "MAX_SEGMENT_TILES", "PREFILL_BLOCK_ROWS",
           "PrefillCase"]
