"""Sliding-tile self-attention in the engine (the `sta` kind of manifests/accel/sparse.py): two backends, one mask.

    sdpa   the token mask as a dense [S, S] boolean `attn_mask` of F.scaled_dot_product_attention (every score is
           still computed: the mask only excludes pairs from the softmax).
    flex   torch FlexAttention: the tokens are reordered tile-major (each tile contiguous, so the mask is block
           sparse), a BlockMask is built once per (grid, spec) by `create_block_mask` from a mask_mod on
           per-token tile indices, and the output is reordered back. On CUDA flex_attention runs compiled (the
           fused kernel skips every 128 x 128 block the mask empties); on CPU (torch 2.13) it runs eager by
           default: eager flex is PyTorch's unfused reference that materialises the scores (correct, not fast;
           its "without torch.compile" warning is silenced here on purpose), and torch.compile(flex_attention)
           works on CPU with a C++ compiler but costs ~30 s per shape, so it is opt-in (`compile_flex=True`).

The mask is a product over the three axes (the window test is per axis), so it is built from three small
[n, n] axis tables and its kept-pair count is the product of their sums: the count is exact on both backends
without building an [S, S] tensor on the flex path.

Negative control (the certificate's "a sparse mask that drops the diagonal tile"): `planted("drop_diagonal")`
removes every query's own tile from its keys, on both backends; nothing else reads `FAULTS`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from manifests.accel import AccelSpec, AccelSpecError
from manifests.accel.sparse import StaParams, check_grid
from optimized.attention import attend

KNOWN_FAULTS = ("drop_diagonal",)
FAULTS: set[str] = set()          # planted faults (negative controls only); see `planted`


@contextlib.contextmanager
def planted(fault: str):
    """Plant one of KNOWN_FAULTS for the duration of the block (the masks built under it are cached apart)."""
    if fault not in KNOWN_FAULTS:
        raise ValueError(f"unknown sparse-attention fault {fault!r}; known: {', '.join(KNOWN_FAULTS)}")
    FAULTS.add(fault)
    try:
        yield
    finally:
        FAULTS.discard(fault)


def applies(params: StaParams, step: int | None, block: int | None) -> bool:
    """Sparse on steps in [start_step, end_step) and blocks in [start_block, end_block); the caller must say which
    step / block it is when the spec limits them."""
    for what, value, start, end in (("step", step, params.start_step, params.end_step),
                                    ("block", block, params.start_block, params.end_block)):
        if start == 0 and end is None:
            continue
        if value is None:
            raise AccelSpecError(f"accel sta: the spec limits {what}s ({'start_' + what} / {'end_' + what}): the "
                                 f"caller must pass {what}")
        if not start <= value < (end if end is not None else value + 1):
            return False
    return True


def _axis_tables(size: int, tile: int, window: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Per axis: tile index [size], clamped kernel centre [size], reach (tiles), near [size, size] (query coord,
    key coord): near = |centre(query) - index(key)| <= reach."""
    tiles = math.ceil(size / tile)
    index = torch.arange(size) // tile
    lo, hi = (window, tiles - 1 - window) if 2 * window + 1 < tiles else (0, tiles - 1)
    centre = index.clamp(lo, hi)
    reach = window if 2 * window + 1 < tiles else tiles   # a window as wide as the axis reaches every tile
    return index, centre, reach, (centre[:, None] - index[None, :]).abs() <= reach


@functools.lru_cache(maxsize=64)
def _tables(grid: tuple[int, int, int], tile: tuple[int, int, int], window: tuple[int, int, int]):
    return tuple(_axis_tables(n, t, w) for n, t, w in zip(grid, tile, window))


@functools.lru_cache(maxsize=64)
def _kept_pairs(grid, tile, window, drop_diagonal: bool) -> int:
    """(query, key) pairs the mask keeps, per batch row and head: product of the axes' near counts (minus, under
    the fault, the same-tile pairs: product of the axes' same-index counts)."""
    tables = _tables(grid, tile, window)
    kept = math.prod(int(near.sum()) for _, _, _, near in tables)
    if drop_diagonal:
        kept -= math.prod(int((index[:, None] == index[None, :]).sum()) for index, _, _, _ in tables)
    return kept


