"""One decoder-layer step of `layer=block`: which attention, how the world splits, which layer.

The world is `ep` ranks. The attention half runs in `ep / tp` TP groups of `tp` contiguous
ranks (group g = ranks g·tp ... g·tp + tp − 1; tp = 1 is the data-parallel attention of the
reference's decode_layer), each group on its own requests (its own fixture seed, as a dp × tp
launch of an attention layer). Rank r's `local_t` attention output rows, after the group's
reduce-scatter and hc_post, are rank r's first tokens of the MoE half, which runs
expert-parallel over the whole world with T = 128 tokens per rank: the rows past `local_t`
are padding the MoE never routes (`num_tokens = local_t`).

The attention kind is named (`attention=swa|csa|hca`) or picked by the model's layer schedule
(`layer_id=N`, the reference's compress ratios: 0 → swa, 4 → csa, 128 → hca); `layer_id`
also tells the MoE whether it routes by the hash table (layer_id < num_hash_layers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..contract.case import Case, MoECase, group_seed
from ..contract.config import MOE_MAX_EP, ConfigError, ModelConfig

ATTENTION_KINDS = ("swa", "csa", "hca")
# Compress ratio of every decoder layer of DeepSeek-V4-Flash (43 layers and the MTP layer),
# as the reference's model config lists them.
FLASH_COMPRESS_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)
KIND_OF_RATIO = {0: "swa", 4: "csa", 128: "hca"}
# The reference decode_layer's default layer: a CSA layer past the hash layers (score routing).
DEFAULT_LAYER_ID = 10


def attention_of_layer(layer_id: int) -> str:
    """The attention kind of decoder layer `layer_id` by the layer schedule."""
    if not 0 <= layer_id < len(FLASH_COMPRESS_RATIOS):
        raise ConfigError(f"layer_id={layer_id} must be in [0, {len(FLASH_COMPRESS_RATIOS) - 1}] "
                          f"(the model's {len(FLASH_COMPRESS_RATIOS)} decoder layers, the MTP layer last)")
    return KIND_OF_RATIO[FLASH_COMPRESS_RATIOS[layer_id]]


def first_layer_of(attention: str) -> int:
    """The first decoder layer whose attention is `attention` (the MoE's layer_id when only the
    kind is named)."""
    return next(i for i, r in enumerate(FLASH_COMPRESS_RATIOS) if KIND_OF_RATIO[r] == attention)


def resolve_attention(attention: str | None, layer_id: int | None) -> tuple[str, int]:
    """`(attention, layer_id)` from what the config names: either or both (then they agree);
    neither, the reference decode_layer's default layer."""
    if attention is None and layer_id is None:
        layer_id = DEFAULT_LAYER_ID
    if attention is not None and attention not in ATTENTION_KINDS:
        raise ConfigError(f"attention={attention!r} must be one of {', '.join(ATTENTION_KINDS)}")
    if layer_id is None:
        return attention, first_layer_of(attention)
    scheduled = attention_of_layer(layer_id)
    if attention is not None and attention != scheduled:
        raise ConfigError(f"attention={attention} but layer_id={layer_id} is a {scheduled} layer in the schedule; "
                          "give one of them, or both in agreement")
    return scheduled, layer_id


