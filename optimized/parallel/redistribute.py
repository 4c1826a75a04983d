"""Plan A redistribution of a row-sharded activation between two layouts (model-agnostic).

A `RowLayout` says which canonical row ids each rank holds, in local order. A `Transition` (src -> dst) is
derived from the global count matrix C[r, d] = rows rank d needs from rank r, so every rank computes the same
matrix and takes the same branch: a local permutation when nothing crosses ranks, otherwise one variable-split
all_to_all with each peer segment packed in destination-local order and a single argsort on the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized.parallel.group import SPGroup


@dataclass(frozen=True)
class RowLayout:
    name: str
    rank_rows: tuple[torch.Tensor, ...]       # per rank: canonical row ids (int64) in local order
    num_rows: int

    @property
    def world_size(self) -> int:
        return len(self.rank_rows)

    def owner_and_position(self) -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.full((self.num_rows,), -1, dtype=torch.int64)
        pos = torch.full((self.num_rows,), -1, dtype=torch.int64)
        for r, rows in enumerate(self.rank_rows):
            owner[rows] = r
            pos[rows] = torch.arange(rows.numel())
        if bool((owner < 0).any()):
            raise ValueError(f"layout {self.name}: rows {torch.nonzero(owner < 0)[:5].flatten().tolist()} "
                             f"are owned by no rank")
        return owner, pos


@dataclass(frozen=True)
class Transition:
    src: str
    dst: str
    counts: torch.Tensor                      # (ws, ws) C[r, d]
    network_exchange_required: bool
    send_index: torch.Tensor                  # this rank: src-local rows to send, grouped by dst, dst-local order
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_order: torch.Tensor                  # argsort of the received rows' destination positions

    def moved_rows(self) -> int:
        return int(self.counts.sum() - self.counts.diagonal().sum())


def build_transition(src: RowLayout, dst: RowLayout, rank: int) -> Transition:
    if src.world_size != dst.world_size or src.num_rows != dst.num_rows:
        raise ValueError(f"layouts {src.name} and {dst.name} do not describe the same rows / world size")
    ws = src.world_size
    owner_src, pos_src = src.owner_and_position()
    owner_dst, _ = dst.owner_and_position()
    counts = torch.bincount(owner_src * ws + owner_dst, minlength=ws * ws).view(ws, ws)
    network = bool((counts.sum() - counts.diagonal().sum()) > 0)
    dst_order = torch.cat(list(dst.rank_rows))               # all rows grouped by dst rank, dst-local order
    mine = dst_order[owner_src[dst_order] == rank]
    send_index = pos_src[mine]
    rows_here = dst.rank_rows[rank]
    recv_dst_pos = torch.argsort(owner_src[rows_here], stable=True)  # segments by source, each in dst order
    return Transition(src.name, dst.name, counts, network, send_index,
                      tuple(int(c) for c in counts[rank]), tuple(int(c) for c in counts[:, rank]),
                      torch.argsort(recv_dst_pos))


def apply_transition(x: torch.Tensor, tr: Transition, group: SPGroup) -> torch.Tensor:
    """x: this rank's rows in the src layout -> this rank's rows in the dst layout."""
    send_index = tr.send_index.to(x.device)
    if not tr.network_exchange_required:      # local permutation fast path (always the case at world size 1)
        return x.index_select(0, send_index)
    recv = group.all_to_all(x.index_select(0, send_index), list(tr.send_counts), list(tr.recv_counts))
    return recv.index_select(0, tr.recv_order.to(x.device))
