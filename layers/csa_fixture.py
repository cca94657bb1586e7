"""The CSA fixture: one logical global batch, built rank by rank or stacked (spec csa.md §5–§7.1).

Owns the CSA-specific fixture rules: the global start set of `tp·batch` requests, the
per-rank-group injective cache tables (`init_injective_cache_block_table`), the globally
allocated compressor-state tables (`init_active_state_block_table`), the replicated initial
pools (states with the true −inf sentinel in never-written score halves, normalized caches,
the int8 indexer cache), the value recipes of every weight (§6.5, weights quantized half away
from zero, §6.7) including `gen_shared_weight` for the indexer's wq_b, and the Sylvester
Hadamard matrix.

Two code paths build the same bits: `rank_tensors(case, rank)` with `O_RECIPE` materializes
only what rank r holds (its requests' metadata rows, its O-weight shards, its x_hc rows; pools
and replicated weights are its own replicated copies), `stacked_tensors(case)` builds the whole global
fixture at once and slices it as the reference does (§7.1). Every random tensor has its own
key (`layers.fixture`): replicated tensors are keyed without the rank, x_hc per global
request, wo_a per output group and wo_b per group column block, so no rank replays another
rank's stream. The CSA reference fixture is unseeded (§10.4); here everything derives from
`case.seed`.

Not here: the layer math (`layers.csa`), the comparators.
"""

from __future__ import annotations

import math

import torch

from . import fixture, metadata, rope
from .case import Case
from .config import ConfigError, ModelConfig, ceil_div
from .numerics import bf16, f32, int8_quant_per_row, quant_weight_int8
from .o_weights import OWeightRecipe

COMPRESS_RATIO = 4
COFF = 2  # overlapping compressor: every position feeds two compressed slots
CACHE_TILE = 64  # the indexer tile of the reference start set (255 = 4·64 − 1, 511)

HC_ATTN_SCALE = (0.076099, 0.032597, 0.226994)  # real layer-8 CSA values (§6.5)
HC_ATTN_BASE = (
    5.9166, -3.6223, -2.9324, -3.3124, -3.9100, -0.9384, -3.3256, -2.5240,
    2.0706, -2.5728, 0.1424, -3.9453, -3.8859, 3.4634, -3.3799, -2.6077,
    -2.7191, -2.4846, 2.0395, -0.5010, -3.5992, -2.7520, -3.3493, 3.1587,
)  # fmt: skip
ATTN_SINK = 4.0
# gen_shared_weight parameters of the indexer's wq_b (§6.7).
IDX_WQ_B_DEQUANT_STD = 0.108
IDX_WQ_B_CHAN_CV = 0.56
MXFP8_BLOCK = 128
FP8_E4M3_MAX = 448.0


# -- sizes -------------------------------------------------------------------------------------
def main_out(model: ModelConfig) -> int:
    """MO = COFF·HD: width of the main compressor's kv (and score) projection."""
    return COFF * model.head_dim


def inner_out(model: ModelConfig) -> int:
    """IO = COFF·ID: width of the inner (indexer) compressor's projections."""
    return COFF * model.index_head_dim


def raw_table_cols(model: ModelConfig) -> int:
    return ceil_div(model.max_position_embeddings, model.block_size)


