"""The SWA decode layer (compress ratio 0): fixture, TP1 golden and TP forward (spec swa.md).

Owns the layer's tensor inventory (§2, §7.6 per rank), its per-rank fixture (value recipes
of §7.1–7.5 drawn with `layers.fixture`, so rank r builds exactly its slice), the cache
insert (§3.4) and the window attention (§3.5) steps, `golden_decode_swa_tp1` (§3) and the
per-rank TP forward (§6). The shared stages come from their own modules: hc_pre / hc_post
(`layers.hc`), RMSNorm and qkv_proj_rope (`layers.qkv`), attention math and packing
(`layers.attention`), the projection (`layers.output_half`) and the collectives
(`layers.tp`).

The forward calls every stage through its module attribute (tests inject defects by
monkeypatching them); the golden holds its own references, taken at import, so an injected
defect can never reach the expected values.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .components import attention, hc, metadata, qkv, rope
from .components import o_proj as output_half
from .components.numerics import bf16, quant_weight_int8
from .contract.case import Case
from .contract.checks import PoolCheck, RelDiffCheck
from .contract.config import ConfigError, ModelConfig, ceil_div
from .contract.context import RankContext
from .contract.tensors import Kind, TensorSpec, front_tensor_specs, tail_tensor_specs
from .distributed import collectives as tp
from .fixtures import draw as fixture
from .fixtures.o_weights import LayerDrawingOWeights, OWeightRecipe

# "Real layer-0 SWA" hc values (§7.2); hc_attn_fn is synthetic N(0, 1)·HC_FN_SCALE.
HC_ATTN_SCALE = (2.076026, 0.018729, 0.245936)
HC_ATTN_BASE = (
    3.9083, -2.0399, -2.2033, -2.017, -2.4443, -10.3158, -8.9943, -6.3581,
    9.8577, -9.5177, -24.8724, -22.8929, -21.545, 0.7791, -3.386, 1.1948,
    -20.9605, -0.7702, 1.4218, -4.8994, 1.5177, -29.7663, -30.1413, -1.2413,
)  # fmt: skip
HC_FN_SCALE = 0.039

# The weights every rank holds identically, drawn once without a rank key: the names the
# reference broadcasts from rank 0 (§7.6 step 3) less the RoPE rows (computed at each rank's
# own positions, P11) and wo_b_scale (it comes with the O weights).
REPLICATED = (
    "hc_attn_fn", "hc_attn_scale", "hc_attn_base", "attn_norm_w", "wq_a", "wq_b", "wq_b_scale",
    "wkv", "gamma_cq", "gamma_ckv", "attn_sink",
)  # fmt: skip


# -- the per-rank steps of §3 / §6 -------------------------------------------------------------
def write_cache_rows(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """KV cache insert (§3.4): `kv_cache` flat row `slot_mapping[t]` := kv[t], in place.

    Rows with slot −1 are skipped and no other row is touched (P14). The golden writes the
    tokens in order, so if two tokens name one row the later one wins (the fixtures never
    do; `SWALayer.validate` rejects it).
    """
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [NB·BS, HD], a view: writes land in the pool
    writers = torch.nonzero(slot_mapping >= 0).reshape(-1)
    rows = slot_mapping[writers].to(torch.int64)
    unique_rows, inverse = torch.unique(rows, return_inverse=True)
    last = torch.full_like(unique_rows, -1).scatter_reduce(0, inverse, writers, reduce="amax")
    flat[unique_rows] = kv[last].to(flat.dtype)


def swa_attention(
    model: ModelConfig,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    attn_sink: torch.Tensor,
) -> torch.Tensor:
    """Window attention (§3.5): o fp32 [T, H, HD] of q [T, H, HD] over each token's window.

    Key k of token t is valid iff `k < swa_lens[t]` and `swa_indices[t, k] >= 0` (the
    golden's rule; the kernel masks by lens only, §12.1).
    """
    kv, valid = attention.gather_rows(kv_cache, swa_indices)  # [T, WIN, HD], [T, WIN]
    in_window = torch.arange(swa_indices.shape[1], device=swa_lens.device)[None, :] < swa_lens[:, None]
    return attention.sparse_attention(q, kv, valid & in_window, attn_sink, model.softmax_scale)


class _Steps(NamedTuple):
    hc_pre: Callable
    rms_norm: Callable
    qkv_proj_rope: Callable
    write_cache_rows: Callable
    swa_attention: Callable
    pack_heads: Callable
    grouped_o_proj: Callable
    hc_post: Callable


# The golden's own references to the steps (see the module docstring).
_GOLDEN_STEPS = _Steps(
    hc.hc_pre, qkv.rms_norm, qkv.qkv_proj_rope, write_cache_rows, swa_attention,
    attention.pack_heads, output_half.grouped_o_proj, hc.hc_post,
)  # fmt: skip


def golden_decode_swa_tp1(model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TP1 SWA layer (§3) on one rank's tensors with the full O weights.

    Updates `tensors["kv_cache"]` in place; returns `{"kv_cache", "x_out" [T, HC, D] fp32}`.
    """
    s = _GOLDEN_STEPS
    x = tensors
    x_mixed, post, comb = s.hc_pre(x["x_hc"], x["hc_attn_fn"], x["hc_attn_scale"], x["hc_attn_base"], model)
    x_normed = s.rms_norm(x_mixed, x["attn_norm_w"], model.rms_norm_eps)
    q, kv, _qr, _qr_scale = s.qkv_proj_rope(
        x_normed, x["wq_a"], x["wq_b"], x["wq_b_scale"], x["wkv"], x["freqs_cos"], x["freqs_sin"],
        x["gamma_cq"], x["gamma_ckv"], model,
    )  # fmt: skip
    s.write_cache_rows(x["kv_cache"], x["swa_slot_mapping"], kv)
    o = s.swa_attention(model, q, x["kv_cache"], x["swa_indices"], x["swa_lens"], x["attn_sink"])
    attention_grouped = s.pack_heads(o, x["freqs_cos"], x["freqs_sin"], model)  # [G, T, GI]
    attn_out = s.grouped_o_proj(attention_grouped, x["wo_a"], x["wo_b"], x["wo_b_scale"])
    x_out = s.hc_post(attn_out, x["x_hc"], post, comb)
    return {"kv_cache": x["kv_cache"], "x_out": x_out}


# -- fixture (§7.1–7.5, drawn per tensor with layers.fixture) ----------------------------------
def _metadata(case: Case, starts: list[int]) -> dict[str, torch.Tensor]:
    """Positions, slot mapping and window of one rank's requests (§7.4)."""
    m = case.model
    positions = metadata.position_ids_from_starts(starts, case.seq)  # [B, S]
    # Block-table width ceil(MAX_SEQ_LEN / BS) over the 1 Mi SWA ceiling (32768 at FLASH).
    table = metadata.block_table(
        case.batch, ceil_div(m.long_context_max_seq_len, m.block_size), m.kv_ori_block_num
    )
    swa_indices, swa_lens = metadata.swa_indices_and_lens(positions, table, m.block_size, m.sliding_window)
    return {
        "swa_slot_mapping": metadata.paged_slot_mapping(positions, table, m.block_size).reshape(-1),
        "swa_indices": swa_indices,
        "swa_lens": swa_lens,
        "position_ids": positions.reshape(-1),
    }


def _canonical_starts(case: Case) -> list[int]:
    m = case.model
    return metadata.swa_decode_start_set(case.batch, m.sliding_window, m.decode_start_pos)


def _replicated_weights(case: Case) -> dict[str, torch.Tensor]:
    """The `REPLICATED` tensors (§7.1 recipes)."""
    m, seed = case.model, case.seed
    d, ql, h, hd = m.hidden_size, m.q_lora_rank, m.num_attention_heads, m.head_dim
    wq_b, wq_b_scale = quant_weight_int8(bf16(fixture.randn((ql, h * hd), seed, "wq_b").div_(ql**0.5)), axis=0)
    return {
        "hc_attn_fn": fixture.randn((m.mix_hc, m.hc_dim), seed, "hc_attn_fn").mul_(HC_FN_SCALE),
        "hc_attn_scale": torch.tensor(HC_ATTN_SCALE, dtype=torch.float32),
        "hc_attn_base": torch.tensor(HC_ATTN_BASE, dtype=torch.float32),
        "attn_norm_w": torch.ones(d, dtype=torch.bfloat16),
        "wq_a": bf16(fixture.randn((d, ql), seed, "wq_a").div_(d**0.5)),
        "wq_b": wq_b,
        "wq_b_scale": wq_b_scale,
        "wkv": bf16(fixture.randn((d, hd), seed, "wkv").div_(d**0.5)),
        "gamma_cq": torch.ones(ql, dtype=torch.bfloat16),
        "gamma_ckv": torch.ones(hd, dtype=torch.bfloat16),
        "attn_sink": torch.zeros(h, dtype=torch.float32),
    }


def _rank_tensors(case: Case, rank: int) -> dict[str, torch.Tensor]:
    """Rank r's own tokens, cache, metadata and RoPE rows (at its own positions, P11)."""
    m, seed, t = case.model, case.seed, case.local_t
    meta = _metadata(case, case.starts_for_rank(rank, _canonical_starts(case)))
    freqs_cos, freqs_sin = rope.rope_rows(m, meta["position_ids"], 0)
    kv = fixture.randn((m.kv_ori_block_num, m.block_size, 1, m.head_dim), seed, "kv_cache", rank)
    # Unit-RMS rows (§7.1 #7).
    kv = kv / kv.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(m.rms_norm_eps)
    return {
        "x_hc": fixture.uniform((t, m.hc_mult, m.hidden_size), -1.0, 1.0, seed, "x_hc", rank),
        "freqs_cos": freqs_cos,
        "freqs_sin": freqs_sin,
        "kv_cache": bf16(kv),
        **meta,
        "local_t": torch.tensor(t, dtype=torch.int32),
    }


def _wo_a_group(case: Case, g: int) -> torch.Tensor:
    m = case.model
    return bf16(fixture.randn((m.o_lora_rank, m.group_in), case.seed, "wo_a", g).div_(m.group_in**0.5))


def _wo_b_block(case: Case, g: int) -> torch.Tensor:
    """Columns `[g·OL, (g+1)·OL)` of the bf16 wo_b [D, G·OL] before quantization."""
    m = case.model
    width = m.o_groups * m.o_lora_rank
    return bf16(fixture.randn((m.hidden_size, m.o_lora_rank), case.seed, "wo_b", g).div_(width**0.5))


def stacked_inputs(case: Case) -> dict[str, torch.Tensor]:
    """The rank-stacked fixture `[P, ...]` built from the full O weights (§7.6 step 4).

    A second construction of what `SWALayer.rank_inputs` gives per rank: all of wo_a / wo_b
    at once, then sharded; the replicated weights drawn once and copied to every rank.
    """
    p, lg = case.tp, case.local_o_groups
    m = case.model
    wo_a, wo_b, wo_b_scale = LAYER.o_recipe.whole(case)
    replicated = _replicated_weights(case)
    ranks = [_rank_tensors(case, r) for r in range(p)]
    stacked = {n: torch.stack([replicated[n]] * p) for n in REPLICATED}
    stacked.update({n: torch.stack([rt[n] for rt in ranks]) for n in ranks[0]})
    stacked["wo_a"] = wo_a.reshape(p, lg, m.o_lora_rank, m.group_in)
    stacked["wo_b"] = wo_b.reshape(m.hidden_size, p, lg * m.o_lora_rank).permute(1, 0, 2).contiguous()
    stacked["wo_b_scale"] = torch.stack([wo_b_scale] * p)
    return {n: stacked[n] for n, spec in LAYER.tensor_specs(case).items() if spec.kind is not Kind.OUTPUT}


class SWALayer(LayerDrawingOWeights):
    name = "swa"
    o_recipe = OWeightRecipe(_wo_a_group, _wo_b_block)

    def validate(self, case: Case) -> None:
        case.validate()
        m = case.model
        canonical = _canonical_starts(case)
        for rank in range(case.tp):
            starts = case.starts_for_rank(rank, canonical)
            # The SWA context ceiling is the 1 Mi long-context one (§10, #994).
            case.check_starts(starts, m.long_context_max_seq_len)
            meta = _metadata(case, starts)
            slots = meta["swa_slot_mapping"]
            written = slots[slots >= 0]
            rows, counts = torch.unique(written, return_counts=True)
            if (counts > 1).any():
                row = int(rows[counts > 1][0])
                tokens = torch.nonzero(slots == row).reshape(-1).tolist()
                raise ConfigError(
                    f"rank {rank}: start positions {starts} write KV cache row {row} from tokens {tokens} "
                    f"(the {m.kv_ori_block_num}-page pool wraps); the KV comparator needs distinct write rows"
                )
            k = torch.arange(m.sliding_window)[None, :]
            holes = (k < meta["swa_lens"][:, None]) & (meta["swa_indices"] < 0)
            if holes.any():
                tok = int(torch.nonzero(holes)[0, 0])
                raise ConfigError(
                    f"rank {rank}: token {tok} (position {int(meta['position_ids'][tok])}) has an unmapped row "
                    f"inside its window; every in-window index must be >= 0 (swa.md §1.4, P3)"
                )

    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        m, t = case.model, case.local_t
        hd, r = m.head_dim, m.qk_rope_head_dim
        bf16_, i32, i64 = torch.bfloat16, torch.int32, torch.int64
        inp = Kind.INPUT
        return {
            **front_tensor_specs(m, t),
            "freqs_cos": TensorSpec((t, r), bf16_, inp),
            "freqs_sin": TensorSpec((t, r), bf16_, inp),
            "kv_cache": TensorSpec((m.kv_ori_block_num, m.block_size, 1, hd), bf16_, Kind.INOUT),
            "swa_slot_mapping": TensorSpec((t,), i64, inp),
            "swa_indices": TensorSpec((t, m.sliding_window), i32, inp),
            "swa_lens": TensorSpec((t,), i32, inp),
            "position_ids": TensorSpec((t,), i32, inp),
            **tail_tensor_specs(case),
        }

    def rank_inputs_without_o(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        return {**_replicated_weights(case), **_rank_tensors(case, rank)}

    def golden(self, model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return golden_decode_swa_tp1(model, tensors)

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One rank of the TP SWA layer (§6 steps 1–9); wo_a / wo_b are this rank's shards."""
        model, x = ctx.model, tensors
        x_mixed, post, comb = hc.hc_pre(x["x_hc"], x["hc_attn_fn"], x["hc_attn_scale"], x["hc_attn_base"], model)
        x_normed = qkv.rms_norm(x_mixed, x["attn_norm_w"], model.rms_norm_eps)
        q, kv, _qr, _qr_scale = qkv.qkv_proj_rope(
            x_normed, x["wq_a"], x["wq_b"], x["wq_b_scale"], x["wkv"], x["freqs_cos"], x["freqs_sin"],
            x["gamma_cq"], x["gamma_ckv"], model,
        )  # fmt: skip
        write_cache_rows(x["kv_cache"], x["swa_slot_mapping"], kv)
        o = swa_attention(model, q, x["kv_cache"], x["swa_indices"], x["swa_lens"], x["attn_sink"])
        attention_grouped = attention.pack_heads(o, x["freqs_cos"], x["freqs_sin"], model)  # [G, t, GI]
        attn_out = tp.tp_output_half(ctx, attention_grouped, x["wo_a"], x["wo_b"], x["wo_b_scale"])  # [t, D]
        x_out = hc.hc_post(attn_out, x["x_hc"], post, comb)
        return {"kv_cache": x["kv_cache"], "x_out": x_out}

    def checks(self, case: Case) -> tuple[PoolCheck | RelDiffCheck, ...]:
        # validation.md §12.1; validation order kv_cache, x_out.
        return (
            PoolCheck(
                "kv_cache", mapping="swa_slot_mapping", block_size=case.model.block_size,
                atol=1e-4, rtol=1 / 128, max_error_ratio=0.005, pool_name="KV cache",
            ),
            RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.008, max_diff_hd=1),
        )  # fmt: skip


LAYER = SWALayer()

__all__ = ["SWALayer", "LAYER", "write_cache_rows", "swa_attention", "golden_decode_swa_tp1", "stacked_inputs"]
