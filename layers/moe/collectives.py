"""The MoE layer's two all-to-alls alone, exact on integer data: `layer=moe scope=collectives`
(moe.md §3.1–3.2, §13.2; the counterpart of the attention layers' scope, swa.md §9.2).

Runs the layer's own `dispatch` stage (count exchange, then the int8 all-to-all-v of every
route's codes, token scale, routing weight and route id) and its `combine` stage (the bf16
all-to-all-v back with the splits swapped), joined by an exact stand-in for the routed
experts, on closed-form integer data. Every output is a fixed-size window pre-filled with the
sentinel −7 and compared bitwise, so a row that lands in the wrong place, a padding row that is
written, or an inactive token's poisoned row that is sent all FAIL. A stage-based
implementation replaces `dispatch` or `combine` by name (`layers.tp.TorchTP.run_stage`), as in
the full layer.

Inputs of rank r (T tokens, n = num_tokens active, K slots, L local experts, E = L·P):

| tensor       | shape  | dtype | value (token t, column c, slot k)                                    |
|--------------|--------|-------|----------------------------------------------------------------------|
| indices      | [T, K] | int32 | K distinct experts of 0..E−2 per token, a keyed draw per rank: uneven splits, expert E−1 never chosen (an empty lane); inactive tokens have routes too, which must not be sent |
| x_norm_i8    | [T, D] | int8  | (r·T + t + c) mod 101; inactive tokens −100                           |
| x_norm_scale | [T, 1] | fp32  | r·T + t + 1; inactive −1000                                           |
| weights      | [T, K] | fp32  | (r·T + t)·K + k + 1; inactive −2000                                   |
| num_tokens   | []     | int32 | n                                                                     |

Outputs (in-out windows, RECV_MAX = P·T, the device's receive windows of moe.md §2):

| tensor       | shape             | dtype | holds                                                          |
|--------------|-------------------|-------|----------------------------------------------------------------|
| recv_meta    | [P, L]            | int32 | row s: rank s's routes to each of my experts                    |
| recv_x       | [L·RECV_MAX, D]   | int8  | expert e's j-th received row at e·RECV_MAX + j (source, then route) |
| recv_aux     | [L·RECV_MAX, 2]   | fp32  | its token scale and routing weight                              |
| recv_route   | [L·RECV_MAX]      | int32 | its route id t·K + k                                            |
| routed_y_buf | [T·K, D]          | bf16  | row t·K + k (t < n): what the stand-in made of my route          |

The stand-in for the routed experts returns each received row's codes as bf16 (exact: |code|
≤ 127) with columns 0–2 replaced by the row's token t, slot k and global expert id (all < 256,
exact in bf16): a row that comes back identifies the route and the expert it went through.
"""

from __future__ import annotations

import torch

from . import layer as moe
from ..components.moe_routing import replay_dispatch
from ..contract.case import MoECase
from ..contract.checks import Check, ExactCheck
from ..contract.context import RankContext
from ..contract.stage import Stage, Values
from ..contract.tensors import Kind, TensorSpec
from ..fixtures import draw
from ..contract.staged import RunStage, StagedLayer, default_run_stage, exact, judged, run_stages

SENTINEL = -7
CODE_POISON, SCALE_POISON, WEIGHT_POISON = -100, -1000.0, -2000.0  # an inactive token's payload
WINDOWS = ("recv_meta", "recv_x", "recv_aux", "recv_route", "routed_y_buf")