def token_mask(grid: tuple[int, int, int], params: StaParams, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, S] bool in raster token order (the sdpa backend's attn_mask)."""
    return _token_mask(check_grid(grid), params.tile, params.window, "drop_diagonal" in FAULTS, str(device))


@functools.lru_cache(maxsize=2)      # an [S, S] bool each: 1 GiB at a released Wan 480p grid
def _token_mask(grid, tile, window, drop_diagonal: bool, device: str) -> torch.Tensor:
    (it, _, _, nt), (ih, _, _, nh), (iw, _, _, nw) = _tables(grid, tile, window)
    T, H, W = grid
    keep = nt[:, None, None, :, None, None] & nh[None, :, None, None, :, None] & nw[None, None, :, None, None, :]
    if drop_diagonal:
        same = ((it[:, None] == it[None, :])[:, None, None, :, None, None]
                & (ih[:, None] == ih[None, :])[None, :, None, None, :, None]
                & (iw[:, None] == iw[None, :])[None, None, :, None, None, :])
        keep = keep & ~same
    return keep.reshape(T * H * W, T * H * W).to(device)


@functools.lru_cache(maxsize=16)
def _flex_layout(grid, tile, window, drop_diagonal: bool, device: str):
    """(tile-major permutation [S], its inverse [S], BlockMask over the permuted tokens)."""
    from torch.nn.attention.flex_attention import create_block_mask

    (it, ct, rt, _), (ih, ch, rh, _), (iw, cw, rw, _) = _tables(grid, tile, window)
    T, H, W = grid
    reach = (rt, rh, rw)
    t, h, w = (a.flatten() for a in torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij"))
    tiles_h, tiles_w = math.ceil(H / tile[1]), math.ceil(W / tile[2])
    tile_id = (it[t] * tiles_h + ih[h]) * tiles_w + iw[w]
    perm = torch.sort(tile_id, stable=True).indices             # tile-major; raster order inside each tile
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    # per permuted token: its tile index and clamped centre on each axis
    idx = [a.to(device) for a in (it[t][perm], ih[h][perm], iw[w][perm])]
    ctr = [a.to(device) for a in (ct[t][perm], ch[h][perm], cw[w][perm])]

    def mask_mod(b, head, q_idx, kv_idx):
        keep = ((ctr[0][q_idx] - idx[0][kv_idx]).abs() <= reach[0]) \
            & ((ctr[1][q_idx] - idx[1][kv_idx]).abs() <= reach[1]) \
            & ((ctr[2][q_idx] - idx[2][kv_idx]).abs() <= reach[2])
        if drop_diagonal:
            keep = keep & ~((idx[0][q_idx] == idx[0][kv_idx]) & (idx[1][q_idx] == idx[1][kv_idx])
                            & (idx[2][q_idx] == idx[2][kv_idx]))
        return keep

    S = T * H * W
    block_mask = create_block_mask(mask_mod, None, None, S, S, device=device)
    return perm.to(device), inverse.to(device), block_mask


def flex_token_mask(grid: tuple[int, int, int], params: StaParams) -> torch.Tensor:
    """[S, S] bool in raster token order: the flex backend's mask_mod evaluated on every (query, key) pair of its
    tile-major layout and put back in raster order (what the parity rows compare with the reference's mask)."""
    perm, _, block_mask = _flex_layout(check_grid(grid), params.tile, params.window, "drop_diagonal" in FAULTS,
                                       "cpu")
    S = perm.numel()
    index = torch.arange(S)
    permuted = block_mask.mask_mod(0, 0, index[:, None], index[None, :])
    raster = torch.empty(S, S, dtype=torch.bool)
    raster[perm[:, None], perm[None, :]] = permuted
    return raster


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, grid, params: StaParams, compile_flex: bool | None) -> torch.Tensor:
    """[B, H, S, d] in raster order -> [B, H, S, d] in raster order."""
    from torch.nn.attention.flex_attention import flex_attention

    perm, inverse, block_mask = _flex_layout(grid, params.tile, params.window, "drop_diagonal" in FAULTS,
                                             str(q.device))
    qp, kp, vp = q[:, :, perm], k[:, :, perm], v[:, :, perm]
    if compile_flex if compile_flex is not None else q.is_cuda:
        out = _compiled_flex()(qp, kp, vp, block_mask=block_mask)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = flex_attention(qp, kp, vp, block_mask=block_mask)
    return out[:, :, inverse]


def sparse_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: tuple[int, int, int],
                          spec: AccelSpec, *, step: int | Sequence[int] | None = None, block: int | None = None,
                          compile_flex: bool | None = None,
                          dense_attention: Callable[..., torch.Tensor] = attend) -> tuple[torch.Tensor, int]:
    """q, k, v [B, S, heads, head_dim] (WanDiTFast's layout) -> (out [B, S, heads, head_dim], the (query, key)
    pairs the mask removed, summed over batch rows and heads). Dense SDPA (0 removed) where the spec's step / block
    ranges exclude this call, and where the window covers the whole grid (bitwise the dense path then).

    `step`: one int for the whole batch, or one per batch row (a batched step may hold requests at different
    denoising steps): rows outside [start_step, end_step) run dense, the others sparse, in one call each.
    `dense_attention(q, k, v)` on [B, heads, S, head_dim]: the caller's exact-path kernel (its configured SDPA
    backend), so dense calls are bitwise what the exact path computes; default optimized.attention.attend."""
    params = StaParams.from_spec(spec)
    grid = check_grid(grid)
    if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"sparse attention: q, k, v must be equal [B, S, heads, head_dim], got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    B, S = q.shape[:2]
    if S != math.prod(grid):
        raise ValueError(f"sparse attention: {S} tokens do not fill the grid {grid} ({math.prod(grid)} tokens)")
    if step is not None and not isinstance(step, int):
        steps = list(step)
        if len(steps) != B:
            raise ValueError(f"sparse attention: {len(steps)} steps given for a batch of {B} rows")
        sparse_rows = [r for r in range(B) if applies(params, steps[r], block)]
        if 0 < len(sparse_rows) < B:
            out = torch.empty_like(q)
            dense_rows = [r for r in range(B) if r not in sparse_rows]
            out[dense_rows] = dense_attention(*(x[dense_rows].transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
            sparse_out, removed = _sparse(q[sparse_rows], k[sparse_rows], v[sparse_rows], grid, params, compile_flex,
                                          dense_attention)
            out[sparse_rows] = sparse_out
            return out, removed
        step = steps[0] if steps else None   # every row decides alike: one call
    if not applies(params, step, block):
        return dense_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2), 0
    return _sparse(q, k, v, grid, params, compile_flex, dense_attention)


def _sparse(q, k, v, grid, params: StaParams, compile_flex: bool | None, dense_attention) -> tuple[torch.Tensor, int]:
    B, S, heads = q.shape[:3]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    removed_per_head = S * S - _kept_pairs(grid, params.tile, params.window, "drop_diagonal" in FAULTS)
    if removed_per_head == 0:       # nothing to skip: the dense kernel, bitwise the exact path
        return dense_attention(qt, kt, vt).transpose(1, 2), 0
    if params.backend == "flex":
        out = _flex(qt, kt, vt, grid, params, compile_flex)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=token_mask(grid, params, q.device))
    return out.transpose(1, 2), removed_per_head * B * heads


