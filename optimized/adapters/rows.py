"""Unmerged LoRA at run time, per row of a batched forward: rows may carry different adapters, several, or none.

For a linear layer `where` (a name in the optimized model's own fused layout, e.g. `blocks.0.attn1.qkv`) and the
input x [B, ..., in] of the whole batch, every adapter used in the batch adds, to the rows that use it,

    delta = (x[rows] A^T) B^T * scale[rows]

where A [r_total, in] / B [out, r_total] are the adapter's prepared pair for that layer: the factor alpha / r folded
into B, and for a fused layer (q | k | v) the sub-projections' A stacked and their B placed block-diagonally, so
one pair of GEMMs serves the fused output. A row without adapters gets no delta; the base GEMM is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PreparedLora:
    """One adapter on one model component, laid out for that component's fused layers (run dtype, device)."""
    name: str
    version: str
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]   # fused layer -> (A [r, in], B' = B * alpha / r [out, r])


@dataclass(frozen=True)
class RowGroup:
    adapter: PreparedLora
    rows: torch.Tensor                                    # int64 row indices into the batch
    scales: torch.Tensor                                  # [len(rows)] the rows' adapter weights


class RowLora:
    """The adapters of one batched forward, grouped by adapter (built by `row_lora`)."""

    def __init__(self, groups: list[RowGroup], batch: int):
        self.groups = groups
        self.batch = batch

    def add_to(self, y: torch.Tensor, x: torch.Tensor, where: str) -> torch.Tensor:
        """y = the base layer's output for x (both [B, ..., *]); y plus every row's adapter delta for `where`."""
        for g in self.groups:
            pair = g.adapter.pairs.get(where)
            if pair is None:
                continue
            a, b = pair
            xs = x.index_select(0, g.rows)
            d = F.linear(F.linear(xs, a), b)
            d = d * g.scales.to(d.dtype).view(-1, *([1] * (d.ndim - 1)))
            y = y.index_add(0, g.rows, d.to(y.dtype))
        return y

    def versions(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((g.adapter.name, g.adapter.version) for g in self.groups))


def row_lora(per_row: list[list[tuple[PreparedLora, float]]], device: torch.device) -> RowLora | None:
    """Per row, its (prepared adapter, scale) pairs -> a RowLora; None when no row uses an adapter."""
    by_version: dict[str, tuple[PreparedLora, list[int], list[float]]] = {}
    for i, uses in enumerate(per_row):
        for adapter, scale in uses:
            entry = by_version.setdefault(adapter.version, (adapter, [], []))
            entry[1].append(i)
            entry[2].append(float(scale))
    if not by_version:
        return None
    groups = [RowGroup(a, torch.tensor(rows, dtype=torch.long, device=device),
                       torch.tensor(scales, dtype=torch.float32, device=device))
              for a, rows, scales in by_version.values()]
    return RowLora(groups, len(per_row))