@dataclass(frozen=True)
class BlockCase:
    """The decoder layer on `ep` ranks: `attention` in TP groups of `tp`, then the MoE over all."""

    group_key: ClassVar[str] = "ep"  # the world, where the MoE runs
    snapshot_keys: ClassVar[tuple[str, ...]] = ()  # no snapshot layout yet (`from_config` refuses one)

    model: ModelConfig
    attention: str
    tp: int
    ep: int
    local_t: int
    seed: int | None
    layer_id: int
    layer: str = "block"
    scope: str = "full"
    start_pos = None  # the attention half's canonical start set

    @classmethod
    def from_config(cls, keys: Mapping[str, Any], model: ModelConfig, layer: str, scope: str,
                    whole_requests: bool = True) -> "BlockCase":
        """The case of the decoder layer from its config keys (`layers.contract.case.BlockKeys`)
        and the run's: the world is `ep` ranks, attention in TP groups of `tp`, the kind named by
        `attention` or by `layer_id`'s place in the layer schedule. One block per launch, and no
        snapshot of it yet: the run keys golden_data, save_data and dp are refused."""
        for k in ("golden_data", "save_data"):
            if keys[k]:
                raise ConfigError(f"{k}={keys[k]}: layer={layer} has no snapshot layout yet (its halves' caches and "
                                  "the MoE's world in one folder); leave it out")
        if int(keys["dp"]) != 1:
            raise ConfigError(f"dp={keys['dp']}: layer={layer}'s world is ep ranks, already split into ep/tp "
                              "attention groups; leave dp out")
        attention, layer_id = resolve_attention(None if keys["attention"] is None else str(keys["attention"]),
                                                None if keys["layer_id"] is None else int(keys["layer_id"]))
        tp, ep = int(keys["tp"]), int(keys["ep"])
        if tp < 1 or not 1 <= ep <= MOE_MAX_EP or ep % tp:  # first: the world size depends on them
            raise ConfigError(f"tp={tp}, ep={ep}: layer={layer} needs ep in [1, {MOE_MAX_EP}] and tp >= 1 dividing "
                              "it (ep/tp attention TP groups)")
        local_t = int(keys["local_t"]) if keys["local_t"] is not None else default_local_t(model, tp)
        return cls(model=model, attention=attention, tp=tp, ep=ep, local_t=local_t, seed=int(keys["seed"]),
                   layer_id=layer_id)

    @classmethod
    def examples(cls, layer: str, model: ModelConfig, scope: str) -> tuple["BlockCase", ...]:
        """One case per attention kind: together they make every check of the block."""
        return tuple(cls(model, kind, 1, 1, model.moe_tokens, 0, first_layer_of(kind)) for kind in ATTENTION_KINDS)

    @property
    def group_size(self) -> int:
        """The launch's process group: the whole world, where the MoE runs."""
        return self.ep

    @property
    def seq(self) -> int:
        return self.model.decode_seq

    @property
    def tp_groups(self) -> int:
        return self.ep // self.tp

    def tp_group_of(self, rank: int) -> int:
        return rank // self.tp

    def attention_case(self, group: int) -> Case:
        """The attention case of TP group `group`: its own requests (Case.of_group's seed)."""
        return Case(layer=self.attention, model=self.model, tp=self.tp, local_t=self.local_t,
                    seed=self.seed).of_group(group)

    def moe_case(self) -> MoECase:
        """The MoE over the world: T rows per rank, the first local_t of them active."""
        return MoECase(model=self.model, ep=self.ep, seed=self.seed, layer_id=self.layer_id, num_tokens=self.local_t)

    def validate(self) -> None:
        """The world and hand-off rules, then each half's own (`Case.validate`, `MoECase.validate`)."""
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention={self.attention!r} must be one of {', '.join(ATTENTION_KINDS)}")
        if not 1 <= self.ep <= MOE_MAX_EP:
            raise ConfigError(f"ep={self.ep} must be in [1, {MOE_MAX_EP}] (the world of layer=block; "
                              "E = 16·ep experts, score routing sorts at most 256)")
        if self.tp < 1 or self.ep % self.tp:
            raise ConfigError(f"tp={self.tp} must divide ep={self.ep}: the world of ep ranks splits into "
                              "ep/tp attention TP groups")
        tokens = self.model.moe_tokens
        if self.local_t > tokens:
            raise ConfigError(f"local_t={self.local_t} must be <= the MoE's {tokens} tokens per rank: a rank's "
                              "attention rows are its MoE tokens")
        self.attention_case(0).validate()
        self.moe_case().validate()

    def describe(self) -> dict:
        return {"layer": self.layer, "scope": self.scope, "attention": self.attention, "tp": self.tp, "ep": self.ep,
                "local_t": self.local_t, "layer_id": self.layer_id, "seed": self.seed}

    def of_group(self, group: int) -> "BlockCase":
        """A launch holds one block (dp = 1); a later one would draw its own fixture."""
        return self if group == 0 else dataclasses.replace(self, seed=group_seed(self.seed, group))


def default_local_t(model: ModelConfig, tp: int) -> int:
    """A rank's attention capacity, at most the MoE's tokens per rank (both whole row blocks)."""
    return min(model.decode_tokens // tp, model.moe_tokens)


__all__ = ["ATTENTION_KINDS", "BlockCase", "attention_of_layer", "default_local_t", "first_layer_of",
           "resolve_attention"]
