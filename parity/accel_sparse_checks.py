"""Sparse-attention parity at the attention level (C0-style): the engine's sliding-tile attention (both backends)
against the readable reference on random q / k / v, decisions first (the mask, the removed-pair count), tensors
second (the output, localised to the worst query tile).

    python -m parity.accel_sparse_checks --accel sta:tile_t=1,tile_h=2,tile_w=2 --grid 3 5 7
    python -m parity.accel_sparse_checks --accel sta:tile_t=1,tile_h=2,tile_w=2 --grid 3 5 7 --fault drop_diagonal

Exit 0 all rows pass, 1 a row fails (the negative control must), 2 bad input. Planted faults (engine side only):
    drop_diagonal   every query's own tile is removed from its keys (optimized/accel/sparse.py `planted`): the mask
                    row says "the query's own tile is missing" on every query tile, the count and output rows fail.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass

import torch

from manifests.accel import AccelSpec, AccelSpecError, make_spec, parse_accel
from manifests.accel.sparse import BACKENDS, StaParams, check_grid
from optimized.accel import sparse as engine
from reference.wan import sparse_attention as reference

FAULTS = engine.KNOWN_FAULTS
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2}   # max |engine - reference| of the attention output


@dataclass(frozen=True)
class SparseCheck:
    name: str                 # "<backend>:mask" | "<backend>:removed" | "<backend>:output"
    passed: bool
    got: float                # mismatching mask pairs / engine's removed count / max abs error
    want: float               # 0 / the reference's removed count / the tolerance
    where: str = ""           # failures only: which tiles, which pairs


def _tile_of(grid, tile) -> torch.Tensor:
    """[S, 3] tile index of every raster token (the parity side's own bookkeeping, for the messages)."""
    T, H, W = grid
    t, h, w = torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij")
    return torch.stack([t.flatten() // tile[0], h.flatten() // tile[1], w.flatten() // tile[2]], dim=1)


def _mask_where(got: torch.Tensor, want: torch.Tensor, tiles: torch.Tensor) -> str:
    missing, extra = want & ~got, got & ~want
    q, k = (missing | extra).nonzero(as_tuple=True)
    same_tile = (tiles[q] == tiles[k]).all(dim=1)
    n_query_tiles = len({tuple(t) for t in tiles.tolist()})
    lost_tiles = {tuple(t) for t in tiles[q[same_tile]].tolist()}
    if bool(same_tile.all()) and not extra.any():
        return (f"the query's own tile is missing from its keys on {len(lost_tiles)} of {n_query_tiles} query tiles "
                f"(the diagonal tile: {int(missing.sum())} pairs)")
    i = 0
    return (f"{int(missing.sum())} pairs missing, {int(extra.sum())} extra; first: query token {int(q[i])} (tile "
            f"{tuple(tiles[q[i]].tolist())}) vs key token {int(k[i])} (tile {tuple(tiles[k[i]].tolist())})")


def check_sparse_attention(spec: AccelSpec, grid: tuple[int, int, int], *, batch: int = 1, heads: int = 2,
                           head_dim: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
                           fault: str | None = None, backends: tuple[str, ...] = BACKENDS) -> list[SparseCheck]:
    """Rows for each backend: mask, removed-pair count, output. `fault`: plant one of FAULTS on the engine side."""
    params = StaParams.from_spec(spec)
    grid = check_grid(grid)
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; faults: {', '.join(FAULTS)}")
    g = torch.Generator().manual_seed(seed)
    S = math.prod(grid)
    q, k, v = (torch.randn(batch, S, heads, head_dim, generator=g).to(dtype) for _ in range(3))
    tiles = _tile_of(grid, params.tile)
    want_mask = reference.tile_window_mask(grid, params)
    checks: list[SparseCheck] = []
    for backend in backends:
        knobs = dict(spec.knobs, backend=backend)
        one = make_spec(spec.name, knobs)
        want, want_removed = reference.sparse_self_attention(q, k, v, grid, one)
        with engine.planted(fault) if fault else contextlib.nullcontext():
            got_mask = (engine.flex_token_mask if backend == "flex" else engine.token_mask)(grid, params)
            got, removed = engine.sparse_self_attention(q, k, v, grid, one)
        bad_pairs = int((got_mask != want_mask).sum())
        checks.append(SparseCheck(f"{backend}:mask", bad_pairs == 0, bad_pairs, 0,
                                  "" if bad_pairs == 0 else _mask_where(got_mask, want_mask, tiles)))
        checks.append(SparseCheck(f"{backend}:removed", removed == want_removed, removed, want_removed,
                                  "" if removed == want_removed else
                                  f"engine removed {removed} (query, key) pairs, reference {want_removed}"))
        err = (got.flatten(2, 3).float() - want.float()).abs().nan_to_num(nan=float("inf"))   # NaN counts as a miss
        worst = float(err.max())
        tol = TOLERANCE[dtype]
        where = ""
        if not worst <= tol:
            per_token = err.amax(dim=(0, 2))
            bad_tiles = {tuple(t) for t in tiles[per_token > tol].tolist()}
            token = int(per_token.argmax())
            where = (f"{len(bad_tiles)} query tiles exceed {tol:g}; worst at token {token} (tile "
                     f"{tuple(tiles[token].tolist())})")
        checks.append(SparseCheck(f"{backend}:output", worst <= tol, worst, tol, where))
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accel", required=True, help="NAME[:knob=value,...] of a sparse-attention kind")
    ap.add_argument("--grid", type=int, nargs=3, required=True, metavar=("T", "H", "W"), help="post-patch grid")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--fault", choices=FAULTS)
    args = ap.parse_args(argv)
    try:
        spec = parse_accel(args.accel)
        if args.heads < 1 or args.head_dim < 1:
            raise ValueError("--heads and --head-dim must be >= 1")
        checks = check_sparse_attention(spec, tuple(args.grid), heads=args.heads, head_dim=args.head_dim,
                                        dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype],
                                        fault=args.fault)
    except (AccelSpecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for c in checks:
        print(f"{'PASS' if c.passed else 'FAIL'}  {c.name:14s} got {c.got:<12g} want {c.want:<12g} {c.where}")
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
