"""The HCA decode layer (compress ratio 128) as its stage list (spec hca.md §4, §7.1).

One rank's step, in order: hc_pre, RMSNorm, Q/KV projection with RoPE (`layers.attention.front`), the
ratio-128 compressor (§4.4, `layers.components.hca_compressor`), the raw KV write (§4.5),
sparse attention over the window and the committed compressed rows (§4.6), then the packing,
the TP output half and hc_post (`layers.attention.output_half`). The golden runs the same list on a
single device with the full O weights (§4); the fixture and host metadata are
`layers.hca.fixture`.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..attention import front, output_half
from ..attention.layer import AttentionLayer
from ..components import attention, hca_compressor, metadata
from ..components.kv_cache import write_rows
from ..contract.case import Case
from ..contract.checks import HIDDEN_AXES, Check, PoolCheck, RelDiffCheck
from ..contract.config import ConfigError, ModelConfig, ceil_div
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.tensors import FRONT_WEIGHTS, Kind, TensorSpec, front_tensor_specs, tail_tensor_specs
from . import fixture
from ..contract.staged import bf16_close, exact, judged, pool_written

RATIO = hca_compressor.COMPRESS_RATIO


# -- the layer's own steps (§4.5, §4.6) -----------------------------------------------------------
def visible_compressed_rows(position_ids: torch.Tensor, kv_seq_lens: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """`n_c = min((pos+1)//128, kv_seq_lens[b]//128, MAX_CMP_ROWS)` per token, int64 [T] (§4.6 step 2).

    Row c covers positions [128c, 128c+127], so it is visible to t iff 128c+127 <= pos[t]: the
    row committed at a boundary token is visible to that token and the later ones of its chunk.
    """
    pos = position_ids.to(torch.int64)
    seq_lens = kv_seq_lens.to(torch.int64).repeat_interleave(model.decode_seq)
    return torch.minimum((pos + 1) // RATIO, seq_lens // RATIO).clamp_max(fixture.max_cmp_rows(model))


def compressed_key_rows(
    position_ids: torch.Tensor,
    kv_seq_lens: torch.Tensor,
    cmp_block_table: torch.Tensor,
    cmp_blocks: int,
    model: ModelConfig,
) -> torch.Tensor:
    """Flat cmp_kv rows of each token's compressed keys, -1 where invalid, int64 [T, Kc].

    Lane c (Kc = the batch's largest n_c rounded up to whole 128-key tiles) is logical row c;
    valid iff c < n_c[t] and its page `cmp_block_table[b, c // 32]` is inside the table and
    in [0, cmp_blocks). Tokens with fewer rows get all-invalid tiles, which the online merge
    leaves bitwise unchanged (m_j = NEG_INF gives alpha = 1, beta = 0).
    """
    bs = model.block_size
    n_c = visible_compressed_rows(position_ids, kv_seq_lens, model)
    kc = ceil_div(int(n_c.max()), attention.ATTN_K_TILE) * attention.ATTN_K_TILE
    c = torch.arange(kc, device=n_c.device)
    width = cmp_block_table.shape[1]
    page = c // bs
    request_table = cmp_block_table.to(torch.int64).repeat_interleave(model.decode_seq, dim=0)  # [T, W]
    pg = request_table[:, page.clamp_max(width - 1)]  # [T, Kc]
    valid = (c[None, :] < n_c[:, None]) & (page < width)[None, :] & (pg >= 0) & (pg < cmp_blocks)
    return torch.where(valid, pg * bs + c % bs, -1)


def attention_keys(
    model: ModelConfig,
    kv_cache: torch.Tensor,
    cmp_kv: torch.Tensor,
    window_swa_indices: torch.Tensor,
    cmp_block_table: torch.Tensor,
    position_ids: torch.Tensor,
    kv_seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's keys (§4.6 steps 1-2): `(kv bf16 [T, K, HD], valid bool [T, K])`.

    The window rows first (one tile of 128 at WIN = 128; padded with invalid lanes to whole
    tiles), then the committed compressed rows in tiles of 128 from row 0, so the attention
    core's 128-key tiles are the golden's. `window_swa_lens` is not needed (§10.7): invalid
    window columns are -1.
    """
    t = window_swa_indices.shape[0]
    win = window_swa_indices.to(torch.int64)
    pad = ceil_div(win.shape[1], attention.ATTN_K_TILE) * attention.ATTN_K_TILE - win.shape[1]
    win = torch.cat((win, win.new_full((t, pad), -1)), dim=1)
    cmp_rows = compressed_key_rows(position_ids, kv_seq_lens, cmp_block_table, cmp_kv.shape[0], model)
    kv_w, valid_w = attention.gather_rows(kv_cache, win)
    kv_c, valid_c = attention.gather_rows(cmp_kv, cmp_rows)
    return torch.cat((kv_w, kv_c), dim=1), torch.cat((valid_w, valid_c), dim=1)


def compressor(ctx: RankContext, v: Values, window_rows: Callable = hca_compressor.window_state_rows,
               rotate: Callable = hca_compressor.rope_compressed) -> dict[str, torch.Tensor]:
    """The compressor stage (§4.4): compress_state and cmp_kv updated in place."""
    hca_compressor.compress(
        ctx.model, v["x_normed"], v["cmp_wkv"], v["cmp_wgate"], v["cmp_ape"], v["cmp_norm_w"],
        v["cmp_freqs_cos"], v["cmp_freqs_sin"], v["compress_state"], v["compress_state_block_table"],
        v["cmp_kv"], v["position_ids"], v["state_slot_mapping"], v["cmp_slot_mapping"],
        window_rows=window_rows, rotate=rotate,
    )  # fmt: skip
    return {"compress_state": v["compress_state"], "cmp_kv": v["cmp_kv"]}


def _cache_insert(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    write_rows(v["kv_cache"], v["ori_slot_mapping"], v["kv"])
    return {"kv_cache": v["kv_cache"]}


def _attention(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    m = ctx.model
    keys, valid = attention_keys(
        m, v["kv_cache"], v["cmp_kv"], v["window_swa_indices"], v["cmp_block_table"], v["position_ids"],
        v["kv_seq_lens"],
    )  # fmt: skip
    return {"o": attention.sparse_attention(v["q"], keys, valid, v["attn_sink"], m.softmax_scale)}


COMPRESSOR_READS = (
    "x_normed", "cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w", "cmp_freqs_cos", "cmp_freqs_sin", "compress_state",
    "compress_state_block_table", "cmp_kv", "position_ids", "state_slot_mapping", "cmp_slot_mapping",
)  # fmt: skip


class HCALayer(AttentionLayer):
    name = "hca"
    o_recipe = fixture.O_RECIPE
    # The fixture's replicated weights and pools (`_replicated_values`).
    replicated_inputs = FRONT_WEIGHTS | {
        "attn_sink", "cmp_wkv", "cmp_wgate", "cmp_ape", "cmp_norm_w", "compress_state", "kv_cache", "cmp_kv"}

    def stages(self, model: ModelConfig) -> tuple[Stage, ...]:
        state, kv_cache, cmp_kv, x_out = self._checks(model)
        return (
            front.HC_PRE,
            front.RMS_NORM,
            front.qkv_proj_rope(),
            Stage("compressor", COMPRESSOR_READS, (pool_written(state), pool_written(cmp_kv)), compressor),
            # After the compressor (§4.5): the two touch different pools; both precede attention.
            Stage("cache_insert", ("kv_cache", "ori_slot_mapping", "kv"), (judged(exact("kv_cache"), kv_cache),),
                  _cache_insert),
            Stage("attention", ("q", "kv_cache", "cmp_kv", "window_swa_indices", "cmp_block_table", "position_ids",
                                "kv_seq_lens", "attn_sink"), (judged(bf16_close("o")),), _attention),
            *output_half.stages(x_out),
        )  # fmt: skip

    def checks(self, case: Case) -> tuple[Check, ...]:
        return self._checks(case.model)

    @staticmethod
    def _checks(model: ModelConfig) -> tuple[PoolCheck, PoolCheck, PoolCheck, RelDiffCheck]:
        # validation.md §12.2, in its order.
        sb, bs = model.c128_state_block_size, model.block_size
        return (
            PoolCheck("compress_state", "state_slot_mapping", sb, atol=1e-3, rtol=1 / 128, pool_name="compressor state"),
            PoolCheck("kv_cache", "ori_slot_mapping", bs, atol=1e-3, rtol=1 / 128, pool_name="original KV cache"),
            PoolCheck("cmp_kv", "cmp_slot_mapping", bs, atol=1e-3, rtol=1 / 128, pool_name="compressed KV cache"),
            RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.008, max_diff_hd=1, axes=HIDDEN_AXES),
        )

    def start_positions(self, case: Case) -> list[list[int]]:
        return fixture.all_rank_starts(case)

    def validate(self, case: Case) -> None:
        m = case.model
        if m.decode_seq > RATIO:
            raise ConfigError(
                f"hca: decode_seq={m.decode_seq} must be <= {RATIO} (at most one compression boundary per chunk)"
            )
        for rank, starts in enumerate(fixture.all_rank_starts(case)):
            case.check_starts(starts, m.long_context_max_seq_len)
            starts_t = torch.tensor(starts, dtype=torch.int64)
            where = f"hca rank {rank} (starts {starts})"
            raw = int(fixture.raw_window_pages(starts_t, m)[1].sum())
            if raw > m.kv_ori_block_num:
                raise ConfigError(
                    f"{where}: the raw-window pages need {raw} pages, kv_ori_block_num is {m.kv_ori_block_num}"
                )
            cmp = int(fixture.cmp_pages(starts_t, m).sum())
            if cmp > m.kv_cmp_block_num:
                raise ConfigError(
                    f"{where}: the compressed rows need {cmp} pages of {m.block_size}, kv_cmp_block_num is "
                    f"{m.kv_cmp_block_num} (a ~1M-token request alone fills 256)"
                )
            fixture.injective_state_pages(metadata.position_ids_from_starts(starts_t, m.decode_seq), m)

    def tensor_specs(self, case: Case) -> dict[str, TensorSpec]:
        m = case.model
        t, b, d, hd, od = case.local_t, case.batch, m.hidden_size, m.head_dim, hca_compressor.out_dim(m)
        half = m.qk_rope_head_dim // 2
        f32_, bf16_, i32, i64 = torch.float32, torch.bfloat16, torch.int32, torch.int64
        i, io = Kind.INPUT, Kind.INOUT
        pool = (m.block_size, 1, hd)
        return {
            **front_tensor_specs(m, t),
            "freqs_cos": TensorSpec((t, m.qk_rope_head_dim), bf16_, i),
            "freqs_sin": TensorSpec((t, m.qk_rope_head_dim), bf16_, i),
            "cmp_freqs_cos": TensorSpec((fixture.capacity_batch(case), half), f32_, i),
            "cmp_freqs_sin": TensorSpec((fixture.capacity_batch(case), half), f32_, i),
            "cmp_wkv": TensorSpec((od, d), bf16_, i),
            "cmp_wgate": TensorSpec((od, d), bf16_, i),
            "cmp_ape": TensorSpec((RATIO, od), f32_, i),
            "cmp_norm_w": TensorSpec((hd,), bf16_, i),
            "compress_state": TensorSpec((m.hca_state_physical_blocks, m.c128_state_block_size, 2 * od), f32_, io),
            "compress_state_block_table": TensorSpec((b, fixture.state_table_blocks(m)), i32, i),
            "kv_cache": TensorSpec((m.kv_ori_block_num, *pool), bf16_, io),
            "cmp_kv": TensorSpec((m.kv_cmp_block_num, *pool), bf16_, io),
            "cmp_block_table": TensorSpec((b, fixture.cmp_table_width(case)), i32, i),
            "ori_slot_mapping": TensorSpec((t,), i64, i),
            "window_swa_indices": TensorSpec((t, m.sliding_window), i32, i),
            "window_swa_lens": TensorSpec((t,), i32, i),
            "cmp_slot_mapping": TensorSpec((t,), i64, i),
            "state_slot_mapping": TensorSpec((t,), i64, i),
            "position_ids": TensorSpec((t,), i32, i),
            "kv_seq_lens": TensorSpec((b,), i32, i),
            **tail_tensor_specs(case),
        }

    def inputs_without_o(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        return fixture.inputs_without_o(case, rank)


LAYER = HCALayer()


def golden_decode_hca_tp1(model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`golden_decode_hca_tp1` (§4): the layer on one device, on one rank's tensors with the full
    O weights; updates compress_state, kv_cache and cmp_kv in place; returns them and x_out."""
    return LAYER.golden(Case("hca", model, 1, tensors["x_hc"].shape[0], 0), tensors)


__all__ = ["HCALayer", "LAYER", "visible_compressed_rows", "compressed_key_rows", "attention_keys",
           "compressor", "golden_decode_hca_tp1"]
