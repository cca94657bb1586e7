"""The attention TP groups of a block launch: ep / tp groups of tp contiguous world ranks.

`new_group` is collective over the world: every rank creates every group, in the same order,
and destroys them after the attention half (a warm rank's world outlives the step).
"""

from __future__ import annotations

from contextlib import contextmanager

from ..contract.context import RankContext


@contextmanager
def attention_group(ctx: RankContext):
    """This rank's TP group for the attention half: None at tp = 1 (its collectives are
    identities), the world's group when one TP group spans it, else a group of its own."""
    case = ctx.case
    if case.tp == 1:
        yield None
        return
    if case.tp == case.ep:
        yield ctx.group
        return
    import torch.distributed as dist

    groups = [dist.new_group(list(range(g * case.tp, (g + 1) * case.tp))) for g in range(case.tp_groups)]
    try:
        yield groups[case.tp_group_of(ctx.rank)]
    finally:
        for group in groups:
            if group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)


__all__ = ["attention_group"]
