"""The description of one validated decode step: layer, model, TP size, tokens, seed, starts.

`Case` is what every rank, the golden and the snapshot manifest agree on. Its checks are the
TP-level rules shared by all layers (spec swa.md §1.4, csa.md §1.5, hca.md §2.3); each layer
adds its own (start-position ceilings, pool capacity) in `Layer.validate`. `MoECase` is its
expert-parallel counterpart for the MoE layer (moe.md §1.2, §6, §7): EP size, layer id,
active tokens and balanced routing instead of tp, local_t and start positions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from .config import MOE_MAX_EP, ConfigError, ModelConfig, round_up


# -- the config keys of a layer's case: a layer's config group (configs/layer/<name>.yaml) names
# its set and gives every key's default; the launcher's schema refuses the keys of other sets.
GROUP = {"group": True}  # the metadata of a key that sizes the case's process group


@dataclass
class TPKeys:
    """The keys of a TP layer's case (`Case`)."""

    tp: int = dataclasses.field(metadata=GROUP)  # the TP group size
    local_t: Optional[int]  # tokens per rank; None: the rank's capacity decode_batch*decode_seq/tp
    # None: the layer's canonical start set; an int; or a list (per rank or per group)
    start_pos: Any = dataclasses.field(metadata={"list": True})


@dataclass
class EPKeys:
    """The keys of an EP layer's case (`MoECase`)."""

    ep: int = dataclasses.field(metadata=GROUP)  # the EP group size
    layer_id: int  # the decoder layer: below num_hash_layers, hash routing
    num_tokens: Optional[int]  # active tokens per rank; None: all T
    balanced_routing: bool  # every expert gets exactly the same number of routes


@dataclass
class BlockKeys:
    """The keys of the decoder layer's case (`layers.block.case.BlockCase`)."""

    ep: int = dataclasses.field(metadata=GROUP)  # the world: the MoE's EP group size
    tp: int = dataclasses.field(metadata=GROUP)  # the attention's TP group size (must divide ep)
    attention: Optional[str]  # swa | csa | hca; None: by layer_id's place in the layer schedule
    layer_id: Optional[int]  # the decoder layer; None: the attention kind's first (both None: layer 10)
    local_t: Optional[int]  # attention tokens per rank; None: the capacity, at most the MoE's 128


CASE_KEYS = {"tp": TPKeys, "ep": EPKeys, "block": BlockKeys}
# What the reports derive their case columns from: the keys that size a group (marked GROUP),
# the sets' other keys, and the keys that may hold a list (shown last, they are long).
_FIELDS = list({f.name: f for keys in CASE_KEYS.values() for f in dataclasses.fields(keys)}.values())
GROUP_KEYS = tuple(f.name for f in _FIELDS if f.metadata.get("group"))
SCALAR_KEYS = tuple(f.name for f in _FIELDS if not f.metadata.get("group") and not f.metadata.get("list"))
LIST_KEYS = tuple(f.name for f in _FIELDS if f.metadata.get("list"))
INT_KEYS = tuple(f.name for f in _FIELDS if f.type in ("int", "Optional[int]"))


def _group_of(keys: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(keys) if f.metadata.get("group"))


def key_set_columns(present: set[frozenset[str]]) -> tuple[list[str], list[str], list[str]]:
    """The group, scalar and list keys of the key sets whose group keys are exactly those some
    row has (`present`: each row's set of group keys; the first key set where none matches)."""
    sets = [keys for keys in CASE_KEYS.values() if _group_of(keys) in present] or [next(iter(CASE_KEYS.values()))]
    names = list(dict.fromkeys(f.name for keys in sets for f in dataclasses.fields(keys)))
    return ([n for n in names if n in GROUP_KEYS], [n for n in names if n in SCALAR_KEYS],
            [n for n in names if n in LIST_KEYS])


# Token counts are whole 8-row tiles (the reference's BIAS_T_TILE / VALID_TOKEN_TILE).
TOKEN_TILE = 8


def _start_pos(value: Any) -> int | tuple[int, ...] | None:
    """`start_pos` as the config gives it: null, an integer, or a non-empty list of integers."""
    if value is None:
        return None
    if isinstance(value, Sequence) and not isinstance(value, str):
        items = list(value)
        if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            raise ConfigError(f"start_pos={list(items)} must be an integer or a non-empty list of integers")
        return tuple(items)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ConfigError(f"start_pos={value!r} must be an integer or a list of integers")


