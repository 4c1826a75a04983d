"""Readable sliding-tile (windowed 3D) self-attention for the reference Wan DiT (the `sta` acceleration).

The semantics are declared in manifests/accel/sparse.py (FastVideo's STA mask, arXiv 2502.04507). Written out:

    token n of the post-patch grid (T, H, W) sits at (t, h, w) with n = (t * H + h) * W + w (the DiT's raster
    order: frames, then rows, then columns);
    its tile index on each axis is coordinate // tile (the last tile of an axis may be partial);
    a query's kernel centre is its own tile index clamped to [window, n_tiles - 1 - window] (the kernel slides
    along the canvas but never hangs over its edge; a window at least as wide as the axis covers all of it);
    key m is kept for query n iff |centre(n) - tile(m)| <= window on all three axes;
    out = softmax(q k^T / sqrt(d), masked keys = -inf) v, per batch row and head.

The number of (query, key) pairs the mask removes, per batch row and head, summed, is returned with the output.
This module never imports optimized/: it is the truth the engine's FlexAttention / SDPA paths are compared with.
"""

from __future__ import annotations

import math

import torch

from manifests.accel import AccelSpec, AccelSpecError
from manifests.accel.sparse import StaParams, check_grid
from reference.wan.transformer import attention


def token_coordinates(grid: tuple[int, int, int]) -> torch.Tensor:
    """[S, 3] long: (t, h, w) of every token of the grid, in raster order."""
    T, H, W = grid
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    return torch.stack([t.flatten(), h.flatten(), w.flatten()], dim=1)


def tile_window_mask(grid: tuple[int, int, int], params: StaParams) -> torch.Tensor:
    """[S, S] bool, True where query n (row) may attend to key m (column)."""
    grid = check_grid(grid)
    coords = token_coordinates(grid)
    keep = torch.ones(coords.shape[0], coords.shape[0], dtype=torch.bool)
    for axis in range(3):
        size, tile, window = grid[axis], params.tile[axis], params.window[axis]
        n_tiles = math.ceil(size / tile)
        tile_index = coords[:, axis] // tile
        if 2 * window + 1 >= n_tiles:
            continue                                   # the kernel spans the whole axis: every key tile is near
        centre = tile_index.clamp(window, n_tiles - 1 - window)
        near = (centre[:, None] - tile_index[None, :]).abs() <= window
        keep &= near
    return keep


def sparse_applies(params: StaParams, step: int | None, block: int | None) -> bool:
    """Whether this step's / block's self-attention is sparse ([start, end) ranges on both)."""
    if params.start_step or params.end_step is not None:
        if step is None:
            raise AccelSpecError("accel sta: the spec limits steps (start_step / end_step): the caller must pass step")
        if step < params.start_step or (params.end_step is not None and step >= params.end_step):
            return False
    if params.start_block or params.end_block is not None:
        if block is None:
            raise AccelSpecError("accel sta: the spec limits blocks (start_block / end_block): the caller must pass "
                                 "block")
        if block < params.start_block or (params.end_block is not None and block >= params.end_block):
            return False
    return True


def sparse_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: tuple[int, int, int],
                          spec: AccelSpec, *, step: int | None = None,
                          block: int | None = None) -> tuple[torch.Tensor, int]:
    """q, k, v [B, S, heads, head_dim] (the reference attention's layout) -> (out [B, S, heads * head_dim], number of
    (query, key) pairs removed by the mask, summed over batch rows and heads). Dense `attention` where the spec's
    step / block ranges say so (0 removed)."""
    params = StaParams.from_spec(spec)
    grid = check_grid(grid)
    if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"sparse attention: q, k, v must be equal [B, S, heads, head_dim], got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    B, S, heads, head_dim = q.shape
    if S != math.prod(grid):
        raise ValueError(f"sparse attention: {S} tokens do not fill the grid {grid} ({math.prod(grid)} tokens)")
    if not sparse_applies(params, step, block):
        return attention(q, k, v), 0

    keep = tile_window_mask(grid, params).to(q.device)
    # the softmax in float32, the output cast back (SDPA accumulates in float32 for half inputs too)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(head_dim)
    scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v.float()).to(q.dtype)
    removed = int((~keep).sum()) * B * heads
    return out.flatten(2, 3), removed


__all__ = ["sparse_applies", "sparse_self_attention", "tile_window_mask", "token_coordinates"]
