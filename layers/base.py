"""The contract between the orchestrator and a decode layer, and the implementation interface.

A `Layer` knows, for one `Case`: which tensors a rank holds (names, shapes, dtypes and whether
each is a pure input, an in-out cache/state or a pure output, spec validation.md §2.1), how to
build rank r's slice deterministically, the full (unsharded) O weights the golden needs, the
single-device golden of one rank's shard, its own TP implementation, and the comparators its
outputs are checked with (as data; `launcher.comparators` builds them).

An implementation under test is any callable `impl(ctx: RankContext, tensors) -> outputs`:
`tensors` holds the rank's inputs and in-out tensors on `ctx.device` (O weights sharded), and
it returns `x_out` and every in-out tensor after the step (mutating them in place is fine).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Union

import torch

from .case import Case
from .config import ModelConfig

if TYPE_CHECKING:  # torch.distributed is only needed by the TP code paths.
    from torch.distributed import ProcessGroup


class Kind(enum.Enum):
    INPUT = "input"  # saved to in/, never compared
    INOUT = "inout"  # initial value in in/, final value in out/, compared
    OUTPUT = "output"  # zero-initialised, saved to out/, compared


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]  # one rank's shape (no leading rank axis)
    dtype: torch.dtype
    kind: Kind


@dataclass(frozen=True)
class PoolCheck:
    """A cache/state pool compared only where the step wrote (spec validation.md §9)."""

    output: str
    mapping: str
    block_size: int
    atol: float
    rtol: float
    max_error_ratio: float = 0.005
    pool_name: str = "pool"


@dataclass(frozen=True)
class RelDiffCheck:
    """A floored relative-difference gate with a bad-point budget (validation.md §10)."""

    output: str
    diff_thd: float
    pct_thd: float
    max_diff_hd: float


Check = Union[PoolCheck, RelDiffCheck]


@dataclass
class RankContext:
    """What an implementation knows about the rank it runs on."""

    case: Case
    rank: int
    device: torch.device
    group: "ProcessGroup | None" = None  # None only when tp == 1 and no process group exists

    @property
    def model(self) -> ModelConfig:
        return self.case.model

    @property
    def tp(self) -> int:
        return self.case.tp


def front_tensor_specs(model: ModelConfig, local_t: int) -> dict[str, TensorSpec]:
    """The inputs every layer's front shares (hc_pre, RMSNorm, Q/KV projection), spec order."""
    m, t, d, hd, ql = model, local_t, model.hidden_size, model.head_dim, model.q_lora_rank
    hhd = m.num_attention_heads * hd
    f32, bf16, i = torch.float32, torch.bfloat16, Kind.INPUT
    return {
        "x_hc": TensorSpec((t, m.hc_mult, d), f32, i),
        "hc_attn_fn": TensorSpec((m.mix_hc, m.hc_dim), f32, i),
        "hc_attn_scale": TensorSpec((3,), f32, i),
        "hc_attn_base": TensorSpec((m.mix_hc,), f32, i),
        "attn_norm_w": TensorSpec((d,), bf16, i),
        "wq_a": TensorSpec((d, ql), bf16, i),
        "wq_b": TensorSpec((ql, hhd), torch.int8, i),
        "wq_b_scale": TensorSpec((hhd,), f32, i),
        "wkv": TensorSpec((d, hd), bf16, i),
        "gamma_cq": TensorSpec((ql,), bf16, i),
        "gamma_ckv": TensorSpec((hd,), bf16, i),
    }


def tail_tensor_specs(case: Case) -> dict[str, TensorSpec]:
    """The tensors every layer ends with: the sink, the rank's O-projection shards, the
    `local_t` scalar and the pure output x_out (spec order)."""
    m, t, lg = case.model, case.local_t, case.local_o_groups
    d, ol, i = m.hidden_size, m.o_lora_rank, Kind.INPUT
    return {
        "attn_sink": TensorSpec((m.num_attention_heads,), torch.float32, i),
        "wo_a": TensorSpec((lg, ol, m.group_in), torch.bfloat16, i),
        "wo_b": TensorSpec((d, lg * ol), torch.int8, i),
        "wo_b_scale": TensorSpec((d,), torch.float32, i),
        "local_t": TensorSpec((), torch.int32, i),
        "x_out": TensorSpec((t, m.hc_mult, d), torch.float32, Kind.OUTPUT),
    }


class Layer(abc.ABC):
    name: ClassVar[str]
    # The golden projects with the full O weights (`full_o_weights`) in place of the rank's
    # shards; a focused scope without a sharded projection sets False.
    sharded_o_weights: ClassVar[bool] = True

    @abc.abstractmethod
    def validate(self, case: Case) -> None:
        """Raise ConfigError for a case this layer cannot run (before any process starts)."""

    @abc.abstractmethod
    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        """Every tensor of one rank in the spec's order (wo_a / wo_b as the rank's shard)."""

    @abc.abstractmethod
    def rank_inputs(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s inputs and in-out initial values, built without the other ranks'."""

    @abc.abstractmethod
    def full_o_weights(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        """The unsharded `(wo_a [G, OL, GI], wo_b [D, G*OL])` the golden projects with."""

    def rank_inputs_and_full_o(self, case: Case, rank: int) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """`rank_inputs` and `full_o_weights` together, for a rank that computes its golden.
        This default builds them apart; `layers.o_weights` draws the O weights once."""
        return self.rank_inputs(case, rank), self.full_o_weights(case)

    @abc.abstractmethod
    def golden(self, model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The TP1 layer on one rank's tensors with full O weights; in-outs updated in place."""

    @abc.abstractmethod
    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This project's TP implementation of the layer on one rank."""

    @abc.abstractmethod
    def checks(self, case: Case) -> tuple[Check, ...]:
        """The comparators of every compared output, in the spec's validation order."""

    # -- derived helpers ---------------------------------------------------------------------
    def compared_names(self, case: Case) -> tuple[str, ...]:
        return tuple(c.output for c in self.checks(case))

    def names_of(self, case: Case, kind: Kind) -> tuple[str, ...]:
        return tuple(n for n, s in self.tensor_specs(case).items() if s.kind is kind)
