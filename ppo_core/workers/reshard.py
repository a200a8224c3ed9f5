"""``plan_reshard``: which rows move from which producer rank to which consumer rank when a resident batch changes
data-parallel layout (a pure function: the controller computes plans, workers execute them).

A producer placement holds global rows ``[lo_d, hi_d)`` on every rank of dp rank ``d``; the consumer layout wants
them cut as :func:`~ppo_core.workers.resident.dp_row_ranges` cuts them for its own dp size, and every rank of a
consumer dp rank (its TP/PP replicas) needs the whole range. A :class:`Transfer` moves ``rows`` consecutive rows
from offset ``src_start`` of a producer rank's shard to offset ``dst_start`` of a consumer rank's shard. Plans
deliver every row of every consumer rank exactly once, in dp order (transfers sorted by consumer rank, then
offset), for any producer and consumer sizes, non-divisible and empty batches included. The replicas of a
producer dp rank share the sending: consumer replica ``i`` reads from producer replica ``i mod n``; inside one
set of processes a consumer rank that already holds rows copies them locally (``src_rank == dst_rank``).

Example:
    >>> from ppo_core.workers.dispatch import DPLayout
    >>> from ppo_core.workers.resident import Placement, dp_row_ranges
    >>> src = Placement(group="g", layout=DPLayout.trivial(4), row_ranges=dp_row_ranges(8, 4))
    >>> plan = plan_reshard(src, DPLayout.trivial(2))
    >>> [(t.src_rank, t.dst_rank, t.src_start, t.dst_start, t.rows) for t in plan.transfers]
    [(0, 0, 0, 0, 2), (1, 0, 0, 2, 2), (2, 1, 0, 0, 2), (3, 1, 0, 2, 2)]
"""

from __future__ import annotations

import dataclasses

from ppo_core.workers.dispatch import DPLayout
from ppo_core.workers.resident import Placement, dp_row_ranges

__all__ = ["ReshardPlan", "Transfer", "plan_reshard"]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """``rows`` rows from ``src_rank``'s shard at ``src_start`` to ``dst_rank``'s shard at ``dst_start``."""

    src_rank: int
    dst_rank: int
    src_start: int
    dst_start: int
    rows: int


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """Every transfer of one reshard, and the placements before and after (ranks are each group's global ranks)."""

    source: Placement
    target: Placement
    transfers: tuple[Transfer, ...]

    @property
    def same_group(self) -> bool:
        """Whether producer and consumer are the same processes (rank ``r`` on both sides is one process)."""
        return self.source.group == self.target.group

    def sends_of(self, rank: int) -> tuple[Transfer, ...]:
        """Transfers producer rank ``rank`` sends."""
        return tuple(t for t in self.transfers if t.src_rank == rank)

    def receives_of(self, rank: int) -> tuple[Transfer, ...]:
        """Transfers consumer rank ``rank`` receives, in its row order."""
        return tuple(t for t in self.transfers if t.dst_rank == rank)

    def dst_rows(self, rank: int) -> int:
        """Rows consumer rank ``rank`` holds afterwards."""
        lo, hi = self.target.rows_of_rank(rank)
        return hi - lo


def plan_reshard(placement: Placement, layout: DPLayout, *, group: str | None = None) -> ReshardPlan:
    """The transfers that lay a resident batch held as ``placement`` out for ``layout`` (see the module docstring).

    Args:
        placement: where the rows are now.
        layout: the consumer group's data-parallel layout.
        group: the consumer group's id (default: the producer's, a reshard inside one set of processes).
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
    if not isinstance(layout, DPLayout):
        raise TypeError(f"layout must be a DPLayout, got {type(layout).__name__}")
    same = group is None or group == placement.group
    target = Placement(
        group=placement.group if group is None else group,
        layout=layout,
        row_ranges=dp_row_ranges(placement.rows, layout.dp_size),
    )
    transfers = []
    for r in range(layout.world_size):
        d = layout.dp_ranks[r]
        lo, hi = target.row_ranges[d]
        replica = layout.ranks_of(d).index(r)
        for s, (slo, shi) in enumerate(placement.row_ranges):
            a, b = max(lo, slo), min(hi, shi)
            if a >= b:
                continue
            senders = placement.layout.ranks_of(s)
            # inside one set of processes a consumer rank that holds the rows itself copies them locally
            src = r if same and r in senders else senders[replica % len(senders)]
            transfers.append(
                Transfer(
                    src_rank=src,
                    dst_rank=r,
                    src_start=a - slo,
                    dst_start=a - lo,
                    rows=b - a,
                )
            )
    return ReshardPlan(source=placement, target=target, transfers=tuple(transfers))