@dataclass(frozen=True)
class Case:
    # The case key that sizes the launch's group (named in the launcher's messages).
    group_key: ClassVar[str] = "tp"
    # The keys a snapshot of the layer fixes (`launcher.config.replay`): local_t and start_pos
    # are read off its files where they say them, else the layer's defaults.
    snapshot_keys: ClassVar[tuple[str, ...]] = ("layer", "scope", "tp", "local_t", "start_pos")

    layer: str
    model: ModelConfig
    tp: int
    local_t: int
    # None: no seed played a part (a replay of a snapshot that records none: every input is
    # the snapshot's).
    seed: int | None
    # None: the layer's canonical start set; an int: every request; a tuple: one start per
    # request of this rank (length batch) or of the whole TP group (length tp * batch).
    start_pos: int | tuple[int, ...] | None = None
    # What the run validates: the whole layer, or one of the focused scopes (layers.attention.scopes).
    scope: str = "full"

    @classmethod
    def from_config(cls, keys: Mapping[str, Any], model: ModelConfig, layer: str, scope: str,
                    whole_requests: bool = True) -> "Case":
        """The case of a TP layer from its config keys (`TPKeys`) and the run's seed;
        `whole_requests`: the layer's or scope's (its default local_t)."""
        tp = int(keys["tp"])
        if tp < 1:
            raise ConfigError(f"tp={tp} must be >= 1")
        local_t = keys["local_t"] if keys["local_t"] is not None else cls.default_local_t(model, tp, whole_requests)
        return cls(layer=layer, model=model, tp=tp, local_t=int(local_t), seed=int(keys["seed"]),
                   start_pos=_start_pos(keys["start_pos"]), scope=scope)

    @staticmethod
    def default_local_t(model: ModelConfig, tp: int, whole_requests: bool = True) -> int:
        """The rank capacity; a padding-guard scope (not `whole_requests`) runs one row below it
        (the reference's default), so that the poisoned and sentinel rows it checks exist."""
        capacity = model.decode_tokens // tp
        return capacity - 1 if not whole_requests and capacity > 1 else capacity

    @classmethod
    def of_snapshot(cls, layer: str, model: ModelConfig, group: int, scope: str, local_t: int | None) -> "Case":
        """The case a snapshot's files give (group size, tokens where they say them: else the
        capacity), every other key at its default: what its shapes are checked against."""
        return cls(layer=layer, model=model, tp=group, local_t=local_t or model.decode_tokens // group, seed=0,
                   scope=scope)

    @classmethod
    def examples(cls, layer: str, model: ModelConfig, scope: str) -> tuple["Case", ...]:
        """Cases that make every check `layer` runs under `scope` (its tolerance keys)."""
        return (cls(layer, model, 1, model.decode_tokens, 0, scope=scope),)

    @property
    def seq(self) -> int:
        return self.model.decode_seq

    @property
    def capacity(self) -> int:
        """Token capacity of one rank (LOCAL_T)."""
        return self.model.decode_tokens // self.tp

    @property
    def batch(self) -> int:
        """Requests on one rank."""
        return self.local_t // self.seq

    @property
    def group_batch(self) -> int:
        """Requests of the whole TP group."""
        return self.tp * self.batch

    @property
    def local_o_groups(self) -> int:
        return self.model.o_groups // self.tp

    @property
    def local_t_pad(self) -> int:
        return round_up(self.capacity, 16)

    def validate(self, whole_requests: bool = True) -> None:
        """The TP-level rules. `whole_requests`: local_t counts whole requests in whole 8-row
        tiles (a layer); False for a scope whose tokens are rows of a buffer, any count in
        [1, capacity] (the reference's collectives default is capacity - 1)."""
        m, tp, t = self.model, self.tp, self.local_t
        if tp < 1:
            raise ConfigError(f"tp={tp} must be >= 1")
        if m.o_groups % tp:
            raise ConfigError(f"tp={tp} must divide o_groups={m.o_groups} of model {m.name!r} (each rank owns whole output groups)")
        if m.decode_batch % tp:
            raise ConfigError(f"tp={tp} must divide the decode batch {m.decode_batch} of model {m.name!r}")
        cap = self.capacity
        if not whole_requests:
            if not 1 <= t <= cap:
                raise ConfigError(f"local_t={t} must be in [1, {cap}] (the rank capacity decode_batch*decode_seq/tp "
                                  f"= {m.decode_tokens}/{tp}) for model {m.name!r}")
            return
        step = row_block(m)
        if not (TOKEN_TILE <= t <= cap) or t % step:
            raise ConfigError(
                f"local_t={t} must be a multiple of {step} (token tile {TOKEN_TILE} and decode seq {self.seq}) "
                f"in [{TOKEN_TILE}, {cap}] (the rank capacity decode_batch*decode_seq/tp = {m.decode_tokens}/{tp}) "
                f"for model {m.name!r}"
            )

    @property
    def group_size(self) -> int:
        """Ranks of the layer's own process group: the TP group."""
        return self.tp

    def describe(self) -> dict:
        """The keys that define the step beside the model (result.json's case, manifests)."""
        sp = self.start_pos
        return {"layer": self.layer, "scope": self.scope, "tp": self.tp, "local_t": self.local_t, "seed": self.seed,
                "start_pos": list(sp) if isinstance(sp, tuple) else sp}

    def of_group(self, group: int) -> "Case":
        """The case of TP group `group` of a dp x tp launch: the same layer, model, tp and
        local_t, its own fixture. Group 0 is the case itself; a later group draws from a seed
        derived from (seed, group), so groups hold different data and a mix-up between them
        shows."""
        return self if group == 0 else dataclasses.replace(self, seed=group_seed(self.seed, group))

    def starts_for_rank(self, rank: int, canonical: list[int]) -> list[int]:
        """The start positions of `rank`'s requests (the spec's resolve rules, per rank)."""
        b = self.batch
        sp = self.start_pos
        if sp is None:
            return list(canonical)
        if isinstance(sp, int):
            return [sp] * b
        sp = list(sp)
        if len(sp) == b:
            return sp
        if len(sp) == self.tp * b:
            return sp[rank * b : (rank + 1) * b]
        raise ConfigError(
            f"start_pos has {len(sp)} entries; expected one per request of a rank ({b}) "
            f"or of the TP group ({self.tp * b})"
        )

    def check_starts(self, starts: list[int], max_seq_len: int) -> None:
        for s in starts:
            if s < 0:
                raise ConfigError(f"start_pos={s}: decode start positions must be non-negative")
            if s + self.seq > max_seq_len:
                raise ConfigError(
                    f"start_pos={s}: start + decode_seq ({self.seq}) must be <= the context ceiling {max_seq_len}"
                )


