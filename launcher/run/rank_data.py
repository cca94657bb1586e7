"""A rank's data: its inputs and its golden, read from the golden cache when a whole entry is
there, else drawn or computed and stored (`launcher.store.golden_cache`).

Everything here runs on one rank, before the implementation: the inputs it returns are what
the implementation and the golden both start from, so an entry read back must be bit for bit
what a fresh draw gives (the cache checks every tensor's sha256), and the golden is computed
from clones of the in-out tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from layers.attention.layer import AttentionLayer
from layers.contract.context import RankContext
from layers.contract.tensors import Kind, tensor_sha256
from layers.distributed import wire
from layers.fixtures.draw import GroupExchange
from layers.fixtures.kept import kept_sha256

from launcher.config.spec import RunSpec
from launcher.store import golden_cache, snapshot

log = logging.getLogger(__name__)


@dataclass
class RankInputs:
    """A rank's inputs and in-outs before the step, with what came along."""

    tensors: dict[str, torch.Tensor]
    sha256: dict[str, str]  # of the tensors named by `rank_inputs`'s `digested`
    wo_full: tuple[torch.Tensor, torch.Tensor] | None  # the full O weights, when drawn with the shard
    cache: str | None  # "hit", None (drawn, stored or no cache), or why the entry was not written


def rank_inputs(spec: RunSpec, layer, case, rank: int, digested: list[str], stores_group: bool,
                ctx: RankContext | None = None) -> RankInputs:
    """Group rank `rank`'s inputs of `case`, with the sha256 of those named by `digested`: from
    the golden cache when its entries are whole (the rank's own, and the group's of what every
    rank holds alike, `Layer.replicated_inputs`), else drawn (with the full O weights when this
    rank computes its golden from them, `golden_is_computed`) and stored: the rank's own entry
    by every rank, the group's by the rank `stores_group` names (one per group and node).
    Without a cache, drawn; there every rank of the group draws alike, so with `ctx` (the rank's
    context) an attention group draws its replicated and O weights a share per rank and
    exchanges them."""
    full_o = golden_is_computed(spec, layer, case, rank)

    def drawn():
        if full_o and spec.golden_cache is None and _drawn_by_the_group(layer, ctx):
            return layer.rank_inputs_and_full_o_by_the_group(case, _group_exchange(ctx))
        return layer.rank_inputs_and_full_o(case, rank) if full_o else (layer.rank_inputs(case, rank), None)

    if spec.golden_cache is None:
        tensors, wo_full = drawn()
        return RankInputs(tensors, {n: _drawn_sha256(tensors[n]) for n in digested}, wo_full, None)
    specs = {n: s for n, s in layer.tensor_specs(case).items() if s.kind is not Kind.OUTPUT}
    parts = {  # entry -> its identity and the names it holds
        "own": (golden_cache.inputs_identity(case, rank, spec.threads()),
                [n for n in specs if n not in layer.replicated_inputs]),
        "group": (golden_cache.inputs_identity(case, None, spec.threads()),
                  [n for n in specs if n in layer.replicated_inputs]),
    }
    read = {part: golden_cache.load_entry(spec.golden_cache, ident, {n: specs[n] for n in names})
            for part, (ident, names) in parts.items() if names}
    if all(entry is not None for entry in read.values()):
        # The golden's full O weights, if it needs them, are drawn alone (`cached_golden`).
        tensors = {n: e.tensors[n] for e in read.values() for n in e.tensors}
        digests = {n: d for e in read.values() for n, d in e.sha256.items()}
        return RankInputs({n: tensors[n] for n in specs}, {n: digests[n] for n in digested}, None, "hit")
    tensors, wo_full = drawn()
    to_store = [(ident, names) for part, (ident, names) in parts.items()
                if part in read and read[part] is None and (part == "own" or stores_group)]
    digests = {n: _drawn_sha256(tensors[n]) for n in set(digested).union(*(names for _, names in to_store))}
    problems = [golden_cache.store(spec.golden_cache, ident, {n: tensors[n] for n in names},
                                   spec.golden_cache_max_bytes, sha256={n: digests[n] for n in names})
                for ident, names in to_store]
    problem = next((p for p in problems if p), None)
    if problem:
        log.info("golden cache %s: inputs not written: %s", spec.golden_cache, problem)
    status = f"not written: {problem}" if problem else None
    return RankInputs(tensors, {n: digests[n] for n in digested}, wo_full, status)


