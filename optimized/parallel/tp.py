"""Tensor parallel linear layers (Megatron column / row split) over the tp axis, loaded as slices of the canonical
weights (a rank never needs the other ranks' slices: `column_shard` / `row_shard` take views, and
`read_slice` reads just those rows / columns of a tensor stored in a safetensors file).

    h = column_parallel(x, column_shard(w1, tp), column_shard(b1, tp))     # [.., out / n], no communication
    y = row_parallel(act(h), row_shard(w2, tp), b2, tp)                     # [.., out], one SUM all-reduce

Attention splits by heads the same way: q / k / v projections column-parallel (heads / n per rank), the output
projection row-parallel; an RMS norm over all heads' channels (wan's `rms_norm_across_heads`) reduces its sum of
squares over the axis (`sharded_rms_norm`). Declared seams for negative controls (parity/parallel_faults.py patches
them): `column_shard` / `row_shard` (which slice a rank keeps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from optimized.parallel.group import AxisGroup


def shard_bounds(size: int, group: AxisGroup, what: str = "dim") -> tuple[int, int]:
    """(start, length) of this rank's equal part of `size` rows / columns."""
    n = group.world_size
    if size % n:
        raise ValueError(f"{what} of size {size} does not split over tp = {n}")
    return group.rank * (size // n), size // n


def column_shard(w: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """This rank's output rows of a [out, in] weight (or of a [out] bias)."""
    start, length = shard_bounds(w.shape[0], group)
    return w.narrow(0, start, length)


def row_shard(w: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """This rank's input columns of a [out, in] weight."""
    start, length = shard_bounds(w.shape[1], group)
    return w.narrow(1, start, length)


def column_parallel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def row_parallel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: AxisGroup) -> torch.Tensor:
    """Partial products summed over the axis; the bias added once, after the sum."""
    y = group.all_reduce_sum(F.linear(x, w))
    return y if b is None else y + b


def sharded_rms_norm(x: torch.Tensor, weight: torch.Tensor, full_dim: int, eps: float,
                     group: AxisGroup) -> torch.Tensor:
    """F.rms_norm over a last dim that is column-sharded across the axis: x [..., full_dim / n] and its weight slice;
    the fp32 sum of squares is all-reduced (torch's rms_norm arithmetic: fp32 throughout, cast back at the end)."""
    xf = x.float()
    ss = group.all_reduce_sum(xf.pow(2).sum(-1, keepdim=True))
    return (xf * torch.rsqrt(ss / full_dim + eps) * weight.float()).to(x.dtype)


# ---- reading a slice of a stored tensor ---------------------------------------------------------------------------

_NP_VIEWS = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
             torch.bfloat16: np.int16}   # numpy has no bf16: the bytes go through int16 and back


def read_slice(file: str | Path, offset: int, dtype: torch.dtype, shape: tuple[int, ...], dim: int, start: int,
               length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of the C-order tensor stored at byte `offset` of
    `file`, read through a memory map: only the slice's pages are touched and only the slice is copied."""
    if dtype not in _NP_VIEWS:
        raise ValueError(f"read_slice: unsupported dtype {dtype}")
    mm = np.memmap(file, dtype=_NP_VIEWS[dtype], mode="r", offset=offset, shape=tuple(shape))
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, start + length)
    part = torch.from_numpy(np.array(mm[tuple(index)], copy=True))   # a copy: nothing keeps the map open
    del mm
    return part.view(dtype) if dtype == torch.bfloat16 else part


def read_sharded_state(comp: Any, shapes: dict[str, tuple[int, ...]],
                       slice_of: Callable[[str, tuple[int, ...]], tuple[int, int, int] | None],
                       what: str) -> dict[str, torch.Tensor]:
    """This rank's slice of every canonical key of a checkpoint component, read from its safetensors files by memory
    map (a column shard is a contiguous byte range, a row shard 1 / n of every row): the full weights of a sharded
    key are never read. `slice_of(key, shape)` -> (dim, start, length), or None for a key every rank holds whole."""
    from manifests.checkpoint import CheckpointError, tensor_index   # the canonical reader's validated header index

    entries = tensor_index(comp)
    extra, missing = sorted(set(entries) - set(shapes)), sorted(set(shapes) - set(entries))
    if extra or missing:
        raise CheckpointError(f"{comp.path}: {what} keys differ from the config (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})")
    out = {}
    for key, shape in shapes.items():
        e = entries[key]
        if e.shape != tuple(shape) or not e.dtype.is_floating_point:
            raise CheckpointError(f"{e.file}: key {key!r} is {e.dtype} {list(e.shape)}, the config needs {list(shape)}")
        dim, start, length = slice_of(key, shape) or (0, 0, shape[0])
        x = read_slice(e.file, e.start, e.dtype, e.shape, dim, start, length)
        if not bool(torch.isfinite(x).all()):
            raise CheckpointError(f"{e.file}: key {key!r} holds NaN/Inf values")
        out[key] = x
    return out
