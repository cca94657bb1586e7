"""The CSA decode layer (compress ratio 4) as its stage list (spec csa.md §3, §7.2).

One rank's step is the spec's top-level order (§3): hc_pre, the three RoPE row sets (§4.2),
RMSNorm, Q/KV projection with RoPE, the main ratio-4 compressor and its cmp_kv commit (§4.5),
the indexer (§4.6: its query and head weights, then the inner compressor's idx cache commit
(§4.7) for every request, then scores and top-k), the raw KV write (§4.8), sparse attention over
window ∪ selected compressed rows (§4.9), then the packing, the TP output half and hc_post
(`layers.attention.output_half`). The golden runs the same list on a single device with the full O
weights; the fixture is `layers.csa.fixture`.
"""

from __future__ import annotations

import torch

from ..attention import front, output_half
from ..attention.layer import AttentionLayer, check_distinct_writes
from ..components import attention, csa_compressor, indexer, metadata
from ..components.kv_cache import write_rows
from ..contract.case import Case
from ..contract.checks import HIDDEN_AXES, AllcloseCheck, Check, PoolCheck, RelDiffCheck
from ..contract.config import ConfigError, ModelConfig
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.tensors import FRONT_WEIGHTS, Kind, TensorSpec, front_tensor_specs, tail_tensor_specs
from . import fixture as csa_fixture
from ..contract.staged import bf16_close, exact, fp32_close, judged, pool_written

COMPRESS_RATIO = csa_compressor.COMPRESS_RATIO
# gen_shared_weight (indexer wq_b fixture) works on 128×128 blocks.
SHARED_WEIGHT_BLOCK = csa_fixture.MXFP8_BLOCK
MIN_CAPACITY = 16  # LOCAL_T >= 16 (§1.5, the reference fixture's check)


# -- the CSA-specific steps ---------------------------------------------------------------------
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


def rope_rows(freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, position_ids: torch.Tensor, seq: int) -> dict[str, torch.Tensor]:
    """The three RoPE row sets of §4.2, gathered from the one compressed-profile table:
    `token_*` [T, R] at each token's position (q / kv RoPE, inverse RoPE), `step_*` [B, R] at
    the request's first position (indexer q, inner compressor), `cmp_*` [B, R] at
    4·floor(first/4) (main compressor)."""
    pos = position_ids.to(torch.int64)
    first = pos[::seq]
    cmp_pos = first - first % COMPRESS_RATIO
    return {
        "token_cos": freqs_cos[pos], "token_sin": freqs_sin[pos], "step_cos": freqs_cos[first],
        "step_sin": freqs_sin[first], "cmp_cos": freqs_cos[cmp_pos], "cmp_sin": freqs_sin[cmp_pos],
    }  # fmt: skip


