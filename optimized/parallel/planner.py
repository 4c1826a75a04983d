"""Deterministic LPT (longest processing time first) assignment of weighted items (e.g. attention windows) to ranks.

items sorted by (-weight, item id); each placed on the rank with the smallest (assigned weight, rank id);
each rank then lists its items in ascending original order. Same inputs -> same plan on every rank.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

PLANNER_VERSION = "lpt.v1"


@dataclass(frozen=True)
class Assignment:
    world_size: int
    rank_items: tuple[tuple[int, ...], ...]   # per rank, item ids ascending
    rank_load: tuple[int, ...]                # per rank, summed weight

    def items_of(self, rank: int) -> tuple[int, ...]:
        return self.rank_items[rank]

    @property
    def imbalance(self) -> float:
        """max / mean load (1.0 = perfect)."""
        mean = sum(self.rank_load) / self.world_size
        return max(self.rank_load) / mean if mean else 1.0


def lpt_assign(weights: list[int], world_size: int) -> Assignment:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    heap = [(0, r) for r in range(world_size)]  # (assigned weight, rank): ties go to the lower rank
    owned: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in order:
        w, r = heapq.heappop(heap)
        owned[r].append(i)
        load[r] = w + weights[i]
        heapq.heappush(heap, (load[r], r))
    return Assignment(world_size, tuple(tuple(sorted(o)) for o in owned), tuple(load))