def _drawn_by_the_group(layer, ctx: RankContext | None) -> bool:
    """Whether the group can share the weights' draw: a group of ranks that all draw them
    (without a cache every rank does), of a layer that draws them from its `o_recipe`, on the
    CPU, where the fixture's tensors are (gloo)."""
    return (ctx is not None and ctx.case.group_size > 1 and ctx.device.type == "cpu"
            and isinstance(layer, AttentionLayer))


def _group_exchange(ctx: RankContext) -> GroupExchange:
    """The rank's group's exchange of drawn tensors over the harness's own collectives."""
    world = ctx.case.group_size
    return GroupExchange(ctx.rank, world, lambda t: wire.all_gather(t, ctx.group, world),
                         lambda t, shape, dtype, src: wire.broadcast(t, shape, dtype, ctx.rank, world, ctx.group, src))


def _drawn_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor the fixture just drew: the replicated weights kept for the next job
    were hashed as they were drawn (`layers.fixtures.kept`), and are not hashed again."""
    return kept_sha256(t) or tensor_sha256(t)


def _with_inouts_cloned(layer, case, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's inputs with its in-out tensors cloned: the golden updates those in place and
    must leave the implementation's copies as they were (it runs first, so the pure inputs are
    pristine)."""
    inout = set(layer.names_of(case, Kind.INOUT))
    return {n: t.clone() if n in inout else t for n, t in inputs.items()}


def golden_outputs(layer, ctx: RankContext, inputs: dict[str, torch.Tensor], wo_full) -> dict[str, torch.Tensor]:
    """This rank's golden (`Layer.rank_golden`, on the CPU) of the rank's inputs
    (`_with_inouts_cloned`), with the full O weights where the layer projects with them."""
    case = ctx.case
    tensors = _with_inouts_cloned(layer, case, inputs)
    if layer.sharded_o_weights:
        tensors["wo_a"], tensors["wo_b"] = wo_full
    out = layer.rank_golden(dataclasses.replace(ctx, device=torch.device("cpu")), tensors)
    return {n: out[n] for n in layer.compared_names(case)}


def golden_is_computed(spec: RunSpec, layer, case, rank: int) -> bool:
    """Whether this rank computes a golden with full O weights from its own fixture (so the
    fixture builds them with the shard) rather than replaying or reading the cache."""
    if spec.golden_data or not spec.golden or not layer.sharded_o_weights:
        return False
    if spec.golden_cache is None:
        return True
    return not golden_cache.exists(spec.golden_cache, golden_cache.identity(case, rank, spec.threads()))


def _stored_golden(spec: RunSpec, ident: dict, outputs: dict[str, torch.Tensor]) -> str | None:
    """Store a computed golden; None, or why the cache could not be written (the run goes on).
    The rank's log says which entry; the report warns once per cause (`rank_inputs` words its
    status the same)."""
    problem = golden_cache.store(spec.golden_cache, ident, outputs, spec.golden_cache_max_bytes)
    if problem:
        log.info("golden cache %s: golden not written: %s", spec.golden_cache, problem)
    return f"not written: {problem}" if problem else None


def cached_golden(spec: RunSpec, layer, ctx: RankContext, inputs, wo_full=None) -> tuple[dict[str, torch.Tensor], str | None]:
    """`(golden, cache status)` of this rank: from the on-disk cache when a whole entry of its
    identity is there (status "hit"; for a golden that reads every rank's data, only when every
    rank of the group holds one, since a rank that misses needs all of them to compute it), else
    computed and stored (None, or why the cache could not be written: the run goes on with the
    computed golden). `wo_full`: the full O weights when the fixture built them already."""
    case, rank = ctx.case, ctx.rank

    def computed():
        return golden_outputs(layer, ctx, inputs, full_o_weights())

    def full_o_weights():
        if not layer.sharded_o_weights:
            return None
        if spec.golden_data is not None:  # replay: the full O weights are the snapshot's shards
            return snapshot.full_o_weights(spec.golden_data)
        return wo_full if wo_full is not None else layer.full_o_weights(case)

    if spec.golden_data is not None or spec.golden_cache is None:
        return computed(), None
    specs = layer.tensor_specs(case)
    ident = golden_cache.identity(case, rank, spec.threads())
    hit = golden_cache.load(spec.golden_cache, ident, {n: specs[n] for n in layer.compared_names(case)})
    if layer.golden_reads_every_rank and case.group_size > 1:
        every_hit = torch.tensor([int(hit is not None)], device=ctx.device)
        dist.all_reduce(every_hit, op=dist.ReduceOp.MIN, group=ctx.group)
        hit = hit if every_hit.item() else None
    if hit is not None:
        return hit, "hit"
    outputs = computed()
    return outputs, _stored_golden(spec, ident, outputs)
