"""Model presets and deployment constants of the DeepSeek-V4-Flash decode layers.

Owns the frozen `ModelConfig` (spec components.md §1, swa.md §1, csa.md §1, hca.md §2,
moe.md §1): the attention and MoE model fields, the deployment/paging constants the fixtures
size their pools with, the derived sizes (properties, never overridable), the expert-parallel
constants of the MoE layer (moe.md §1.2) and the structural constraints that hold for every
layer (checked in `__post_init__`). TP/EP- and run-dependent checks (tp, ep, local_t, start
positions, num_tokens) live with the run descriptions in `layers.contract.case`.

Importable without Hydra: the launcher registers these fields as its config schema.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


class ConfigError(ValueError):
    """An invalid configuration, reported to the user as one line before anything runs."""


# -- expert-parallel constants of the MoE layer (moe.md §1.2) ---------------------------------
# Tokens per EP rank: the reference computes MOE_TOKENS = DECODE_TOKENS·DP // EP once, at
# config import, with its module constant EP = 16 (512·4/16), and never re-derives it when
# `--ep` changes it: T is 128 for every P (pitfall 1), and for every preset.
MOE_TOKENS = 128
# Routed experts held by one EP rank: `--ep P` sets n_routed_experts = 256 // 16 · P, so every
# rank keeps 16 (global expert eid lives on rank eid // 16 as local expert eid % 16).
MOE_LOCAL_EXPERTS = 16
# The device's score-routing sort pads a row of scores to 256 (SCORE_PAD): E = 16·P <= 256.
MOE_MAX_EP = 16

# Positions pooled into one compressed row by HCA's compressor (hca.md): a constant of the
# layer, not a model field; here so that case rules read it without the compressor's torch.
HCA_COMPRESS_RATIO = 128


# The integer fields that may be 0 (a start position, YaRN off, no shared-expert or hash
# layers); every other one is a size or a count, at least 1.
_MAY_BE_ZERO = frozenset({"decode_start_pos", "original_max_position_embeddings", "n_shared_experts", "num_hash_layers"})
# Integer fields whose range `_numeric_rules` states with its reason.
_OWN_RULE = frozenset({"beta_fast", "beta_slow", "hc_sinkhorn_iters"})


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int = 128
    rms_norm_eps: float = 1e-6
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    max_position_embeddings: int = 16384
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    original_max_position_embeddings: int = 65536
    # Deployment and paging (config.py module constants of the reference).
    decode_batch: int = 64
    decode_seq: int = 8
    decode_start_pos: int = 8192
    block_size: int = 32
    c4a_state_block_size: int = 2
    c128_state_block_size: int = 8
    kv_ori_block_num: int = 512
    kv_cmp_block_num: int = 256
    idx_cache_block_num: int = 256
    hca_state_physical_blocks: int = 256
    csa_state_physical_blocks: int = 260
    csa_inner_state_physical_blocks: int = 260
    # Pages of the CP prefill's raw-KV ring (of PREFILL_BLOCK_ROWS = 128 rows each,
    # `layers/prefill/case.py`): the reference's prefill deployment point holds 128, one page per
    # 128 RoPE positions.
    prefill_ori_block_num: int = 128
    # Context ceiling of the SWA and HCA layers (1 Mi tokens at HEAD; CSA uses
    # max_position_embeddings).
    long_context_max_seq_len: int = 1_048_576
    # MoE feed-forward (moe.md §1.1). n_routed_experts is the model's; an EP run routes over
    # `moe_routed_experts(ep)` = 16·P experts instead (§1.2).
    vocab_size: int = 129280
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 3

    # -- derived sizes -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def index_nope_head_dim(self) -> int:
        return self.index_head_dim - self.qk_rope_head_dim

    @property
    def index_weights_scale(self) -> float:
        return self.index_head_dim**-0.5 * self.index_n_heads**-0.5

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.hidden_size

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def group_in(self) -> int:
        """Input width of one output group: its heads' outputs side by side (GI)."""
        return self.heads_per_group * self.head_dim

    @property
    def decode_tokens(self) -> int:
        return self.decode_batch * self.decode_seq

    # -- expert parallel (moe.md §1.2): derived, never overridable ------------------------------
    @property
    def moe_tokens(self) -> int:
        """Tokens per EP rank (T): 128 for every P and preset."""
        return MOE_TOKENS

    @property
    def moe_local_experts(self) -> int:
        """Routed experts per EP rank (L)."""
        return MOE_LOCAL_EXPERTS

    def moe_routed_experts(self, ep: int) -> int:
        """Global routed experts of an EP run of P ranks: E = 16·P (not n_routed_experts)."""
        return MOE_LOCAL_EXPERTS * ep

    def moe_recv_max(self, ep: int) -> int:
        """Receive rows per local expert (RECV_MAX = P·T): every source may send it T rows."""
        return ep * MOE_TOKENS

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # sizes and counts first: the rules below divide by them
            value = getattr(self, f.name)
            if f.name in _OWN_RULE:
                continue
            least = 0 if f.name in _MAY_BE_ZERO else 1
            if isinstance(value, int) and not isinstance(value, bool) and value < least:
                raise ConfigError(f"model preset {self.name!r}: model.{f.name}={value} must be >= {least}")
        rules = [
            (self.hc_mult == 4, "hc_mult must be 4 (hc_pre mixes exactly four streams)"),
            (self.hc_dim % 16 == 0, "hc_mult*hidden_size must be a multiple of 16 (hc_pre cube emulation)"),
            (self.num_attention_heads % self.o_groups == 0, "num_attention_heads must be a multiple of o_groups"),
            (0 < self.qk_rope_head_dim < self.head_dim, "qk_rope_head_dim must be in (0, head_dim)"),
            (self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even (interleaved rotary pairs)"),
            (0 < self.sliding_window <= 128, "sliding_window must be in [1, 128] (one attention key tile)"),
            (127 * 127 * self.o_lora_rank < 2**24, "o_lora_rank must be <= 1040 (exact int8 GEMM in fp32)"),
            (self.index_head_dim > self.qk_rope_head_dim, "index_head_dim must exceed qk_rope_head_dim"),
            (self.index_head_dim & (self.index_head_dim - 1) == 0, "index_head_dim must be a power of two (Hadamard)"),
            (self.decode_seq >= 1, "decode_seq must be >= 1"),
            (self.decode_batch >= 1, "decode_batch must be >= 1"),
        ]
        for ok, rule in rules + self._numeric_rules():
            if not ok:
                raise ConfigError(f"model preset {self.name!r}: {rule}")

    def _numeric_rules(self) -> list[tuple[bool, str]]:
        """The float fields' ranges, where leaving them gives a NaN or a crash in the golden
        (components.md §4-§8): the RMSNorm and Sinkhorn epsilons guard a division, a RoPE base
        must make the frequencies decrease, YaRN takes logarithms of its base and of its betas
        and divides by its factor."""
        finite = [(math.isfinite(v), f"{f}={v} must be finite") for f, v in self.fields().items() if isinstance(v, float)]
        return finite + [
            (self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps} must be > 0 (rsqrt(mean x² + eps))"),
            (self.hc_eps > 0, f"hc_eps={self.hc_eps} must be > 0 (the hc gates' and Sinkhorn's epsilon)"),
            (self.hc_sinkhorn_iters >= 1, f"hc_sinkhorn_iters={self.hc_sinkhorn_iters} must be >= 1"),
            (self.rope_theta > 1, f"rope_theta={self.rope_theta} must be > 1 (RoPE base: frequencies theta^(-2i/R))"),
            (self.compress_rope_theta > 1, f"compress_rope_theta={self.compress_rope_theta} must be > 1 "
                                           "(RoPE base of the compressed rows; YaRN divides by its log)"),
            (self.rope_factor >= 1, f"rope_factor={self.rope_factor} must be >= 1 (YaRN's context-extension factor)"),
            (0 < self.beta_slow <= self.beta_fast,
             f"beta_slow={self.beta_slow}, beta_fast={self.beta_fast} must satisfy 0 < beta_slow <= beta_fast "
             "(YaRN's correction range takes their logarithms)"),
            (self.original_max_position_embeddings >= 0,
             f"original_max_position_embeddings={self.original_max_position_embeddings} must be >= 0 (0 turns YaRN off)"),
        ]

    def fields(self) -> dict:
        """Every field and its value (for manifests and reports)."""
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def overrides(self) -> dict | None:
        """The fields whose value differs from the preset of this name (None: no such preset)."""
        preset = PRESETS.get(self.name)
        if preset is None:
            return None
        return {k: v for k, v in self.fields().items() if getattr(preset, k) != v}


FLASH = ModelConfig(
    name="flash",
    hidden_size=4096,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
)

# DEMO differs from FLASH in its RoPE fields: no YaRN at all (original_max_position_embeddings
# = 0), a smaller table and compressed theta.
DEMO = FLASH.replace(
    name="demo",
    max_position_embeddings=4096,
    compress_rope_theta=40000.0,
    rope_factor=40.0,
    original_max_position_embeddings=0,
)

# PRO's MoE fields are FLASH's: moe.md specifies the Flash MoE only.
PRO = FLASH.replace(
    name="pro",
    hidden_size=7168,
    num_attention_heads=128,
    q_lora_rank=1536,
    o_groups=16,
    index_topk=1024,
    max_position_embeddings=1_048_576,
)

# The reduced dims of the reference's `small` snapshots, the o-projection witness's among them
# (tests/data/reference/README.md; everything else is FLASH's).
SMALL = FLASH.replace(
    name="small",
    hidden_size=512,
    num_attention_heads=16,
    head_dim=128,
    q_lora_rank=256,
    o_lora_rank=256,
    index_n_heads=16,
    index_topk=128,
    moe_intermediate_size=256,
)

# The dims of the reference snapshots shipped in tests/data/reference (made by
# scripts/reference_snapshots.py): the least the reference's O projection accepts (hidden 512,
# o_lora 256, 256-wide output groups), two groups of four 64-wide heads over tp=2, pools of
# 16-36 pages, a 1024-row RoPE table, the long-context start at 512 and a 16384-token ceiling
# for HCA's state table. The CP prefill's raw-KV ring is 8 pages of 128 rows, the reference's
# own rule (one page per 128 RoPE positions) at that table.
MINI = FLASH.replace(
    name="mini",
    hidden_size=512,
    num_attention_heads=8,
    head_dim=64,
    qk_rope_head_dim=32,
    q_lora_rank=128,
    o_lora_rank=256,
    o_groups=2,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=128,
    max_position_embeddings=1024,
    decode_batch=32,
    decode_start_pos=512,
    kv_ori_block_num=20,
    kv_cmp_block_num=16,
    idx_cache_block_num=16,
    hca_state_physical_blocks=16,
    csa_state_physical_blocks=36,
    csa_inner_state_physical_blocks=36,
    long_context_max_seq_len=16384,
    prefill_ori_block_num=8,
)

# A 2-core CPU preset that keeps every structural property of the four layers: eight output
# groups of two heads (tp up to 8), the full 128-token window and 32-row pages, the ratio-4
# and ratio-128 compressors with their state page sizes, the 8192 long-context start (block
# tables wrap), int8 indexer heads, and a top-k smaller than the window so sparse attention
# pads its key tiles. MoE: T = 128 tokens and 16 experts per rank, top-6, hash layers below
# 3 and score layers after (all FLASH's), with an expert width of one 128 x 128 fixture
# block and a vocab just large enough for balanced routing at ep = 16 (16·128 token ids).
TINY = FLASH.replace(
    name="tiny",
    hidden_size=256,
    num_attention_heads=16,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=128,
    o_lora_rank=64,
    o_groups=8,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=16,
    decode_batch=16,
    vocab_size=2048,
    moe_intermediate_size=128,
)

PRESETS: dict[str, ModelConfig] = {m.name: m for m in (FLASH, DEMO, PRO, SMALL, TINY, MINI)}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return ceil_div(a, b) * b


__all__ = ["ConfigError", "ModelConfig", "PRESETS", "MOE_TOKENS", "MOE_LOCAL_EXPERTS", "MOE_MAX_EP", "FLASH", "DEMO", "PRO", "SMALL", "TINY", "MINI", "ceil_div", "round_up"]
