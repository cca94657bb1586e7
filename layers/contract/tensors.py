"""The tensors one rank holds: names, shapes, dtypes and how each takes part in a step.

Every layer's inventory (spec validation.md §2.1) is an ordered dict name -> `TensorSpec`: a
pure input (saved to `in/`, never compared), an in-out cache or state (initial value in `in/`,
final value in `out/`, compared) or a pure output (zero-initialised, saved to `out/`, compared).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import torch

from .case import Case
from .config import ModelConfig


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and raw bytes (bit-exact for every dtype)."""
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


class Kind(enum.Enum):
    INPUT = "input"  # saved to in/, never compared
    INOUT = "inout"  # initial value in in/, final value in out/, compared
    OUTPUT = "output"  # zero-initialised, saved to out/, compared


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]  # one rank's shape (no leading rank axis)
    dtype: torch.dtype
    kind: Kind
    # A snapshot's layout where it differs (the reference's CP prefill files): the rank's shape
    # there (same elements, same order), and whether a file may hold it once, without the rank
    # axis, for a tensor every rank holds alike.
    stored: tuple[int, ...] | None = None
    replicated: bool = False

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.shape if self.stored is None else self.stored


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


# The front's weights, which every attention layer's fixture draws alike on every rank.
FRONT_WEIGHTS = frozenset({"hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm_w", "wq_a", "wq_b",
                           "wq_b_scale", "wkv", "gamma_cq", "gamma_ckv"})


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


__all__ = ["FRONT_WEIGHTS", "Kind", "TensorSpec", "front_tensor_specs", "tail_tensor_specs"]
