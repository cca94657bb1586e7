"""The HCA decode layer (compress ratio 128): fixture, golden and TP forward (spec hca.md).

Owns, for one rank of a `Case`:

* the tensor contract (hca.md §3, the names, shapes and dtypes of the reference snapshot) and
  the comparators (validation.md §12.2);
* the host metadata of §5: start positions, the raw-window and compressed-page allocations,
  the injective compressor-state table and every slot mapping / index list built from them,
  and the token-local / block-start RoPE rows (compressed YaRN profile, §5.5);
* the fixture (§6): one canonical fixture replicated to every rank (weights, metadata,
  initial pools), with only `x_hc` offset by `rank / 64` (§6.3 step 3, validation.md §5.3).
  Values follow §6.1's recipes but are drawn from `layers.fixture` streams keyed per tensor
  (per output group for wo_a / wo_b / wq_b), so a rank builds exactly its own slice;
* the golden (`golden_decode_hca_tp1` on one rank's tensors with the full O weights, §4)
  and the per-rank TP forward (§7.1), which share every step up to the packed attention
  output and differ only in the output projection.

The ratio-128 compressor itself is `layers.hca_compressor`; the shared components are
`layers.hc`, `layers.qkv`, `layers.attention`, `layers.output_half` and `layers.tp`. Stages
are called through their modules by the forward, so a test can inject a defect into one of
them; the golden holds its own references, bound at import.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from .components import attention, hc, hca_compressor, metadata, qkv, rope
from .components import o_proj as output_half
from .components.numerics import bf16, f32, quant_weight_int8
from .contract.case import Case
from .contract.checks import Check, PoolCheck, RelDiffCheck
from .contract.config import ConfigError, ModelConfig, ceil_div
from .contract.context import RankContext
from .contract.tensors import Kind, TensorSpec, front_tensor_specs, tail_tensor_specs
from .distributed import collectives as tp
from .fixtures import draw as fixture
from .fixtures.o_weights import LayerDrawingOWeights, OWeightRecipe

RATIO = hca_compressor.COMPRESS_RATIO
# hc_attn scale / base of the real layer-9 HCA block (hca.md §6.1; fixed, no RNG).
HC_ATTN_SCALE = (0.079046, 0.04213, 0.121901)
HC_ATTN_BASE = (
    -3.3004, 2.5553, -2.2787, -3.4925,
    -3.8197, -3.4161, -2.7144, -2.9181,
    2.362, -2.4746, -2.1352, -3.2216,
    -4.474, 2.2488, -2.1053, -3.1675,
    -2.8362, -1.9042, 2.0432, -3.062,
    -2.7902, -3.0908, -3.002, 3.1161,
)  # fmt: skip
# Offset of rank r's x_hc from the canonical draw (hca.md §6.3 step 3).
X_HC_RANK_OFFSET = 0.015625
# Magnitudes of §6.1 (absolute, not width-scaled, except the 1/sqrt(fan-in) weights).
HC_ATTN_FN_STD = 0.0495
CMP_WKV_STD = 0.0240
CMP_WGATE_STD = 0.0309
CMP_APE_STD = 0.0332
CMP_NORM_W_MEAN, CMP_NORM_W_STD = 0.0982, 0.0539


# -- derived sizes (hca.md §2.2, §9) ------------------------------------------------------
def state_table_blocks(model: ModelConfig) -> int:
    """STATE_TABLE_BLOCKS: logical state pages of a request at the 1M ceiling (131072)."""
    return ceil_div(model.long_context_max_seq_len, model.c128_state_block_size)


def max_cmp_rows(model: ModelConfig) -> int:
    """MAX_CMP_ROWS: compressed rows a request can reach at the 1M ceiling (8192)."""
    return model.long_context_max_seq_len // RATIO


def capacity_batch(case: Case) -> int:
    """B = decode_batch / tp: rows of the per-request cmp RoPE tensors."""
    return case.model.decode_batch // case.tp


# -- start positions and metadata (hca.md §5) -----------------------------------------------
def canonical_starts(case: Case) -> list[int]:
    m = case.model
    return metadata.hca_decode_start_set(case.batch, RATIO, m.c128_state_block_size, m.decode_start_pos)


def rank_starts(case: Case, rank: int) -> list[int]:
    return case.starts_for_rank(rank, canonical_starts(case))


def _all_rank_starts(case: Case) -> list[list[int]]:
    return [rank_starts(case, r) for r in range(case.tp)]


def raw_window_pages(starts: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(first_page, page_count, cursor)` of each request's raw-window pages, int64 [B] (§5.2).

    Request b's window pages `first//32 .. last//32` (first = max(0, start-WIN+1), last =
    start+S-1) are given the physical pages `cursor_b ..` in request order, no sharing.
    """
    bs = model.block_size
    first = (starts - model.sliding_window + 1).clamp_min(0) // bs
    last = (starts + model.decode_seq - 1) // bs
    count = last - first + 1
    return first, count, torch.cumsum(count, 0) - count