def compressor_rows(
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
    kv, score = csa_compressor.project(x_normed, wkv, wgate, ape, position_ids)
    windows = csa_compressor.window_rows(state_block_table, first, state.shape[1])
    gathered = csa_compressor.write_and_gather(state.view(-1, state.shape[-1]), state_slot_mapping, kv, score, windows)
    pooled = csa_compressor.pool(gathered, windows, wkv.shape[0] // 2)
    return csa_compressor.normalize_rotate(pooled, norm_w, cos, sin, model.rms_norm_eps)


def _first(ctx: RankContext, v: Values) -> torch.Tensor:
    return v["position_ids"].to(torch.int64)[:: ctx.model.decode_seq]


def _rope_rows(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return rope_rows(v["freqs_cos"], v["freqs_sin"], v["position_ids"], ctx.model.decode_seq)


def _compressor(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The main compressor and its cmp_kv commit (§4.5); both pools in place."""
    m = ctx.model
    main = compressor_rows(
        m, v["x_normed"], (v["cmp_wkv"], v["cmp_wgate"], v["cmp_ape"], v["cmp_norm_w"]), v["compress_state"],
        v["compress_state_block_table"], v["state_slot_mapping"], v["position_ids"], v["cmp_cos"], v["cmp_sin"],
    )  # fmt: skip
    slots = csa_compressor.commit_slots(_first(ctx, v), v["cmp_slot_mapping"], m.decode_seq)
    csa_compressor.commit_cmp_rows(v["cmp_kv"], slots, main)
    return {"compress_state": v["compress_state"], "cmp_kv": v["cmp_kv"]}


def _indexer_query(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The indexer's int8 queries at the request's step row and its head weights (§4.6 steps 1–5)."""
    m, seq = ctx.model, ctx.model.decode_seq
    q_idx, q_idx_scale = indexer.query(
        m, v["qr"], v["qr_scale"], v["idx_wq_b"], v["idx_wq_b_scale"], v["step_cos"].repeat_interleave(seq, dim=0),
        v["step_sin"].repeat_interleave(seq, dim=0), v["hadamard_idx"],
    )  # fmt: skip
    return {"q_idx": q_idx, "q_idx_scale": q_idx_scale,
            "idx_weights": indexer.head_weights(m, v["x_normed"], v["weights_proj"])}


def _indexer_compressor(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """The inner compressor and its idx cache commit, for every request (§4.6 step 6, §4.7)."""
    m = ctx.model
    inner = compressor_rows(
        m, v["x_normed"], (v["inner_wkv"], v["inner_wgate"], v["inner_ape"], v["inner_norm_w"]),
        v["inner_compress_state"], v["inner_compress_state_block_table"], v["inner_state_slot_mapping"],
        v["position_ids"], v["step_cos"], v["step_sin"],
    )  # fmt: skip
    slots = csa_compressor.commit_slots(_first(ctx, v), v["idx_slot_mapping"], m.decode_seq)
    indexer.commit_idx_rows(v["idx_kv_cache"], v["idx_kv_scale"], slots, inner, v["hadamard_idx"])
    return {n: v[n] for n in ("inner_compress_state", "idx_kv_cache", "idx_kv_scale")}


def _indexer_topk(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """Scores over the committed idx cache and the top-k selection (§4.6 steps 7–8)."""
    m = ctx.model
    visible = indexer.visible_slots(m, v["position_ids"], v["kv_seq_lens"])
    score = indexer.scores(
        m, v["q_idx"], v["q_idx_scale"], v["idx_weights"], v["idx_kv_cache"], v["idx_kv_scale"], v["idx_block_table"],
        int(visible.max()),
    )  # fmt: skip
    return {"index_score": score, "idx_topk": indexer.select_topk(score, visible, m.index_topk)}


def _cache_insert(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    write_rows(v["kv_cache"], v["ori_slot_mapping"], v["kv"])
    return {"kv_cache": v["kv_cache"]}


def _attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    o = csa_attention(
        ctx.model, v["q"], v["kv_cache"], v["window_swa_indices"], v["cmp_kv"], v["cmp_block_table"], v["idx_topk"],
        v["position_ids"], v["attn_sink"],
    )  # fmt: skip
    return {"o": o}


ROPE_ROWS = ("token_cos", "token_sin", "step_cos", "step_sin", "cmp_cos", "cmp_sin")
COMPRESSOR_READS = (
    "x_normed", "cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w", "compress_state", "compress_state_block_table",
    "state_slot_mapping", "position_ids", "cmp_cos", "cmp_sin", "cmp_kv", "cmp_slot_mapping",
)  # fmt: skip
INDEXER_QUERY_READS = (
    "qr", "qr_scale", "idx_wq_b", "idx_wq_b_scale", "step_cos", "step_sin", "hadamard_idx", "x_normed", "weights_proj",
)  # fmt: skip
INDEXER_COMPRESSOR_READS = (
    "x_normed", "inner_wkv", "inner_wgate", "inner_ape", "inner_norm_w", "inner_compress_state",
    "inner_compress_state_block_table", "inner_state_slot_mapping", "position_ids", "step_cos", "step_sin",
    "idx_kv_cache", "idx_kv_scale", "idx_slot_mapping", "hadamard_idx",
)  # fmt: skip
INDEXER_TOPK_READS = (
    "q_idx", "q_idx_scale", "idx_weights", "idx_kv_cache", "idx_kv_scale", "idx_block_table", "position_ids",
    "kv_seq_lens",
)  # fmt: skip
ATTENTION_READS = (
    "q", "kv_cache", "window_swa_indices", "cmp_kv", "cmp_block_table", "idx_topk", "position_ids", "attn_sink",
)  # fmt: skip


class CSALayer(AttentionLayer):
    name = "csa"
    o_recipe = csa_fixture.O_RECIPE
    # The fixture's replicated weights and pools (`replicated_weights`, `replicated_pools`).
    replicated_inputs = FRONT_WEIGHTS | {
        "attn_sink", "freqs_cos", "freqs_sin", "cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w", "idx_wq_b",
        "idx_wq_b_scale", "weights_proj", "hadamard_idx", "inner_wkv", "inner_wgate", "inner_ape", "inner_norm_w",
        "compress_state", "inner_compress_state", "kv_cache", "cmp_kv", "idx_kv_cache", "idx_kv_scale"}

    def stages(self, model: ModelConfig) -> tuple[Stage, ...]:
        c = {check.output: check for check in self._checks(model)}
        return (
            front.HC_PRE,
            Stage("rope_rows", ("freqs_cos", "freqs_sin", "position_ids"), tuple(judged(exact(n)) for n in ROPE_ROWS),
                  _rope_rows),
            front.RMS_NORM,
            front.qkv_proj_rope("token_cos", "token_sin", with_qr=True),
            Stage("compressor", COMPRESSOR_READS, (pool_written(c["compress_state"]), pool_written(c["cmp_kv"])),
                  _compressor),
            Stage("indexer_query", INDEXER_QUERY_READS,
                  (judged(AllcloseCheck("q_idx", atol=1, rtol=0)), judged(fp32_close("q_idx_scale")),
                   judged(fp32_close("idx_weights"))), _indexer_query),
            Stage("indexer_compressor", INDEXER_COMPRESSOR_READS,
                  tuple(pool_written(c[n]) for n in ("inner_compress_state", "idx_kv_cache", "idx_kv_scale")),
                  _indexer_compressor),
            Stage("indexer_topk", INDEXER_TOPK_READS, (judged(fp32_close("index_score")), judged(exact("idx_topk"))),
                  _indexer_topk),
            Stage("cache_insert", ("kv_cache", "ori_slot_mapping", "kv"), (judged(exact("kv_cache"), c["kv_cache"]),),
                  _cache_insert),
            Stage("attention", ATTENTION_READS, (judged(bf16_close("o")),), _attention),
            *output_half.stages(c["x_out"], "token_cos", "token_sin"),
        )  # fmt: skip

    def checks(self, case: Case) -> tuple[Check, ...]:
        return self._checks(case.model)

    @staticmethod
    def _checks(model: ModelConfig) -> tuple[Check, ...]:
        # csa.md §8.5 / validation.md §12.3, in validation order.
        bs, sb = model.block_size, model.c4a_state_block_size
        return (
            PoolCheck("compress_state", "state_slot_mapping", sb, 1e-3, 1e-3, 0.005, "main compressor state"),
            PoolCheck(
                "inner_compress_state", "inner_state_slot_mapping", sb, 1e-3, 1e-3, 0.005, "inner compressor state"
            ),
            PoolCheck("kv_cache", "ori_slot_mapping", bs, 1e-4, 1 / 128, 0.005, "original KV cache"),
            PoolCheck("cmp_kv", "cmp_slot_mapping", bs, 1e-4, 1 / 128, 0.005, "compressed KV cache"),
            PoolCheck("idx_kv_cache", "idx_slot_mapping", bs, 1, 0, 0.01, "indexer KV cache"),
            PoolCheck("idx_kv_scale", "idx_slot_mapping", bs, 1e-4, 1 / 128, 0.01, "indexer KV scale"),
            # A one-code difference of the int8 indexer flips a token's top-k, and that token's
            # x_out row differs where the rest agree: a token row may gather bad points.
            RelDiffCheck("x_out", diff_thd=4e-3, pct_thd=0.008, max_diff_hd=1, concentrates_in=("token",), axes=HIDDEN_AXES),
        )

    def start_positions(self, case: Case) -> list[list[int]]:
        starts, b = csa_fixture.global_starts(case), case.batch
        return [starts[rank * b : (rank + 1) * b] for rank in range(case.tp)]

    def validate(self, case: Case) -> None:
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
                check_distinct_writes(rank, starts[own], mapping, pool, meta[mapping])

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

    def inputs_without_o(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        return {**csa_fixture.rank_tensors(case, rank), "local_t": torch.tensor(case.local_t, dtype=torch.int32)}


LAYER = CSALayer()


def golden_decode_csa_tp1(model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`golden_decode_csa_tp1` (§3): the layer on one device, on one rank's tensors with the full
    O weights; mutates the six pools in place; returns them and x_out [T, HC, D] fp32."""
    return LAYER.golden(Case("csa", model, 1, tensors["x_hc"].shape[0], 0), tensors)


__all__ = ["CSALayer", "LAYER", "compressed_key_rows", "csa_attention", "rope_rows",
           "compressor_rows", "golden_decode_csa_tp1"]
