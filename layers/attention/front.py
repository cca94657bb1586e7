"""The stages every attention layer starts with: hc_pre, the attention RMSNorm, Q/KV + RoPE.

components.md §3 (hc_pre), §5 (rmsnorm), §6 (qkv_proj_rope); swa.md §3.1–3.3, csa.md §4.1–4.4,
hca.md §4.1–4.3. The RoPE rows are the layer's: SWA and HCA hold per-token rows
(`freqs_cos` / `freqs_sin`), CSA gathers them from its table first (`token_cos` / `token_sin`).
"""

from __future__ import annotations

import torch

from ..components import hc, qkv
from ..contract.checks import AllcloseCheck
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.staged import bf16_close, fp32_close, judged

QKV_WEIGHTS = ("wq_a", "wq_b", "wq_b_scale", "wkv", "gamma_cq", "gamma_ckv")


def _hc_pre(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    x_mixed, post, comb = hc.hc_pre(v["x_hc"], v["hc_attn_fn"], v["hc_attn_scale"], v["hc_attn_base"], ctx.model)
    return {"x_mixed": x_mixed, "post": post, "comb": comb}


def _rms_norm(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    return {"x_normed": qkv.rms_norm(v["x_mixed"], v["attn_norm_w"], ctx.model.rms_norm_eps)}


HC_PRE = Stage(
    "hc_pre", ("x_hc", "hc_attn_fn", "hc_attn_scale", "hc_attn_base"),
    (judged(bf16_close("x_mixed")), judged(fp32_close("post")), judged(fp32_close("comb"))), _hc_pre,
)  # fmt: skip
RMS_NORM = Stage("rms_norm", ("x_mixed", "attn_norm_w"), (judged(bf16_close("x_normed")),), _rms_norm)


def qkv_proj_rope(cos: str = "freqs_cos", sin: str = "freqs_sin", with_qr: bool = False) -> Stage:
    """`q` bf16 [t, H, HD] and `kv` bf16 [t, HD] from x_normed at the token rows `cos` / `sin`;
    `with_qr`: also the int8 query LoRA codes `qr` [t, QL] and `qr_scale` [t, 1] (CSA's indexer
    reads them)."""

    def run(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
        q, kv, qr, qr_scale = qkv.qkv_proj_rope(
            v["x_normed"], v["wq_a"], v["wq_b"], v["wq_b_scale"], v["wkv"], v[cos], v[sin], v["gamma_cq"],
            v["gamma_ckv"], ctx.model,
        )  # fmt: skip
        return {"q": q, "kv": kv, **({"qr": qr, "qr_scale": qr_scale} if with_qr else {})}

    writes = (judged(bf16_close("q")), judged(bf16_close("kv")))
    if with_qr:  # int8 codes may flip by one where the bf16 rounding before them differs
        writes += (judged(AllcloseCheck("qr", atol=1, rtol=0)), judged(fp32_close("qr_scale")))
    return Stage("qkv_proj_rope", ("x_normed", *QKV_WEIGHTS, cos, sin), writes, run)


__all__ = ["QKV_WEIGHTS", "HC_PRE", "RMS_NORM", "qkv_proj_rope"]