def raw_block_table(starts: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """The raw-window block table, int32 [B, last_page + 1] (§5.2).

    The reference's table is ORI_TABLE_BLOCKS (32768) wide, but no position of this step
    lies past the batch's last page, so this narrower table yields the same slot mappings and
    window indices (it is a fixture intermediate, not a layer input).
    """
    first, count, cursor = raw_window_pages(starts, model)
    c = torch.arange(int((first + count).max()), dtype=torch.int64)
    inside = (c >= first[:, None]) & (c < (first + count)[:, None])
    return torch.where(inside, cursor[:, None] + c - first[:, None], -1).to(torch.int32)


def cmp_pages(starts: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Compressed pages of each request after this step, int64 [B] (§5.3)."""
    rows = ((starts + model.decode_seq) // RATIO).clamp_max(max_cmp_rows(model))
    return (rows + model.block_size - 1) // model.block_size


def cmp_table_width(case: Case) -> int:
    """W = max(1, max_b pages_b), taken over every rank's requests so all ranks agree on the
    shape (with the canonical, replicated starts it is the reference's per-rank W)."""
    pages = [int(cmp_pages(torch.tensor(s, dtype=torch.int64), case.model).max()) for s in _all_rank_starts(case)]
    return max(1, *pages)


def cmp_block_table(starts: torch.Tensor, model: ModelConfig, width: int) -> torch.Tensor:
    """Consecutive compressed pages per request in request order, -1 unmapped, int32 [B, W] (§5.3)."""
    pages = cmp_pages(starts, model)
    cursor = torch.cumsum(pages, 0) - pages
    j = torch.arange(width, dtype=torch.int64)
    return torch.where(j < pages[:, None], cursor[:, None] + j, -1).to(torch.int32)


def _touched_state_pages(
    positions: torch.Tensor, model: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (request, logical state page) the step touches, in request then first-touch order,
    with the page's 8-bit row mask: `(request, logical_page, row_mask)` int64 [N]."""
    sb = model.c128_state_block_size
    b, s = positions.shape
    p = positions.to(torch.int64)
    page, intra = p // sb, p % sb
    request = torch.arange(b, dtype=torch.int64)[:, None].expand(b, s)
    # Positions of a request are ascending, so equal pages are adjacent and the first of a
    # run is the first touch.
    first = torch.ones_like(page, dtype=torch.bool)
    first[:, 1:] = page[:, 1:] != page[:, :-1]
    run = torch.cumsum(first.reshape(-1), 0) - 1
    mask = torch.zeros(int(first.sum()), dtype=torch.int64).index_add_(0, run, 1 << intra.reshape(-1))
    return request[first], page[first], mask


def injective_state_pages(
    positions: torch.Tensor, model: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The re-placement of §5.4 step 3, or None when the default table is already injective.

    Returns `(request, logical_page, physical_page)` int64 [N] for every touched page. Raises
    ConfigError when the state pool cannot hold the step's rows.
    """
    sb, phys = model.c128_state_block_size, model.hca_state_physical_blocks
    batch = positions.shape[0]
    p = positions.to(torch.int64)
    request = torch.arange(batch, dtype=torch.int64)[:, None]
    default_rows = (((p // sb) % phys) * batch + request) % phys * sb + p % sb
    if torch.unique(default_rows).numel() == default_rows.numel():
        return None
    request, page, mask = _touched_state_pages(positions, model)
    occupancy = torch.zeros(phys, dtype=torch.int64)
    placed = torch.empty_like(page)
    # First-fit placement is sequential by definition: each page's choice depends on the
    # occupancy left by all earlier (request, page) pairs (at most 2 per request).
    for i, m in enumerate(mask.tolist()):
        fits = torch.nonzero((occupancy != 0) & ((occupancy & m) == 0))
        if fits.numel() == 0:
            fits = torch.nonzero(occupancy == 0)
        if fits.numel() == 0:
            raise ConfigError(
                f"hca: the compressor state pool ({phys} pages of {sb} rows) cannot hold the "
                f"{positions.numel()} state rows of this step without aliasing"
            )
        placed[i] = fits[0, 0]
        occupancy[placed[i]] |= m
    return request, page, placed


def state_block_table(positions: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """`compress_state_block_table` int32 [B, STATE_TABLE_BLOCKS] (§5.4, §9: 512 KiB a request).

    The default interleaved table has period STATE_PHYS in the logical page, so it is built
    once for one period and tiled (never as an int64 [B, 131072] temporary); only the touched
    pages are re-placed when the default aliases.
    """
    phys, width = model.hca_state_physical_blocks, state_table_blocks(model)
    batch = positions.shape[0]
    period = metadata.block_table(batch, table_blocks=phys, physical_blocks=phys)
    table = period.repeat(1, ceil_div(width, phys))[:, :width].contiguous()
    placement = injective_state_pages(positions, model)
    if placement is not None:
        request, page, placed = placement
        table[request, page] = placed.to(torch.int32)
    return table


def _narrow(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The columns of `table` the positions can reach (the metadata helpers widen the table they
    get to int64; the full state table would be 64 MiB at batch 64)."""
    return table[:, : int(positions.max()) // block_size + 1]


def rank_metadata(case: Case, starts: list[int]) -> dict[str, torch.Tensor]:
    """Every deterministic tensor of one rank's fixture built from its start positions (§5)."""
    m = case.model
    seq, bs, sb = m.decode_seq, m.block_size, m.c128_state_block_size
    starts_t = torch.tensor(starts, dtype=torch.int64)
    positions = metadata.position_ids_from_starts(starts_t, seq)  # [B, S] int32
    raw = raw_block_table(starts_t, m)
    window_swa_indices, window_swa_lens = metadata.swa_indices_and_lens(positions, raw, bs, m.sliding_window)
    cmp_table = cmp_block_table(starts_t, m, cmp_table_width(case))
    state_table = state_block_table(positions, m)
    freqs_cos, freqs_sin = rope.rope_rows(m, positions, RATIO)
    # The compressed row's angle is its block start 128*(cp // 128) = start - start % 128 (§10.10).
    block_cos, block_sin = rope.rope_rows(m, starts_t - starts_t % RATIO, RATIO)
    half = m.qk_rope_head_dim // 2
    cmp_freqs_cos = torch.zeros(capacity_batch(case), half, dtype=torch.float32)
    cmp_freqs_sin = torch.zeros_like(cmp_freqs_cos)
    cmp_freqs_cos[: len(starts)] = f32(block_cos[:, :half])
    cmp_freqs_sin[: len(starts)] = f32(block_sin[:, :half])
    return {
        "freqs_cos": freqs_cos,
        "freqs_sin": freqs_sin,
        "cmp_freqs_cos": cmp_freqs_cos,
        "cmp_freqs_sin": cmp_freqs_sin,
        "compress_state_block_table": state_table,
        "cmp_block_table": cmp_table,
        "ori_slot_mapping": metadata.paged_slot_mapping(positions, raw, bs).reshape(-1),
        "window_swa_indices": window_swa_indices,
        "window_swa_lens": window_swa_lens,
        "cmp_slot_mapping": metadata.compressed_slot_mapping(positions, cmp_table, RATIO, bs).reshape(-1),
        "state_slot_mapping": metadata.state_slot_mapping(
            positions, _narrow(state_table, positions, sb), sb
        ).reshape(-1),
        "position_ids": positions.reshape(-1),
        "kv_seq_lens": metadata.kv_seq_lens_from_starts(starts_t, seq),
    }


# -- fixture values (hca.md §6) ---------------------------------------------------------------
def _draw(case: Case, shape, *key) -> torch.Tensor:
    return fixture.randn(shape, case.seed, "hca", *key)


def _normalized_cache(case: Case, name: str, pages: int) -> torch.Tensor:
    m = case.model
    c = _draw(case, (pages, m.block_size, 1, m.head_dim), name)
    return bf16(c / c.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(m.rms_norm_eps))


def _wq_b_block(case: Case, g: int) -> torch.Tensor:
    """Columns of output group g of bf16(randn(QL, H*HD) / sqrt(QL))."""
    m = case.model
    return bf16(_draw(case, (m.q_lora_rank, m.group_in), "wq_b", g).div_(m.q_lora_rank**0.5))


def _wq_b(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """wq_b int8 [QL, H*HD] and its per-column scale, one output group's columns at a time.

    The quantization is per column, so group blocks quantize independently (bounds the fp32
    temporaries to one block: 16 MiB at FLASH instead of 128 MiB).
    """
    blocks = [quant_weight_int8(_wq_b_block(case, g), axis=0) for g in range(case.model.o_groups)]
    return torch.cat([q for q, _ in blocks], dim=1), torch.cat([s for _, s in blocks])


def _wo_a_group(case: Case, g: int) -> torch.Tensor:
    m = case.model
    return bf16(_draw(case, (m.o_lora_rank, m.group_in), "wo_a", g).div_(m.group_in**0.5))


def _wo_b_block(case: Case, g: int) -> torch.Tensor:
    """Columns `g*OL .. (g+1)*OL-1` of bf16(randn(D, G*OL) / sqrt(G*OL))."""
    m = case.model
    width = m.o_groups * m.o_lora_rank
    return bf16(_draw(case, (m.hidden_size, m.o_lora_rank), "wo_b", g).div_(width**0.5))


def _replicated_values(case: Case) -> dict[str, torch.Tensor]:
    """The canonical fixture's random and constant tensors (identical on every rank)."""
    m = case.model
    d, hd, od = m.hidden_size, m.head_dim, hca_compressor.out_dim(m)
    wq_b, wq_b_scale = _wq_b(case)
    return {
        "hc_attn_fn": _draw(case, (m.mix_hc, m.hc_dim), "hc_attn_fn") * HC_ATTN_FN_STD,
        "hc_attn_scale": torch.tensor(HC_ATTN_SCALE, dtype=torch.float32),
        "hc_attn_base": torch.tensor(HC_ATTN_BASE, dtype=torch.float32),
        "attn_norm_w": torch.ones(d, dtype=torch.bfloat16),
        "wq_a": bf16(_draw(case, (d, m.q_lora_rank), "wq_a").div_(d**0.5)),
        "wq_b": wq_b,
        "wq_b_scale": wq_b_scale,
        "wkv": bf16(_draw(case, (d, hd), "wkv").div_(d**0.5)),
        "gamma_cq": torch.ones(m.q_lora_rank, dtype=torch.bfloat16),
        "gamma_ckv": torch.ones(hd, dtype=torch.bfloat16),
        "cmp_wkv": bf16(_draw(case, (od, d), "cmp_wkv").mul_(CMP_WKV_STD)),
        "cmp_wgate": bf16(_draw(case, (od, d), "cmp_wgate").mul_(CMP_WGATE_STD)),
        "cmp_ape": _draw(case, (RATIO, od), "cmp_ape") * CMP_APE_STD,
        "cmp_norm_w": bf16(CMP_NORM_W_MEAN + CMP_NORM_W_STD * _draw(case, (hd,), "cmp_norm_w")),
        # Zeros in both halves: never-written rows enter a pooling window as (kv 0, score 0).
        "compress_state": torch.zeros(m.hca_state_physical_blocks, m.c128_state_block_size, 2 * od),
        "kv_cache": _normalized_cache(case, "kv_cache", m.kv_ori_block_num),
        "cmp_kv": _normalized_cache(case, "cmp_kv", m.kv_cmp_block_num),
        "attn_sink": torch.zeros(m.num_attention_heads),
    }


def _x_hc_base(case: Case) -> torch.Tensor:
    m = case.model
    return fixture.uniform((case.local_t, m.hc_mult, m.hidden_size), -1.0, 1.0, case.seed, "hca", "x_hc")


def _ordered(case: Case, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: values[n] for n, s in LAYER.tensor_specs(case).items() if s.kind is not Kind.OUTPUT}


def stacked_inputs(case: Case) -> dict[str, torch.Tensor]:
    """The whole TP group's fixture, rank-stacked `[tp, ...]` (the reference's layout, §6.3).

    A second code path to `rank_inputs`: the full weights are quantized at once and sharded by
    reshape as the reference does, the canonical tensors replicated by stacking.
    """
    p, m = case.tp, case.model
    values = _replicated_values(case)
    stacked = {n: torch.stack([v] * p) for n, v in values.items()}
    per_rank = [rank_metadata(case, s) for s in _all_rank_starts(case)]
    stacked.update({n: torch.stack([md[n] for md in per_rank]) for n in per_rank[0]})
    offsets = torch.arange(p, dtype=torch.float32)[:, None, None, None] * X_HC_RANK_OFFSET
    stacked["x_hc"] = _x_hc_base(case)[None] + offsets
    wo_a, wo_b, wo_b_scale = LAYER.o_recipe.whole(case)
    lg = case.local_o_groups
    stacked["wo_a"] = wo_a.reshape(p, lg, m.o_lora_rank, m.group_in)
    stacked["wo_b"] = wo_b.reshape(m.hidden_size, p, lg * m.o_lora_rank).permute(1, 0, 2).contiguous()
    stacked["wo_b_scale"] = torch.stack([wo_b_scale] * p)
    # The one scalar is not stacked (validation.md §2.2).
    stacked["local_t"] = torch.tensor(case.local_t, dtype=torch.int32)
    return _ordered(case, stacked)


# -- the layer computation (hca.md §4, §7.1) --------------------------------------------------
def write_kv_cache(kv_cache: torch.Tensor, ori_slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """`kv_cache[r // 32, r % 32, 0] = kv[t]` for every token with `r = ori_slot_mapping[t] >= 0` (§4.5)."""
    slots = ori_slot_mapping.to(torch.int64)
    keep = slots >= 0
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slots[keep], kv[keep])


def visible_compressed_rows(position_ids: torch.Tensor, kv_seq_lens: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """`n_c = min((pos+1)//128, kv_seq_lens[b]//128, MAX_CMP_ROWS)` per token, int64 [T] (§4.6 step 2).

    Row c covers positions [128c, 128c+127], so it is visible to t iff 128c+127 <= pos[t]: the
    row committed at a boundary token is visible to that token and the later ones of its chunk.
    """
    pos = position_ids.to(torch.int64)
    seq_lens = kv_seq_lens.to(torch.int64).repeat_interleave(model.decode_seq)
    return torch.minimum((pos + 1) // RATIO, seq_lens // RATIO).clamp_max(max_cmp_rows(model))


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


class _Steps(NamedTuple):
    """The stages of §4.1-4.6 and §4.8, in call order."""

    hc_pre: Callable
    rms_norm: Callable
    qkv_proj_rope: Callable
    compress: Callable
    write_kv_cache: Callable
    attention_keys: Callable
    sparse_attention: Callable
    pack_heads: Callable
    hc_post: Callable


def _live_steps() -> _Steps:
    """The stages as their modules hold them at call time (the TP forward's)."""
    return _Steps(
        hc.hc_pre, qkv.rms_norm, qkv.qkv_proj_rope, hca_compressor.compress, write_kv_cache, attention_keys,
        attention.sparse_attention, attention.pack_heads, hc.hc_post,
    )  # fmt: skip


# The golden's own references, bound at import (its compressor runs the compressor's
# GOLDEN_STEPS): a defect a test injects into a module later never reaches the expected values.
_GOLDEN_STEPS = _live_steps()._replace(
    compress=functools.partial(hca_compressor.compress, steps=hca_compressor.GOLDEN_STEPS)
)
_GOLDEN_O_PROJ = output_half.grouped_o_proj


def attention_half(
    model: ModelConfig, tensors: dict[str, torch.Tensor], steps: _Steps
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 4.1-4.6 on one rank (rank-local, every head): `(attention_grouped, post, comb)`.

    Updates compress_state, cmp_kv and kv_cache in place. Shared by the golden and the TP
    forward, so everything before the output projection is bitwise the golden's.
    """
    s, x = steps, tensors
    x_mixed, post, comb = s.hc_pre(x["x_hc"], x["hc_attn_fn"], x["hc_attn_scale"], x["hc_attn_base"], model)
    x_normed = s.rms_norm(x_mixed, x["attn_norm_w"], model.rms_norm_eps)
    q, kv, _, _ = s.qkv_proj_rope(
        x_normed, x["wq_a"], x["wq_b"], x["wq_b_scale"], x["wkv"], x["freqs_cos"], x["freqs_sin"],
        x["gamma_cq"], x["gamma_ckv"], model,
    )  # fmt: skip
    s.compress(
        model, x_normed, x["cmp_wkv"], x["cmp_wgate"], x["cmp_ape"], x["cmp_norm_w"],
        x["cmp_freqs_cos"], x["cmp_freqs_sin"], x["compress_state"], x["compress_state_block_table"],
        x["cmp_kv"], x["position_ids"], x["state_slot_mapping"], x["cmp_slot_mapping"],
    )  # fmt: skip
    # After the compressor (§4.5): the two touch different pools; both precede attention.
    s.write_kv_cache(x["kv_cache"], x["ori_slot_mapping"], kv)
    keys, valid = s.attention_keys(
        model, x["kv_cache"], x["cmp_kv"], x["window_swa_indices"], x["cmp_block_table"],
        x["position_ids"], x["kv_seq_lens"],
    )  # fmt: skip
    o = s.sparse_attention(q, keys, valid, x["attn_sink"], model.softmax_scale)  # [T, H, HD] fp32
    attention_grouped = s.pack_heads(o, x["freqs_cos"], x["freqs_sin"], model)  # [G, T, GI] bf16
    return attention_grouped, post, comb


def golden_decode_hca_tp1(model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The TP1 HCA layer (§4) on one rank's tensors with the full O weights.

    Updates compress_state, kv_cache and cmp_kv in place; returns them and x_out [T, HC, D].
    """
    attention_grouped, post, comb = attention_half(model, tensors, _GOLDEN_STEPS)
    attn_out = _GOLDEN_O_PROJ(attention_grouped, tensors["wo_a"], tensors["wo_b"], tensors["wo_b_scale"])
    return _outputs(tensors, _GOLDEN_STEPS.hc_post(attn_out, tensors["x_hc"], post, comb))


def _outputs(tensors: dict[str, torch.Tensor], x_out: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x_out": x_out, **{n: tensors[n] for n in ("compress_state", "kv_cache", "cmp_kv")}}


class HCALayer(LayerDrawingOWeights):
    name = "hca"
    o_recipe = OWeightRecipe(_wo_a_group, _wo_b_block)

    def validate(self, case: Case) -> None:
        case.validate()
        m = case.model
        if m.decode_seq > RATIO:
            raise ConfigError(
                f"hca: decode_seq={m.decode_seq} must be <= {RATIO} (at most one compression boundary per chunk)"
            )
        for rank, starts in enumerate(_all_rank_starts(case)):
            case.check_starts(starts, m.long_context_max_seq_len)
            starts_t = torch.tensor(starts, dtype=torch.int64)
            where = f"hca rank {rank} (starts {starts})"
            raw = int(raw_window_pages(starts_t, m)[1].sum())
            if raw > m.kv_ori_block_num:
                raise ConfigError(
                    f"{where}: the raw-window pages need {raw} pages, kv_ori_block_num is {m.kv_ori_block_num}"
                )
            cmp = int(cmp_pages(starts_t, m).sum())
            if cmp > m.kv_cmp_block_num:
                raise ConfigError(
                    f"{where}: the compressed rows need {cmp} pages of {m.block_size}, kv_cmp_block_num is "
                    f"{m.kv_cmp_block_num} (a ~1M-token request alone fills 256)"
                )
            injective_state_pages(metadata.position_ids_from_starts(starts_t, m.decode_seq), m)

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
            "cmp_freqs_cos": TensorSpec((capacity_batch(case), half), f32_, i),
            "cmp_freqs_sin": TensorSpec((capacity_batch(case), half), f32_, i),
            "cmp_wkv": TensorSpec((od, d), bf16_, i),
            "cmp_wgate": TensorSpec((od, d), bf16_, i),
            "cmp_ape": TensorSpec((RATIO, od), f32_, i),
            "cmp_norm_w": TensorSpec((hd,), bf16_, i),
            "compress_state": TensorSpec((m.hca_state_physical_blocks, m.c128_state_block_size, 2 * od), f32_, io),
            "compress_state_block_table": TensorSpec((b, state_table_blocks(m)), i32, i),
            "kv_cache": TensorSpec((m.kv_ori_block_num, *pool), bf16_, io),
            "cmp_kv": TensorSpec((m.kv_cmp_block_num, *pool), bf16_, io),
            "cmp_block_table": TensorSpec((b, cmp_table_width(case)), i32, i),
            "ori_slot_mapping": TensorSpec((t,), i64, i),
            "window_swa_indices": TensorSpec((t, m.sliding_window), i32, i),
            "window_swa_lens": TensorSpec((t,), i32, i),
            "cmp_slot_mapping": TensorSpec((t,), i64, i),
            "state_slot_mapping": TensorSpec((t,), i64, i),
            "position_ids": TensorSpec((t,), i32, i),
            "kv_seq_lens": TensorSpec((b,), i32, i),
            **tail_tensor_specs(case),
        }

    def rank_inputs_without_o(self, case: Case, rank: int) -> dict[str, torch.Tensor]:
        values = _replicated_values(case)
        values.update(rank_metadata(case, rank_starts(case, rank)))
        values["x_hc"] = _x_hc_base(case) + rank * X_HC_RANK_OFFSET
        values["local_t"] = torch.tensor(case.local_t, dtype=torch.int32)
        return values

    def golden(self, model: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return golden_decode_hca_tp1(model, tensors)

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One rank of the TP HCA layer (§7.1): wo_a / wo_b are this rank's shards."""
        s = _live_steps()
        attention_grouped, post, comb = attention_half(ctx.model, tensors, s)  # [G, t, GI]
        attn_out = tp.tp_output_half(ctx, attention_grouped, tensors["wo_a"], tensors["wo_b"], tensors["wo_b_scale"])
        return _outputs(tensors, s.hc_post(attn_out, tensors["x_hc"], post, comb))

    def checks(self, case: Case) -> tuple[Check, ...]:
        sb, bs = case.model.c128_state_block_size, case.model.block_size
        return (
            PoolCheck(
                "compress_state", "state_slot_mapping", sb, atol=1e-3, rtol=1 / 128, pool_name="compressor state"
            ),
            PoolCheck("kv_cache", "ori_slot_mapping", bs, atol=1e-3, rtol=1 / 128, pool_name="original KV cache"),
            PoolCheck("cmp_kv", "cmp_slot_mapping", bs, atol=1e-3, rtol=1 / 128, pool_name="compressed KV cache"),
            RelDiffCheck("x_out", diff_thd=3e-3, pct_thd=0.008, max_diff_hd=1.0),
        )


LAYER = HCALayer()

__all__ = [
    "HCALayer",
    "LAYER",
    "stacked_inputs",
    "rank_metadata",
    "state_block_table",
    "injective_state_pages",
    "raw_block_table",
    "cmp_block_table",
    "compressed_key_rows",
    "visible_compressed_rows",
    "write_kv_cache",
    "attention_keys",
    "attention_half",
    "golden_decode_hca_tp1",
]
