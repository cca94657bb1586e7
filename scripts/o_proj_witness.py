"""The o-projection witness shipped in tests/data/reference: one request per rank of `swa-tp2-64`.

    python scripts/o_proj_witness.py --snapshot PATH/TO/swa-tp2-64 --out tests/data/reference/swa-tp2-64-witness.pt

`swa-tp2-64` is a reduced-dims (`small`) SWA snapshot the reference made on a machine whose
BLAS summed the o-projection's K = 256 in blocks of 128 (`layers/components/o_proj.py`); this
machine's sums it in one pass, so the shipped `mini` snapshots cannot tell the two orders apart
(tests/data/reference/README.md). That snapshot is 23 MB, its cache pool most of it. This
script keeps of it, unchanged, what the first request of each rank (its first DECODE_SEQ tokens)
reads: every input row of those tokens, the weights, and the cache pages their window and
their writes touch, renumbered in order (`swa_indices` and `swa_slot_mapping` follow); and the
reference's own outputs of those tokens and pages. The SWA golden is per token, so the slice
gives the same bits as the whole. Written as one `torch.save` of
`{"in": {...}, "out": {...}, "per_rank": [...], "source": {...}}`; tensors named in `per_rank`
are rank-stacked, the others (identical on both ranks in the snapshot) kept once.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch

DECODE_SEQ = 8  # the tokens of one request in the small snapshot (position_ids run 8 in a row)
TOKEN_ROWS = ("x_hc", "position_ids", "swa_lens", "freqs_cos", "freqs_sin")


def _load(folder: Path) -> dict[str, torch.Tensor]:
    return {p.stem: torch.load(p, weights_only=True) for p in sorted(folder.glob("*.pt"))}


def _renumbered(rows: torch.Tensor, remap: torch.Tensor, block: int) -> torch.Tensor:
    """Flat cache rows in the kept pages' numbering; -1 (no row) stays."""
    kept = remap[rows.clamp(min=0) // block] * block + rows.clamp(min=0) % block
    return torch.where(rows >= 0, kept, rows).to(rows.dtype)


def witness(snapshot: Path) -> dict:
    inp, out = _load(snapshot / "in"), _load(snapshot / "out")
    ranks, block = inp["kv_cache"].shape[0], inp["kv_cache"].shape[2]
    t = DECODE_SEQ
    indices, slots, cache_in, cache_out = [], [], [], []
    for r in range(ranks):
        ind, slot = inp["swa_indices"][r, :t], inp["swa_slot_mapping"][r, :t]
        rows = torch.cat([ind[ind >= 0].long(), slot[slot >= 0].long()])
        pages = torch.unique(rows // block)
        remap = torch.full((inp["kv_cache"].shape[1],), -1, dtype=torch.long)
        remap[pages] = torch.arange(len(pages))
        indices.append(_renumbered(ind, remap, block))
        slots.append(_renumbered(slot, remap, block))
        cache_in.append(inp["kv_cache"][r, pages])
        cache_out.append(out["kv_cache"][r, pages])
    pages = max(len(c) for c in cache_in)

    def pool(caches):  # each rank's kept pages, padded with zero pages no index reaches
        return torch.stack([torch.cat([c, c.new_zeros(pages - len(c), *c.shape[1:])]) for c in caches])

    new_in = {n: x[:, :t].clone() if n in TOKEN_ROWS else x for n, x in inp.items()}
    new_in.update(kv_cache=pool(cache_in), swa_indices=torch.stack(indices), swa_slot_mapping=torch.stack(slots),
                  local_t=torch.tensor(t, dtype=inp["local_t"].dtype))
    per_rank = sorted(n for n, x in new_in.items() if x.dim() and not all(torch.equal(x[0], x[r]) for r in range(ranks)))
    new_in = {n: x if n in per_rank or not x.dim() else x[0].clone() for n, x in new_in.items()}
    digest = hashlib.sha256()
    for p in sorted(snapshot.rglob("*.pt")):
        digest.update(p.read_bytes())
    return {"in": new_in, "out": {"kv_cache": pool(cache_out), "x_out": out["x_out"][:, :t].clone()},
            "per_rank": per_rank,
            "source": {"snapshot": snapshot.name, "tokens_per_rank": t, "sha256_of_pt_files": digest.hexdigest()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshot", type=Path, required=True, help="the reference's swa-tp2-64 snapshot folder")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.save(witness(args.snapshot), args.out)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
