"""The CSA decode layer (compress ratio 4): tensors, checks, TP1 golden and TP forward (spec csa.md).

Owns the layer's tensor inventory (§2), its comparators (§8.5), its validity rules (§1.5),
the order of one step (§3: hc_pre → RMSNorm → Q/KV + RoPE → main compressor → indexer with
its inner compressor and top-k → raw KV write → sparse attention over window ∪ selected
compressed rows → grouped O projection → hc_post), the three RoPE row sets (§4.2), the KV
write (§4.8) and the CSA key list of the sparse attention (§4.9).

Stages live in their modules: the ratio-4 compressor (`layers.csa_compressor`), the indexer
(`layers.indexer`), the fixture (`layers.csa_fixture`), and the shared hc / qkv / attention /
output-half / collective modules. `attention_half` composes one rank's steps from a `Steps`
table: the forward builds it from the module attributes at call time (tests inject defects
by monkeypatching e.g. `csa_compressor.write_state`, `csa_compressor.commit_cmp_rows`,
`indexer.select_topk`), the golden uses the table taken at import, so an injected defect can
never reach the expected values. Both run the same functions, hence tp = 1 is bitwise the
golden.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .components import attention, csa_compressor, hc, indexer, metadata, qkv
from .components import o_proj as output_half
from .contract.case import Case
from .contract.checks import PoolCheck, RelDiffCheck
from .contract.config import ConfigError, ModelConfig
from .contract.context import RankContext
from .contract.tensors import Kind, TensorSpec, front_tensor_specs, tail_tensor_specs
from .distributed import collectives as tp
from .fixtures import csa as csa_fixture
from .fixtures.o_weights import LayerDrawingOWeights

COMPRESS_RATIO = csa_compressor.COMPRESS_RATIO
# gen_shared_weight (indexer wq_b fixture) works on 128×128 blocks.
SHARED_WEIGHT_BLOCK = csa_fixture.MXFP8_BLOCK
MIN_CAPACITY = 16  # LOCAL_T >= 16 (§1.5, the reference fixture's check)

INOUT_POOLS = ("compress_state", "inner_compress_state", "kv_cache", "cmp_kv", "idx_kv_cache", "idx_kv_scale")


# -- the CSA-specific steps ---------------------------------------------------------------------
def write_kv_cache(kv_cache: torch.Tensor, ori_slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """`kv_cache[slot] = kv[t]` for every token with slot >= 0 (§4.8; rows distinct per rank, validated)."""
    keep = ori_slot_mapping >= 0
    kv_cache.view(-1, kv_cache.shape[-1])[ori_slot_mapping[keep]] = kv[keep]


def compressed_key_rows(
    idx_topk: torch.Tensor, cmp_block_table: torch.Tensor, position_ids: torch.Tensor, seq: int, block_size: int
) -> torch.Tensor:
    """Physical cmp_kv rows of each token's selected slots, int64 [T, K], −1 where masked (§4.9 step 1).

    A slot u is kept iff `0 <= u < (p+1) div 4` (its boundary 4u+3 is at or before p); its row
    is `cmp_block_table[b, u div 32]·32 + u mod 32` of the token's request b.
    """
    raw = idx_topk.to(torch.int64)
    causal = (position_ids.to(torch.int64) + 1) // COMPRESS_RATIO
    keep = (raw >= 0) & (raw < causal[:, None])
    table = cmp_block_table.to(torch.int64).repeat_interleave(seq, dim=0)  # [T, cols]
    page = torch.gather(table, 1, (raw.clamp_min(0) // block_size).clamp(max=table.shape[1] - 1))
    rows = page * block_size + raw.clamp_min(0) % block_size
    return torch.where(keep & (page >= 0), rows, torch.full_like(rows, -1))


def csa_attention(
    model: ModelConfig,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    window_swa_indices: torch.Tensor,
    cmp_kv: torch.Tensor,
    cmp_block_table: torch.Tensor,
    idx_topk: torch.Tensor,
    position_ids: torch.Tensor,
    attn_sink: torch.Tensor,
) -> torch.Tensor:
    """Sparse attention over window ∪ selected compressed rows (§4.9): o fp32 [T, H, HD].

    Key list: the W window rows (oldest → newest) then the K selected rows in top-k order,
    invalid entries masked in place (never dropped: positions decide the 128-key tiles,
    §9 pitfall 9). The shared core pads to whole tiles; the reference's floor of two tiles
    adds only all-masked tiles, which leave the online merge bit-unchanged.
    """
    window, window_valid = attention.gather_rows(kv_cache, window_swa_indices)  # [T, W, HD]
    rows = compressed_key_rows(idx_topk, cmp_block_table, position_ids, model.decode_seq, model.block_size)
    selected, selected_valid = attention.gather_rows(cmp_kv, rows)  # [T, K, HD]
    kv = torch.cat((window, selected), dim=1)
    valid = torch.cat((window_valid, selected_valid), dim=1)
    return attention.sparse_attention(q, kv, valid, attn_sink, model.softmax_scale)


class RopeRows(NamedTuple):
    """The three RoPE row sets of §4.2, gathered from the one compressed-profile table."""

    token_cos: torch.Tensor  # [T, R] at each token's position: q / kv RoPE, inverse RoPE
    token_sin: torch.Tensor
    step_cos: torch.Tensor  # [B, R] at the request's first position: indexer q, inner compressor
    step_sin: torch.Tensor
    cmp_cos: torch.Tensor  # [B, R] at 4·floor(first/4): main compressor
    cmp_sin: torch.Tensor


def rope_rows(freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, position_ids: torch.Tensor, seq: int) -> RopeRows:
    pos = position_ids.to(torch.int64)
    first = pos[::seq]
    cmp_pos = first - first % COMPRESS_RATIO
    return RopeRows(
        freqs_cos[pos], freqs_sin[pos], freqs_cos[first], freqs_sin[first], freqs_cos[cmp_pos], freqs_sin[cmp_pos]
    )


# -- composition -----------------------------------------------------------------------------
class Steps(NamedTuple):
    hc_pre: Callable
    rms_norm: Callable
    qkv_proj_rope: Callable
    compressor_project: Callable
    window_rows: Callable
    write_state: Callable
    write_and_gather: Callable
    pool: Callable
    normalize_rotate: Callable
    commit_slots: Callable
    commit_cmp_rows: Callable
    indexer_query: Callable
    head_weights: Callable
    commit_idx_rows: Callable
    visible_slots: Callable
    index_scores: Callable
    select_topk: Callable
    write_kv_cache: Callable
    csa_attention: Callable
    pack_heads: Callable
    grouped_o_proj: Callable
    hc_post: Callable


def live_steps() -> Steps:
    """The stages as the modules hold them now (what the forward runs)."""
    c, i = csa_compressor, indexer
    return Steps(
        hc.hc_pre, qkv.rms_norm, qkv.qkv_proj_rope, c.project, c.window_rows, c.write_state, c.write_and_gather,
        c.pool, c.normalize_rotate, c.commit_slots, c.commit_cmp_rows, i.query, i.head_weights, i.commit_idx_rows,
        i.visible_slots, i.scores, i.select_topk, write_kv_cache, csa_attention, attention.pack_heads,
        output_half.grouped_o_proj, hc.hc_post,
    )  # fmt: skip


# The golden's own references, taken at import (see the module docstring).
_GOLDEN_STEPS = live_steps()


def compressor_rows(
    steps: Steps,
    model: ModelConfig,
    x_normed: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    state: torch.Tensor,
    state_block_table: torch.Tensor,
    state_slot_mapping: torch.Tensor,
    position_ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """One ratio-4 compressor step (§4.5 steps 1–3 before the commit): mutates `state`.

    weights = (wkv [OUT, D], wgate [OUT, D], ape [4, OUT], norm_w [dim]); cos / sin [B, R].
    Returns each request's pooled, normalized, rotated row fp32 [B, dim].
    """
    wkv, wgate, ape, norm_w = weights
    first = position_ids.to(torch.int64)[:: model.decode_seq]
    kv, score = steps.compressor_project(x_normed, wkv, wgate, ape, position_ids)
    windows = steps.window_rows(state_block_table, first, state.shape[1])
    state_rows = state.view(-1, state.shape[-1])
    gathered = steps.write_and_gather(state_rows, state_slot_mapping, kv, score, windows, steps.write_state)
    pooled = steps.pool(gathered, windows, wkv.shape[0] // 2)
    return steps.normalize_rotate(pooled, norm_w, cos, sin, model.rms_norm_eps)


def attention_half(steps: Steps, model: ModelConfig, x: dict[str, torch.Tensor]):
    """One rank's CSA step up to the packed heads (§3 steps 1–8), pools updated in place.

    Returns `(attention_grouped bf16 [G, T, GI], post, comb)`.
    """
    seq, k = model.decode_seq, model.index_topk
    positions = x["position_ids"]
    first = positions.to(torch.int64)[::seq]
    x_mixed, post, comb = steps.hc_pre(x["x_hc"], x["hc_attn_fn"], x["hc_attn_scale"], x["hc_attn_base"], model)
    rows = rope_rows(x["freqs_cos"], x["freqs_sin"], positions, seq)
    x_normed = steps.rms_norm(x_mixed, x["attn_norm_w"], model.rms_norm_eps)
    q, kv, qr, qr_scale = steps.qkv_proj_rope(
        x_normed, x["wq_a"], x["wq_b"], x["wq_b_scale"], x["wkv"], rows.token_cos, rows.token_sin,
        x["gamma_cq"], x["gamma_ckv"], model,
    )  # fmt: skip

    # Main compressor (§4.5): commits cmp_kv rows that this step's attention reads.
    main = compressor_rows(
        steps, model, x_normed, (x["cmp_wkv"], x["cmp_wgate"], x["cmp_ape"], x["cmp_norm_w"]),
        x["compress_state"], x["compress_state_block_table"], x["state_slot_mapping"], positions,
        rows.cmp_cos, rows.cmp_sin,
    )  # fmt: skip
    steps.commit_cmp_rows(x["cmp_kv"], steps.commit_slots(first, x["cmp_slot_mapping"], seq), main)

    # Indexer (§4.6): the inner compressor commits for all requests before any scoring.
    q_idx, q_idx_scale = steps.indexer_query(
        model, qr, qr_scale, x["idx_wq_b"], x["idx_wq_b_scale"],
        rows.step_cos.repeat_interleave(seq, dim=0), rows.step_sin.repeat_interleave(seq, dim=0), x["hadamard_idx"],
    )  # fmt: skip
    weights = steps.head_weights(model, x_normed, x["weights_proj"])
    inner = compressor_rows(
        steps, model, x_normed, (x["inner_wkv"], x["inner_wgate"], x["inner_ape"], x["inner_norm_w"]),
        x["inner_compress_state"], x["inner_compress_state_block_table"], x["inner_state_slot_mapping"], positions,
        rows.step_cos, rows.step_sin,
    )  # fmt: skip
    idx_slots = steps.commit_slots(first, x["idx_slot_mapping"], seq)
    steps.commit_idx_rows(x["idx_kv_cache"], x["idx_kv_scale"], idx_slots, inner, x["hadamard_idx"])
    visible = steps.visible_slots(model, positions, x["kv_seq_lens"])
    score = steps.index_scores(
        model, q_idx, q_idx_scale, weights, x["idx_kv_cache"], x["idx_kv_scale"], x["idx_block_table"],
        int(visible.max()),
    )  # fmt: skip
    idx_topk = steps.select_topk(score, visible, k)  # [T, K] request-local slots

    steps.write_kv_cache(x["kv_cache"], x["ori_slot_mapping"], kv)
    o = steps.csa_attention(
        model, q, x["kv_cache"], x["window_swa_indices"], x["cmp_kv"], x["cmp_block_table"], idx_topk, positions,
        x["attn_sink"],
    )  # fmt: skip
    return steps.pack_heads(o, rows.token_cos, rows.token_sin, model), post, comb


def _outputs(x: dict[str, torch.Tensor], x_out: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**{n: x[n] for n in INOUT_POOLS}, "x_out": x_out}


def golden_decode_csa_tp1(model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TP1 CSA layer (§3) on one rank's tensors with the full O weights.

    Mutates the six pools in place; returns them and x_out [T, HC, D] fp32.
    """
    s = _GOLDEN_STEPS
    attention_grouped, post, comb = attention_half(s, model, tensors)
    attn_out = s.grouped_o_proj(attention_grouped, tensors["wo_a"], tensors["wo_b"], tensors["wo_b_scale"])
    return _outputs(tensors, s.hc_post(attn_out, tensors["x_hc"], post, comb))


