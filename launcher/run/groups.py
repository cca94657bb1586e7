"""Several TP groups in one launch (dp x tp): which ranks form a group, and their process groups.

The world is `dp * tp` ranks; TP group g is the contiguous ranks `g*tp ... g*tp + tp - 1`, so a
group stays inside a node whenever a node holds a multiple of tp ranks. Each group runs its own
case (its own fixture and golden, `Case.of_group`) on its own process group; the harness's own
collectives (the sends to each check's judge, the verdicts to rank 0, the verdict's broadcast)
stay on the world group.

| name        | meaning                                      |
|-------------|----------------------------------------------|
| rank        | this process's global rank, 0 .. dp·tp − 1   |
| group       | its TP group's index g = rank // tp          |
| group_rank  | its rank inside the group, rank % tp         |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupLayout:
    dp: int
    tp: int
    rank: int  # global

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def group(self) -> int:
        return self.rank // self.tp

    @property
    def group_rank(self) -> int:
        return self.rank % self.tp

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.tp, (group + 1) * self.tp))

    def leads_group_on(self, node_ranks: range) -> bool:
        """Whether this rank is its group's first among `node_ranks` (the global ranks of a node)."""
        here = [r for r in self.ranks_of(self.group) if r in node_ranks]
        return bool(here) and self.rank == here[0]


def tp_process_group(layout: GroupLayout):
    """This rank's TP group. Every rank creates every group, in the same order (a collective
    requirement of `new_group`); a single group is the world group itself."""
    import torch.distributed as dist

    if layout.dp == 1:
        return dist.group.WORLD
    mine = None
    for g in range(layout.dp):
        pg = dist.new_group(layout.ranks_of(g))
        if g == layout.group:
            mine = pg
    return mine


def by_group(stacked: dict[str, torch.Tensor], layout: GroupLayout) -> list[dict[str, torch.Tensor]]:
    """World-stacked tensors `[dp·tp, ...]` as one `[tp, ...]` dict per group (views)."""
    return [{n: t[g * layout.tp : (g + 1) * layout.tp] for n, t in stacked.items()} for g in range(layout.dp)]


__all__ = ["GroupLayout", "tp_process_group", "by_group"]