def source_inputs(case: MoECase, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s integer inputs (the table above): any rank rebuilds any source's."""
    t, k, d, n = case.tokens, case.model.num_experts_per_tok, case.model.hidden_size, case.active
    u = draw.uniform((t, case.routed_experts - 1), 0.0, 1.0, case.seed, "moe-collectives", "indices", rank)
    token = rank * t + torch.arange(t)
    codes = ((token[:, None] + torch.arange(d)) % 101).to(torch.int8)
    codes[n:] = CODE_POISON
    scale = (token + 1).float()[:, None]
    scale[n:] = SCALE_POISON
    weights = (token[:, None] * k + torch.arange(k) + 1).float()
    weights[n:] = WEIGHT_POISON
    return {"indices": torch.topk(u, k, dim=1, largest=False).indices.to(torch.int32), "x_norm_i8": codes,
            "x_norm_scale": scale, "weights": weights, "num_tokens": torch.tensor(n, dtype=torch.int32)}


def stand_in_experts(ctx: RankContext, v: Values) -> dict[str, torch.Tensor]:
    """recv_y [R, D] bf16 from the received rows (module docstring)."""
    k, local = ctx.model.num_experts_per_tok, ctx.case.local_experts
    rows = v["recv_x"].shape[0]
    expert = torch.repeat_interleave(torch.arange(local), v["recv_meta"].sum(dim=0).long()) + ctx.rank * local
    eid = torch.full((rows,), -1)  # rows beyond the counts (a broken dispatch) name no expert
    eid[: min(rows, expert.numel())] = expert[:rows]
    rho = v["recv_route"].long()
    recv_y = v["recv_x"].to(torch.bfloat16)
    recv_y[:, 0], recv_y[:, 1], recv_y[:, 2] = rho // k, rho % k, eid
    return {"recv_y": recv_y}


def _into_windows(counts: torch.Tensor, rows: torch.Tensor, window: torch.Tensor, recv_max: int) -> None:
    """Expert e's rows (`counts[e]` of them, consecutive in `rows`) to window rows e·RECV_MAX + j."""
    start = 0
    for e, c in enumerate(counts.tolist()):
        part = rows[start : start + c][:recv_max]  # a broken count cannot write past its window
        window[e * recv_max : e * recv_max + part.shape[0]] = part
        start += c


class MoECollectivesScope(StagedLayer):
    """`layer=moe scope=collectives`: dispatch and combine alone, bitwise (module docstring)."""

    name = "moe"
    scope = "collectives"
    sharded_o_weights = False

    def stages(self, model) -> tuple[Stage, ...]:
        layer = {s.name: s for s in moe.LAYER.stages(model)}
        stand_in = Stage("stand_in_experts", ("recv_x", "recv_meta", "recv_route"), (judged(exact("recv_y")),),
                         stand_in_experts)
        return layer["dispatch"], stand_in, layer["combine"]

    def validate(self, case: MoECase) -> None:
        """Every case that passes `MoECase.validate` runs."""

    def tensor_specs(self, case: MoECase) -> dict[str, TensorSpec]:
        m, t, l, p = case.model, case.tokens, case.local_experts, case.ep
        k, d, rows = m.num_experts_per_tok, m.hidden_size, case.local_experts * case.recv_max
        i, io = Kind.INPUT, Kind.INOUT
        return {
            "indices": TensorSpec((t, k), torch.int32, i),
            "x_norm_i8": TensorSpec((t, d), torch.int8, i),
            "x_norm_scale": TensorSpec((t, 1), torch.float32, i),
            "weights": TensorSpec((t, k), torch.float32, i),
            "num_tokens": TensorSpec((), torch.int32, i),
            "recv_meta": TensorSpec((p, l), torch.int32, io),
            "recv_x": TensorSpec((rows, d), torch.int8, io),
            "recv_aux": TensorSpec((rows, 2), torch.float32, io),
            "recv_route": TensorSpec((rows,), torch.int32, io),
            "routed_y_buf": TensorSpec((t * k, d), torch.bfloat16, io),
        }

    def rank_inputs(self, case: MoECase, rank: int) -> dict[str, torch.Tensor]:
        specs = self.tensor_specs(case)
        windows = {n: torch.full(specs[n].shape, SENTINEL, dtype=specs[n].dtype) for n in WINDOWS}
        return {**source_inputs(case, rank), **windows}

    def full_o_weights(self, case):
        raise TypeError("layer=moe scope=collectives has no O weights")

    def golden(self, case: MoECase, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The windows of the rank whose inputs these are, from every source's rebuilt inputs
        (§4.4's replay; the collectives under test never run)."""
        p, k, n = case.ep, case.model.num_experts_per_tok, case.active
        every = [source_inputs(case, s) for s in range(p)]
        rank = next((s for s in range(p) if all(torch.equal(tensors[name], x) for name, x in every[s].items())), None)
        if rank is None:
            raise ValueError("the MoE collectives golden needs its own closed-form inputs; these differ from them")
        indices = torch.stack([e["indices"] for e in every])
        recv_meta, src, rho = replay_dispatch(rank, indices, n, case.local_experts)
        tok, counts = rho // k, recv_meta.sum(dim=0)
        codes = torch.stack([e["x_norm_i8"] for e in every])[src, tok]
        aux = torch.stack((torch.stack([e["x_norm_scale"] for e in every])[src, tok, 0],
                           torch.stack([e["weights"] for e in every])[src, tok, rho % k]), dim=1)
        tensors["recv_meta"].copy_(recv_meta)
        for name, rows in (("recv_x", codes), ("recv_aux", aux), ("recv_route", rho.to(torch.int32))):
            _into_windows(counts, rows, tensors[name], case.recv_max)
        # my own active routes come back as the stand-in made them at their expert
        t = torch.arange(n)
        own = every[rank]
        back = own["x_norm_i8"][:n, None, :].expand(n, k, -1).to(torch.bfloat16).clone()  # [n, K, D]
        back[:, :, 0], back[:, :, 1], back[:, :, 2] = t[:, None], torch.arange(k), own["indices"][:n]
        tensors["routed_y_buf"][: n * k] = back.reshape(n * k, case.model.hidden_size)
        return {name: tensors[name] for name in WINDOWS}

    def forward(self, ctx: RankContext, tensors: dict[str, torch.Tensor],
                run_stage: RunStage = default_run_stage) -> dict[str, torch.Tensor]:
        """The stages, then their compact rows into the windows (the stage outputs of the same
        names shadow the windows while the stages run); routed_y_buf keeps the sentinel on
        every row this rank sent no route for."""
        windows = {name: tensors[name] for name in WINDOWS}
        values = run_stages(self.stages(ctx.model), ctx, tensors, run_stage)
        windows["recv_meta"].copy_(values["recv_meta"])
        counts = values["recv_meta"].sum(dim=0)
        for name in ("recv_x", "recv_aux", "recv_route"):
            _into_windows(counts, values[name], windows[name], ctx.case.recv_max)
        sent = values["send_route"].long()
        windows["routed_y_buf"][sent] = values["routed_y_buf"][sent]
        return windows

    def checks(self, case: MoECase) -> tuple[Check, ...]:
        # the inactive tokens' payload that must never arrive, per window (in each one's dtype)
        poison = {"recv_x": (CODE_POISON,), "recv_aux": (SCALE_POISON, WEIGHT_POISON), "routed_y_buf": (CODE_POISON,)}
        return tuple(ExactCheck(name, sentinel=SENTINEL, poison=poison.get(name, ())) for name in WINDOWS)


__all__ = ["MoECollectivesScope", "source_inputs", "stand_in_experts", "SENTINEL"]