def stacked_inputs(case: Case) -> dict[str, torch.Tensor]:
    """The rank-stacked fixture `[tp, …]` (inputs and in-out initial values), built globally at once."""
    stacked = csa_fixture.stacked_tensors(case)
    stacked["local_t"] = torch.tensor(case.local_t, dtype=torch.int32)
    return {n: stacked[n] for n, spec in LAYER.tensor_specs(case).items() if spec.kind is not Kind.OUTPUT}


class CSALayer(LayerDrawingOWeights):
    name = "csa"
    o_recipe = csa_fixture.O_RECIPE

    def validate(self, case: Case) -> None:
        case.validate()
        m = case.model
        if case.capacity < MIN_CAPACITY:
            raise ConfigError(
                f"tp={case.tp}: the rank capacity decode_batch*decode_seq/tp = {case.capacity} "
                f"must be >= {MIN_CAPACITY} for the CSA layer (csa.md §1.5)"
            )
        blocked = (("q_lora_rank", m.q_lora_rank), ("index_n_heads*index_head_dim", m.index_n_heads * m.index_head_dim))
        for what, n in blocked:
            if n % SHARED_WEIGHT_BLOCK:
                raise ConfigError(
                    f"model {m.name!r}: {what}={n} must be a multiple of {SHARED_WEIGHT_BLOCK} "
                    f"(the indexer wq_b fixture quantizes {SHARED_WEIGHT_BLOCK}x{SHARED_WEIGHT_BLOCK} blocks)"
                )
        starts = csa_fixture.global_starts(case)
        # The CSA context ceiling is the RoPE table / compressed-slot range (§1.5).
        case.check_starts(starts, m.max_position_embeddings)
        main_table, inner_table = csa_fixture.state_tables(case, starts)  # raises if the state pools are too small
        b = case.batch
        for rank in range(case.tp):
            own = slice(rank * b, (rank + 1) * b)
            positions = metadata.position_ids_from_starts(starts[own], case.seq)
            tables = csa_fixture.cache_tables(case, positions, own)  # raises if a cache pool is too small
            tables["compress_state_block_table"] = main_table[own]
            tables["inner_compress_state_block_table"] = inner_table[own]
            meta = csa_fixture.request_metadata(m, positions, tables)
            for mapping, pool in (
                ("ori_slot_mapping", "kv_cache"), ("cmp_slot_mapping", "cmp_kv"), ("idx_slot_mapping", "idx_kv_cache"),
                ("state_slot_mapping", "compress_state"), ("inner_state_slot_mapping", "inner_compress_state"),
            ):  # fmt: skip
                _check_injective(rank, starts[own], mapping, pool, meta[mapping])

    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        m, t, b = case.model, case.local_t, case.batch
        d, hd, r = m.hidden_size, m.head_dim, m.qk_rope_head_dim
        ql = m.q_lora_rank
        ih, idd, mo, io = m.index_n_heads, m.index_head_dim, csa_fixture.main_out(m), csa_fixture.inner_out(m)
        bs, sb, w = m.block_size, m.c4a_state_block_size, m.sliding_window
        f32_, bf16_, i8, i32, i64 = torch.float32, torch.bfloat16, torch.int8, torch.int32, torch.int64
        inp, io_ = Kind.INPUT, Kind.INOUT
        return {
            **front_tensor_specs(m, t),
            "freqs_cos": TensorSpec((m.max_position_embeddings, r), bf16_, inp),
            "freqs_sin": TensorSpec((m.max_position_embeddings, r), bf16_, inp),
            "cmp_wkv": TensorSpec((mo, d), bf16_, inp),
            "cmp_wgate": TensorSpec((mo, d), bf16_, inp),
            "cmp_ape": TensorSpec((COMPRESS_RATIO, mo), f32_, inp),
            "cmp_norm_w": TensorSpec((hd,), bf16_, inp),
            "compress_state": TensorSpec((m.csa_state_physical_blocks, sb, 2 * mo), f32_, io_),
            "compress_state_block_table": TensorSpec((b, csa_fixture.state_table_cols(m)), i32, inp),
            "idx_wq_b": TensorSpec((ql, ih * idd), i8, inp),
            "idx_wq_b_scale": TensorSpec((ih * idd,), f32_, inp),
            "weights_proj": TensorSpec((d, ih), bf16_, inp),
            "hadamard_idx": TensorSpec((idd, idd), bf16_, inp),
            "inner_wkv": TensorSpec((io, d), bf16_, inp),
            "inner_wgate": TensorSpec((io, d), bf16_, inp),
            "inner_ape": TensorSpec((COMPRESS_RATIO, io), f32_, inp),
            "inner_norm_w": TensorSpec((idd,), bf16_, inp),
            "inner_compress_state": TensorSpec((m.csa_inner_state_physical_blocks, sb, 2 * io), f32_, io_),
            "inner_compress_state_block_table": TensorSpec((b, csa_fixture.state_table_cols(m)), i32, inp),
            "kv_cache": TensorSpec((m.kv_ori_block_num, bs, 1, hd), bf16_, io_),
            "cmp_kv": TensorSpec((m.kv_cmp_block_num, bs, 1, hd), bf16_, io_),
            "cmp_block_table": TensorSpec((b, csa_fixture.cmp_table_cols(m)), i32, inp),
            "idx_kv_cache": TensorSpec((m.idx_cache_block_num, bs, 1, idd), i8, io_),
            "idx_kv_scale": TensorSpec((m.idx_cache_block_num, bs, 1, 1), f32_, io_),
            "idx_block_table": TensorSpec((b, csa_fixture.idx_table_cols(m)), i32, inp),
            "ori_slot_mapping": TensorSpec((t,), i64, inp),
            "window_swa_indices": TensorSpec((t, w), i32, inp),
            "window_swa_lens": TensorSpec((t,), i32, inp),
            "cmp_slot_mapping": TensorSpec((t,), i64, inp),
            "idx_slot_mapping": TensorSpec((t,), i64, inp),
            "state_slot_mapping": TensorSpec((t,), i64, inp),
            "inner_state_slot_mapping": TensorSpec((t,), i64, inp),
            "position_ids": TensorSpec((t,), i32, inp),
            "kv_seq_lens": TensorSpec((b,), i32, inp),
            **tail_tensor_specs(case),
        }

    def rank_inputs_without_o(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        return {**csa_fixture.rank_tensors(case, rank), "local_t": torch.tensor(case.local_t, dtype=torch.int32)}

    def golden(self, model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return golden_decode_csa_tp1(model, tensors)

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One rank of the TP CSA layer (§7.2); wo_a / wo_b are this rank's shards."""
        x = tensors
        attention_grouped, post, comb = attention_half(live_steps(), ctx.model, x)  # [G, t, GI]
        attn_out = tp.tp_output_half(ctx, attention_grouped, x["wo_a"], x["wo_b"], x["wo_b_scale"])  # [t, D]
        return _outputs(x, hc.hc_post(attn_out, x["x_hc"], post, comb))

    def checks(self, case: Case) -> tuple[PoolCheck | RelDiffCheck, ...]:
        # csa.md §8.5 / validation.md §12.3, in validation order.
        bs, sb = case.model.block_size, case.model.c4a_state_block_size
        return (
            PoolCheck("compress_state", "state_slot_mapping", sb, 1e-3, 1e-3, 0.005, "main compressor state"),
            PoolCheck(
                "inner_compress_state", "inner_state_slot_mapping", sb, 1e-3, 1e-3, 0.005, "inner compressor state"
            ),
            PoolCheck("kv_cache", "ori_slot_mapping", bs, 1e-4, 1 / 128, 0.005, "original KV cache"),
            PoolCheck("cmp_kv", "cmp_slot_mapping", bs, 1e-4, 1 / 128, 0.005, "compressed KV cache"),
            PoolCheck("idx_kv_cache", "idx_slot_mapping", bs, 1, 0, 0.01, "indexer KV cache"),
            PoolCheck("idx_kv_scale", "idx_slot_mapping", bs, 1e-4, 1 / 128, 0.01, "indexer KV scale"),
            RelDiffCheck("x_out", diff_thd=4e-3, pct_thd=0.008, max_diff_hd=1),
        )


def _check_injective(rank: int, starts: list[int], mapping: str, pool: str, slots: torch.Tensor) -> None:
    written = slots[slots >= 0]
    rows, counts = torch.unique(written, return_counts=True)
    if (counts > 1).any():
        row = int(rows[counts > 1][0])
        tokens = torch.nonzero(slots == row).reshape(-1).tolist()
        raise ConfigError(
            f"rank {rank}: start positions {starts} make {mapping} write {pool} row {row} from tokens {tokens}; "
            f"the pool comparator needs distinct write rows per rank"
        )


LAYER = CSALayer()

__all__ = [
    "CSALayer",
    "LAYER",
    "Steps",
    "live_steps",
    "attention_half",
    "compressor_rows",
    "write_kv_cache",
    "compressed_key_rows",
    "csa_attention",
    "rope_rows",
    "golden_decode_csa_tp1",
    "stacked_inputs",
]