def cmp_table_cols(model: ModelConfig) -> int:
    return ceil_div(model.max_position_embeddings // COMPRESS_RATIO, model.block_size)


def idx_table_cols(model: ModelConfig) -> int:
    """Twice what is needed, as the reference (IDX_CACHE_MAX_BLOCKS = 2·KV_CMP_MAX_BLOCKS)."""
    return 2 * cmp_table_cols(model)


def state_table_cols(model: ModelConfig) -> int:
    return ceil_div(model.max_position_embeddings, model.c4a_state_block_size)


# -- start positions and metadata ------------------------------------------------------------
def global_starts(case: Case) -> list[int]:
    """Start of every request of the TP group, global request order (rank r: r·batch …)."""
    m = case.model
    canonical = metadata.csa_decode_start_set(
        case.group_batch,
        seq=case.seq,
        compress_ratio=COMPRESS_RATIO,
        state_block_size=m.c4a_state_block_size,
        cache_tile=CACHE_TILE,
        window=m.sliding_window,
        long_pos=m.decode_start_pos,
    )
    b = case.batch
    return [s for r in range(case.tp) for s in case.starts_for_rank(r, canonical[r * b : (r + 1) * b])]


def boundary_slots(positions: torch.Tensor) -> torch.Tensor:
    """Compressed slot `p div 4` at boundary tokens `(p+1) mod 4 == 0`, −1 elsewhere (both boundaries)."""
    p = positions.to(torch.int64)
    return torch.where((p + 1) % COMPRESS_RATIO == 0, p // COMPRESS_RATIO, torch.full_like(p, -1))


def injective_cache_table(
    default_rows: torch.Tensor, active: torch.Tensor, physical_blocks: int, block_size: int, what: str
) -> torch.Tensor:
    """`init_injective_cache_block_table` for one mapping group (csa.md §6.2).

    default_rows [Bg, cols] the default table's rows of the group's requests, active [Bg, S]
    logical rows (positions or compressed slots, −1 = none). If the active rows alias, the
    group's distinct active pages are re-placed on pages 0, 1, … in request order (distinct
    pages, so the reference's re-check cannot fail); every other entry keeps the default
    (history reads may alias other requests' pages, §9).
    """
    table = default_rows.clone()
    cols = table.shape[1]
    act = active.to(torch.int64)
    pages = torch.where(act >= 0, act // block_size, torch.full_like(act, -1))
    if int(pages.max()) >= cols:
        raise ConfigError(f"{what}: an active logical page {int(pages.max())} is outside the {cols}-page table")
    if _rows_alias(table, act, block_size):
        nxt = 0
        # Sequential by construction: the counter hands out pages in request order.
        for b in range(table.shape[0]):
            for page in torch.unique(pages[b][pages[b] >= 0]).tolist():
                if nxt >= physical_blocks:
                    raise ConfigError(
                        f"{what}: re-placing the active pages needs more than {physical_blocks} physical pages"
                    )
                table[b, page] = nxt
                nxt += 1
    return table


def _rows_alias(table: torch.Tensor, active: torch.Tensor, block_size: int) -> bool:
    rows = metadata.paged_slot_mapping(active.clamp_min(0), table, block_size)[active >= 0]
    rows = rows[rows >= 0]
    return rows.numel() != torch.unique(rows).numel()


def active_state_block_table(
    starts: list[int], seq: int, cols: int, physical_blocks: int, state_block_size: int, what: str
) -> torch.Tensor:
    """`init_active_state_block_table` over the whole group batch (csa.md §6.2), int32 [GB, cols].

    Starting from the default table, each request's touched logical pages (in order of first
    appearance) get the first physical page whose occupancy is non-empty and disjoint from the
    rows they use (pairing half-used pages), else the first empty page. The current rows of all
    requests of all ranks are then pairwise distinct; history pages keep the default mapping.
    """
    table = metadata.block_table(len(starts), cols, physical_blocks).clone()
    occupancy = [0] * physical_blocks
    # Greedy first fit in request order: each choice depends on every earlier one.
    for b, start in enumerate(starts):
        masks: dict[int, int] = {}
        for p in range(start, start + seq):
            masks[p // state_block_size] = masks.get(p // state_block_size, 0) | (1 << (p % state_block_size))
        for page, mask in masks.items():
            if page >= cols:
                raise ConfigError(f"{what}: position {start + seq - 1} is outside the {cols}-page state table")
            pick = next((i for i, occ in enumerate(occupancy) if occ and not occ & mask), None)
            if pick is None:
                pick = next((i for i, occ in enumerate(occupancy) if not occ), None)
            if pick is None:
                raise ConfigError(
                    f"{what}: {physical_blocks} physical pages of {state_block_size} rows cannot hold the "
                    f"current rows of {len(starts)} requests x {seq} tokens"
                )
            table[b, page] = pick
            occupancy[pick] |= mask
    return table


def history_rows(starts: list[int], state_table: torch.Tensor, state_block_size: int) -> torch.Tensor:
    """The distinct state rows of the history positions `a < start` of all requests, int64."""
    longest = max(starts)
    if longest == 0:
        return torch.zeros(0, dtype=torch.int64)
    a = torch.arange(longest, dtype=torch.int64)
    hist = torch.where(a[None, :] < torch.tensor(starts)[:, None], a[None, :], torch.full((1, longest), -1))
    rows = metadata.state_slot_mapping(hist, state_table, state_block_size)
    return torch.unique(rows[rows >= 0])


def cache_tables(case: Case, positions: torch.Tensor, requests: slice) -> dict[str, torch.Tensor]:
    """The raw-window, cmp and idx tables of one mapping group (rank), int32 [Bg, cols].

    `positions` [Bg, S] are the group's requests, `requests` their global indices (rows of
    the default tables, which interleave the whole group batch).
    """
    m = case.model
    gb, bs = case.group_batch, m.block_size
    slots = boundary_slots(positions)

    def table(cols, phys, active, what):
        default = metadata.block_table(gb, cols, phys)[requests]
        return injective_cache_table(default, active, phys, bs, what)

    return {
        "raw": table(raw_table_cols(m), m.kv_ori_block_num, positions, "kv_cache"),
        "cmp_block_table": table(cmp_table_cols(m), m.kv_cmp_block_num, slots, "cmp_kv"),
        "idx_block_table": table(idx_table_cols(m), m.idx_cache_block_num, slots, "idx_kv_cache"),
    }


def request_metadata(
    model: ModelConfig, positions: torch.Tensor, tables: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Slot mappings, window indices and sequence lengths of requests `positions` [B, S].

    `tables` holds the requests' rows of the raw-window, cmp, idx and both state tables.
    Token tensors are flattened token-major (`t = b·S + s`).
    """
    bs, sb = model.block_size, model.c4a_state_block_size
    raw = tables["raw"]
    window, lens = metadata.swa_indices_and_lens(positions, raw, bs, model.sliding_window)
    cmp_table, idx_table = tables["cmp_block_table"], tables["idx_block_table"]
    state_table, inner_table = tables["compress_state_block_table"], tables["inner_compress_state_block_table"]
    return {
        "compress_state_block_table": state_table,
        "inner_compress_state_block_table": inner_table,
        "cmp_block_table": cmp_table,
        "idx_block_table": idx_table,
        "ori_slot_mapping": metadata.paged_slot_mapping(positions, raw, bs).reshape(-1),
        "window_swa_indices": window,
        "window_swa_lens": lens,
        "cmp_slot_mapping": metadata.compressed_slot_mapping(positions, cmp_table, COMPRESS_RATIO, bs).reshape(-1),
        "idx_slot_mapping": metadata.compressed_slot_mapping(positions, idx_table, COMPRESS_RATIO, bs).reshape(-1),
        "state_slot_mapping": metadata.state_slot_mapping(positions, state_table, sb).reshape(-1),
        "inner_state_slot_mapping": metadata.state_slot_mapping(positions, inner_table, sb).reshape(-1),
        "position_ids": positions.reshape(-1),
        "kv_seq_lens": metadata.kv_seq_lens_from_starts(positions[:, 0], positions.shape[1]),
    }


def state_tables(case: Case, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The main and inner state tables of the whole group batch (allocated globally, §6.2)."""
    m = case.model
    cols, sb = state_table_cols(m), m.c4a_state_block_size
    return (
        active_state_block_table(starts, case.seq, cols, m.csa_state_physical_blocks, sb, "compress_state"),
        active_state_block_table(starts, case.seq, cols, m.csa_inner_state_physical_blocks, sb, "inner_compress_state"),
    )


# -- pools -----------------------------------------------------------------------------------
def initial_state(
    seed: int, name: str, physical_blocks: int, state_block_size: int, out: int, starts: list[int], table: torch.Tensor
) -> torch.Tensor:
    """A compressor-state pool before the step (§6.3): fp32 [NB, SB, 2·out].

    Never-written rows hold kv 0 and a true −inf score half (the sentinel); every row some
    request reads as history holds one physical draw `0.05·N(0, 1)` in both halves.
    """
    z = torch.zeros(physical_blocks * state_block_size, 2 * out)
    z[:, out:] = float("-inf")
    hist = history_rows(starts, table, state_block_size)
    h = fixture.randn((physical_blocks * state_block_size, 2 * out), seed, name, "history") * 0.05
    z[hist] = h[hist]
    return z.reshape(physical_blocks, state_block_size, 2 * out)


def normalized_cache(shape: tuple[int, ...], eps: float, seed: int, name: str) -> torch.Tensor:
    """`randn` rows scaled to unit RMS over the last axis, fp32 (rounded by the caller, §6.4)."""
    c = fixture.randn(shape, seed, name)
    return c / c.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp_min(eps)


def replicated_pools(
    case: Case, starts: list[int], main_table: torch.Tensor, inner_table: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The six in-out pools as every rank's copy starts them (identical on all ranks).

    `main_table` / `inner_table` are the whole group batch's state tables: every request's
    history rows are finite in every copy, whichever rank owns the request.
    """
    m, seed = case.model, case.seed
    bs, sb, eps = m.block_size, m.c4a_state_block_size, m.rms_norm_eps
    idx_q, idx_scale = int8_quant_per_row(
        bf16(normalized_cache((m.idx_cache_block_num, bs, 1, m.index_head_dim), eps, seed, "idx_kv_cache"))
    )
    return {
        "compress_state": initial_state(
            seed, "compress_state", m.csa_state_physical_blocks, sb, main_out(m), starts, main_table
        ),
        "inner_compress_state": initial_state(
            seed, "inner_compress_state", m.csa_inner_state_physical_blocks, sb, inner_out(m), starts, inner_table
        ),
        "kv_cache": bf16(normalized_cache((m.kv_ori_block_num, bs, 1, m.head_dim), eps, seed, "kv_cache")),
        "cmp_kv": bf16(normalized_cache((m.kv_cmp_block_num, bs, 1, m.head_dim), eps, seed, "cmp_kv")),
        "idx_kv_cache": idx_q,
        "idx_kv_scale": idx_scale,
    }


# -- weights ---------------------------------------------------------------------------------
def hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard matrix of order n (a power of two) divided by √n, fp32 (bf16 by the caller)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h / math.sqrt(n)


def gen_shared_weight(out_features: int, in_features: int, dequant_std: float, chan_cv: float, seed: int, name: str):
    """Int8 weight with an MXFP8-simulated source and per-row scales (§6.7).

    `W = randn · exp(chan_cv · randn(out, 1))`, rounded through float8_e4m3fn with a power-of-two
    scale per 128×128 block, quantized per row with round-half-even and clamp (scale amax/127),
    then every scale multiplied by one factor making the dequantized std `dequant_std`.
    Returns `(q int8 [out, in], scale fp32 [out])`.
    """
    w = fixture.randn((out_features, in_features), seed, name, "source")
    w = w * torch.exp(chan_cv * fixture.randn((out_features, 1), seed, name, "channel"))
    blk = MXFP8_BLOCK
    wb = w.reshape(out_features // blk, blk, in_features // blk, blk)
    block_max = wb.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(torch.clamp(block_max / FP8_E4M3_MAX, min=1e-20))))
    wq = (f32((wb / s).to(torch.float8_e4m3fn)) * s).reshape(out_features, in_features)
    sc = wq.abs().amax(dim=1, keepdim=True).clamp_min(1e-4) / 127.0
    q = torch.clamp(torch.round(wq / sc), -127, 127)
    scale = sc * (dequant_std / (q * sc).std())
    return q.to(torch.int8), scale.reshape(out_features)


def replicated_weights(case: Case) -> dict[str, torch.Tensor]:
    """Every weight, norm, table and fixed vector all ranks hold identically (§6.5), but wo_b_scale.

    wo_b_scale comes with the O weights (`O_RECIPE`).
    """
    m, seed = case.model, case.seed
    d, ql, h, hd = m.hidden_size, m.q_lora_rank, m.num_attention_heads, m.head_dim
    ih, idd, mo, io = m.index_n_heads, m.index_head_dim, main_out(m), inner_out(m)

    def rn(shape, name, std=1.0, mean=0.0):
        return fixture.randn(shape, seed, name).mul_(std).add_(mean)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    wq_b, wq_b_scale = quant_weight_int8(bf16(rn((ql, h * hd), "wq_b", ql**-0.5)), axis=0, half_away_from_zero=True)
    idx_q, idx_scale = gen_shared_weight(ih * idd, ql, IDX_WQ_B_DEQUANT_STD, IDX_WQ_B_CHAN_CV, seed, "idx_wq_b")
    base, original = rope.rope_profile(m, COMPRESS_RATIO)
    freqs_cos, freqs_sin = rope.precompute_freqs_cos_sin(
        m.qk_rope_head_dim, m.max_position_embeddings, original, base, m.rope_factor, m.beta_fast, m.beta_slow
    )
    return {
        "hc_attn_fn": rn((m.mix_hc, m.hc_dim), "hc_attn_fn", 0.0519),
        "hc_attn_scale": torch.tensor(HC_ATTN_SCALE, dtype=torch.float32),
        "hc_attn_base": torch.tensor(HC_ATTN_BASE, dtype=torch.float32),
        "attn_norm_w": ones(d),
        "wq_a": bf16(rn((d, ql), "wq_a", d**-0.5)),
        "wq_b": wq_b,
        "wq_b_scale": wq_b_scale,
        "wkv": bf16(rn((d, hd), "wkv", d**-0.5)),
        "gamma_cq": ones(ql),
        "gamma_ckv": ones(hd),
        "freqs_cos": freqs_cos,
        "freqs_sin": freqs_sin,
        "cmp_wkv": bf16(rn((mo, d), "cmp_wkv", 0.0240)),
        "cmp_wgate": bf16(rn((mo, d), "cmp_wgate", 0.0381)),
        "cmp_ape": rn((COMPRESS_RATIO, mo), "cmp_ape", 0.1226),
        "cmp_norm_w": bf16(rn((hd,), "cmp_norm_w", 0.1916, 0.9569)),
        "idx_wq_b": idx_q.t().contiguous(),
        "idx_wq_b_scale": idx_scale,
        "weights_proj": bf16(rn((d, ih), "weights_proj", 0.2218)),
        "hadamard_idx": bf16(hadamard(idd)),
        "inner_wkv": bf16(rn((io, d), "inner_wkv", 0.0270)),
        "inner_wgate": bf16(rn((io, d), "inner_wgate", 0.0513)),
        "inner_ape": rn((COMPRESS_RATIO, io), "inner_ape", 0.1524),
        "inner_norm_w": bf16(rn((idd,), "inner_norm_w", 0.2663, 0.6903)),
        "attn_sink": torch.full((h,), ATTN_SINK, dtype=torch.float32),
    }


def wo_a_group(case: Case, g: int) -> torch.Tensor:
    """Output group g of wo_a, bf16 [OL, GI] (`randn/√GI`), drawn on its own key."""
    m = case.model
    return bf16(fixture.randn((m.o_lora_rank, m.group_in), case.seed, "wo_a", g).mul_(m.group_in**-0.5))


def wo_b_block(case: Case, g: int) -> torch.Tensor:
    """Column block g of wo_b before quantization, bf16 [D, OL] (`randn/√(G·OL)`)."""
    m = case.model
    std = (m.o_groups * m.o_lora_rank) ** -0.5
    return bf16(fixture.randn((m.hidden_size, m.o_lora_rank), case.seed, "wo_b", g).mul_(std))


# A rank's O weights: drawn per group / column block, quantized half away from zero (§6.7).
O_RECIPE = OWeightRecipe(wo_a_group, wo_b_block, half_away_from_zero=True)


def x_hc_request(case: Case, b: int) -> torch.Tensor:
    """Global request b's hc stream rows, `uniform(−1, 1)` rounded to bf16, stored fp32 [S, HC, D]."""
    m = case.model
    return f32(bf16(fixture.uniform((case.seq, m.hc_mult, m.hidden_size), -1.0, 1.0, case.seed, "x_hc", b)))


# -- the two builders --------------------------------------------------------------------------
def rank_tensors(case: Case, rank: int) -> dict[str, torch.Tensor]:
    """Rank r's inputs and in-out initial values but its O weights (`O_RECIPE`), without
    materializing other ranks' slices.

    The state tables are allocated over the whole group batch (their greedy allocation and
    the replicated pools' history rows depend on every request), then only rank r's rows kept.
    """
    b = case.batch
    starts = global_starts(case)
    own = slice(rank * b, (rank + 1) * b)
    main_table, inner_table = state_tables(case, starts)
    positions = metadata.position_ids_from_starts(starts[own], case.seq)
    tables = cache_tables(case, positions, own)
    tables["compress_state_block_table"] = main_table[own]
    tables["inner_compress_state_block_table"] = inner_table[own]

    tensors = replicated_weights(case)
    tensors.update(replicated_pools(case, starts, main_table, inner_table))
    tensors.update(request_metadata(case.model, positions, tables))
    tensors["x_hc"] = torch.cat([x_hc_request(case, i) for i in range(own.start, own.stop)])
    return tensors


def stacked_tensors(case: Case) -> dict[str, torch.Tensor]:
    """The whole rank-stacked fixture `[tp, …]` in one go: the global build, then the §7.1 slicing.

    Metadata is lowered once over the global batch (cache tables re-placed per rank group),
    O weights are quantized whole and then sharded, pools and replicated weights are copied
    per rank.
    """
    p, b, t = case.tp, case.batch, case.local_t
    m = case.model
    starts = global_starts(case)
    positions = metadata.position_ids_from_starts(starts, case.seq)  # [GB, S]
    groups = [cache_tables(case, positions[r * b : (r + 1) * b], slice(r * b, (r + 1) * b)) for r in range(p)]
    tables = {n: torch.cat([g[n] for g in groups]) for n in groups[0]}
    main_table, inner_table = state_tables(case, starts)
    tables["compress_state_block_table"], tables["inner_compress_state_block_table"] = main_table, inner_table
    shared = replicated_weights(case)
    shared.update(replicated_pools(case, starts, main_table, inner_table))
    wo_a, wo_b, shared["wo_b_scale"] = O_RECIPE.whole(case)

    stacked = {n: v.reshape(p, -1, *v.shape[1:]) for n, v in request_metadata(m, positions, tables).items()}
    stacked.update({n: v.unsqueeze(0).expand(p, *v.shape).clone() for n, v in shared.items()})
    x_hc = torch.cat([x_hc_request(case, i) for i in range(case.group_batch)])
    stacked["x_hc"] = x_hc.reshape(p, t, m.hc_mult, m.hidden_size)
    stacked["wo_a"] = wo_a.reshape(p, case.local_o_groups, m.o_lora_rank, m.group_in)
    stacked["wo_b"] = wo_b.reshape(m.hidden_size, p, -1).permute(1, 0, 2).contiguous()
    return stacked
