"""Tensor parallel linear layers (Megatron column / row split) over the tp axis, loaded as slices of the canonical
weights (a rank never needs the other ranks' slices: `column_shard` / `row_shard` take views, and a checkpoint
reader can read just those rows / columns).

    h = column_parallel(x, column_shard(w1, tp), column_shard(b1, tp))     # [.., out / n], no communication
    y = row_parallel(act(h), row_shard(w2, tp), b2, tp)                     # [.., out], one SUM all-reduce

Attention splits by heads the same way: q / k / v projections column-parallel (heads / n per rank), the output
projection row-parallel. Fault for negative controls: `wrong_slice` loads rank (r + 1) % n's slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optimized.parallel.group import AxisGroup


def _slice(t: torch.Tensor, dim: int, group: AxisGroup, wrong_slice: bool = False) -> torch.Tensor:
    n = group.world_size
    if t.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split over tp = {n}")
    r = (group.rank + 1) % n if wrong_slice else group.rank
    return t.narrow(dim, r * (t.shape[dim] // n), t.shape[dim] // n)


def column_shard(w: torch.Tensor, group: AxisGroup, wrong_slice: bool = False) -> torch.Tensor:
    """This rank's output rows of a [out, in] weight (or of a [out] bias)."""
    return _slice(w, 0, group, wrong_slice)


def row_shard(w: torch.Tensor, group: AxisGroup, wrong_slice: bool = False) -> torch.Tensor:
    """This rank's input columns of a [out, in] weight."""
    return _slice(w, 1, group, wrong_slice)


def column_parallel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def row_parallel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: AxisGroup) -> torch.Tensor:
    """Partial products summed over the axis; the bias added once, after the sum."""
    y = group.all_reduce_sum(F.linear(x, w))
    return y if b is None else y + b