def group_seed(seed: int, group: int) -> int:
    """The fixture seed of a launch's group `group` > 0: derived from (seed, group)."""
    digest = hashlib.sha256(repr((seed, "tp-group", group)).encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def row_block(model: ModelConfig) -> int:
    """Tokens of one row block: whole requests in whole 8-row token tiles, lcm(8, decode_seq)."""
    return math.lcm(TOKEN_TILE, model.decode_seq)


@dataclass(frozen=True)
class MoECase:
    """One MoE decode step run expert-parallel on `ep` ranks (moe.md §1.2, §7).

    `layer_id` < num_hash_layers routes by the hash table, above by biased top-k scores;
    `num_tokens` active tokens per rank (None: all T); `balanced_routing` is the fixture's
    exact-balance mode (§6). T, L, E and RECV_MAX are derived from the model and `ep`.
    """

    group_key: ClassVar[str] = "ep"
    snapshot_keys: ClassVar[tuple[str, ...]] = ("ep", "layer_id", "num_tokens")

    model: ModelConfig
    ep: int
    seed: int | None  # None: as Case.seed
    layer_id: int = 0
    num_tokens: int | None = None
    balanced_routing: bool = False
    layer: str = "moe"
    scope: str = "full"  # or "collectives": the two all-to-alls alone (layers.moe.collectives)

    @classmethod
    def from_config(cls, keys: Mapping[str, Any], model: ModelConfig, layer: str, scope: str,
                    whole_requests: bool = True) -> "MoECase":
        """The case of the MoE layer from its config keys (`EPKeys`): its group is the EP group
        with 128 tokens per rank. The routing keys do not apply under scope=collectives (its
        routes are its own closed-form draw)."""
        routing = {"layer_id": keys["layer_id"], "balanced_routing": keys["balanced_routing"]} if scope != "full" else {}
        for k, value in routing.items():
            if value:
                raise ConfigError(f"{k}={value} does not apply to layer={layer} scope={scope} (it routes by its own "
                                  f"integer data): leave {k} out")
        ep = int(keys["ep"])
        if not 1 <= ep <= MOE_MAX_EP:  # first: the world size depends on it
            raise ConfigError(f"ep={ep} must be in [1, {MOE_MAX_EP}] (E = 16·ep experts; score routing sorts at most 256)")
        return cls(model=model, ep=ep, seed=int(keys["seed"]), layer_id=int(keys["layer_id"]),
                   num_tokens=None if keys["num_tokens"] is None else int(keys["num_tokens"]),
                   balanced_routing=bool(keys["balanced_routing"]), scope=scope)

    @classmethod
    def of_snapshot(cls, layer: str, model: ModelConfig, group: int, scope: str, local_t: int | None) -> "MoECase":
        """The case a snapshot's leading axis gives, every other key at its default."""
        return cls(model=model, ep=group, seed=0)

    @classmethod
    def examples(cls, layer: str, model: ModelConfig, scope: str) -> tuple["MoECase", ...]:
        """Cases that make every check the MoE runs under `scope` (its tolerance keys)."""
        return (cls(model, 1, 0, scope=scope),)

    # -- what every case tells the launcher -------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Ranks of the layer's own process group: the EP group."""
        return self.ep

    @property
    def local_t(self) -> int:
        """Tokens per rank (the attention layers' local_t): T."""
        return self.tokens

    @property
    def seq(self) -> int:
        """Tokens come one per row, not in requests of decode_seq."""
        return 1

    start_pos = None  # no positions: the MoE step has no cache

    def describe(self) -> dict:
        return {"layer": self.layer, "scope": self.scope, "ep": self.ep, "layer_id": self.layer_id,
                "num_tokens": self.num_tokens, "balanced_routing": self.balanced_routing, "seed": self.seed}

    def of_group(self, group: int) -> "MoECase":
        """The case of EP group `group` of a launch of several: its own fixture (see Case.of_group)."""
        return self if group == 0 else dataclasses.replace(self, seed=group_seed(self.seed, group))

    @property
    def tokens(self) -> int:
        """T: tokens per rank, 128 whatever `ep` (pitfall 1)."""
        return self.model.moe_tokens

    @property
    def local_experts(self) -> int:
        return self.model.moe_local_experts

    @property
    def routed_experts(self) -> int:
        """E = 16·P global routed experts (not the model's n_routed_experts)."""
        return self.model.moe_routed_experts(self.ep)

    @property
    def recv_max(self) -> int:
        return self.model.moe_recv_max(self.ep)

    @property
    def active(self) -> int:
        """n: the active tokens of every rank."""
        return self.tokens if self.num_tokens is None else self.num_tokens

    @property
    def hash_routing(self) -> bool:
        return self.layer_id < self.model.num_hash_layers

    def validate(self) -> None:
        m, p, n, t, k = self.model, self.ep, self.active, self.tokens, self.model.num_experts_per_tok
        name = f"model {m.name!r}"
        rules = [
            (1 <= p <= MOE_MAX_EP,
             f"ep={p} must be in [1, {MOE_MAX_EP}] (E = 16·ep experts; score routing sorts at most 256)"),
            (0 <= n <= t, f"num_tokens={n} must be in [0, {t}] (T = {t} tokens per rank)"),
            (self.layer_id >= 0, f"layer_id={self.layer_id} must be >= 0"),
            (m.scoring_func == "sqrtsoftplus", f"scoring_func={m.scoring_func!r} of {name}: only sqrtsoftplus is specified"),
            (1 <= k <= self.local_experts,
             f"num_experts_per_tok={k} of {name} must be in [1, {self.local_experts}] (distinct experts even at ep=1)"),
            (m.hidden_size % 128 == 0 and m.moe_intermediate_size % 128 == 0,
             f"hidden_size={m.hidden_size} and moe_intermediate_size={m.moe_intermediate_size} of {name} must be "
             "multiples of 128 (the shared expert's 128x128 fp8 fixture blocks; the routed ones need 32)"),
        ]
        if self.balanced_routing:
            rules += [
                (self.hash_routing,
                 f"balanced routing needs a hash layer: layer_id={self.layer_id} < num_hash_layers={m.num_hash_layers}"),
                ((p * n * k) % self.routed_experts == 0,
                 f"balanced routing needs ep·num_tokens·{k} to be a multiple of E={self.routed_experts} "
                 f"(num_tokens={n} must be a multiple of 8)"),
                ((p - 1) * n + t <= m.vocab_size,
                 f"balanced routing gives rank r token ids r·num_tokens + t: (ep-1)·{n} + {t} must be <= "
                 f"vocab_size={m.vocab_size} of {name}"),
            ]
        for ok, rule in rules:
            if not ok:
                raise ConfigError(rule)