def flex_block_stats(grid: tuple[int, int, int], spec: AccelSpec, device: torch.device | str = "cpu") -> dict[str, int]:
    """What the FlexAttention kernel really skips for this grid: blocks of the BlockMask that are empty, and the
    (query, key) pairs inside them, per batch row and head (mask-removed pairs in partial blocks are computed).
    `device`: where the (cached) BlockMask lives, so the one a run built is the one counted."""
    params = StaParams.from_spec(spec)
    grid = check_grid(grid)
    _, _, block_mask = _flex_layout(grid, params.tile, params.window, "drop_diagonal" in FAULTS, str(device))
    S = math.prod(grid)
    bq, bk = block_mask.BLOCK_SIZE
    rows, cols = math.ceil(S / bq), math.ceil(S / bk)
    visited = torch.zeros(rows, cols, dtype=torch.bool)
    for kv_num, kv_idx in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                           (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if kv_num is None:
            continue
        kv_num, kv_idx = kv_num.cpu(), kv_idx.cpu()
        for r in range(rows):
            visited[r, kv_idx[0, 0, r, :int(kv_num[0, 0, r])].long()] = True
    sizes_q = torch.tensor([min(bq, S - r * bq) for r in range(rows)])
    sizes_k = torch.tensor([min(bk, S - c * bk) for c in range(cols)])
    pairs = (sizes_q[:, None] * sizes_k[None, :])
    return {"blocks": rows * cols, "blocks_skipped": int((~visited).sum()),
            "pairs_skipped_by_kernel": int(pairs[~visited].sum()),
            "pairs_removed_by_mask": S * S - _kept_pairs(grid, params.tile, params.window, "drop_diagonal" in FAULTS)}


__all__ = ["FAULTS", "KNOWN_FAULTS", "applies", "flex_block_stats", "flex_token_mask", "planted",
           "sparse_self_attention", "token_mask"]
