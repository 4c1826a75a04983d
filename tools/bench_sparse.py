#!/usr/bin/env python
"""Benchmark: sliding-tile self-attention (`sta`) vs dense SDPA, one process, same q / k / v, printing ratios.

    python tools/bench_sparse.py                                         # grid 4 x 16 x 16, tile 1x8x8, window 1x1x1
    python tools/bench_sparse.py --grid 6 16 16 --tile 2 8 8 --window 1 0 0 --compile-flex

Rows: dense SDPA (the exact path), the engine's sta on the sdpa backend (dense boolean mask: every score is still
computed, so it cannot be faster than dense), on the flex backend (eager on CPU: PyTorch's unfused reference;
--compile-flex adds torch.compile(flex_attention), the fused kernel that skips empty blocks; compile time is
reported apart), and the readable reference. Each time is the median of --repeats runs after one warm-up (it
builds and caches the mask / BlockMask and pays torch's first-call costs; printed as setup). Ratios are
dense / row (> 1 = faster than dense). Also printed: the fraction of (query, key) pairs the mask removes, the
fraction FlexAttention's BlockMask really skips (whole empty blocks), and max |row - reference|. What a GPU
kernel gains is not measured here (tools/gpu_sparse_check.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _timed(fn, repeats: int) -> tuple[float, float, object]:
    t = time.perf_counter()
    out = fn()
    setup = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), setup, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", type=int, nargs=3, default=[4, 16, 16], metavar=("T", "H", "W"),
                    help="post-patch token grid")
    ap.add_argument("--tile", type=int, nargs=3, default=[1, 8, 8])
    ap.add_argument("--window", type=int, nargs=3, default=[1, 1, 1], help="key tiles each side, per axis")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile-flex", action="store_true", help="also time torch.compile(flex_attention)")
    ap.add_argument("--no-reference", action="store_true", help="skip the reference row (it builds [S, S] scores)")
    args = ap.parse_args(argv)

    from manifests.accel import AccelSpecError, make_spec
    from optimized.accel import sparse as engine
    from reference.wan import sparse_attention as reference

    knobs = {f"{what}_{axis}": n for what, values in (("tile", args.tile), ("window", args.window))
             for axis, n in zip("thw", values)}
    try:
        specs = {b: make_spec("sta", dict(knobs, backend=b)) for b in ("sdpa", "flex")}
        grid = tuple(args.grid)
        from manifests.accel.sparse import check_grid
        check_grid(grid)
        if min(args.heads, args.head_dim, args.batch, args.repeats, args.threads) < 1:
            raise ValueError("--heads, --head-dim, --batch, --repeats and --threads must be >= 1")
    except (AccelSpecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    S = math.prod(grid)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, S, args.heads, args.head_dim, generator=g).to(dtype) for _ in range(3))

    def dense():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2)

    rows: dict[str, tuple[float, float, torch.Tensor]] = {}
    with torch.no_grad():
        rows["dense sdpa"] = _timed(dense, args.repeats)
        rows["sta sdpa (bool mask)"] = _timed(lambda: engine.sparse_self_attention(q, k, v, grid, specs["sdpa"])[0],
                                              args.repeats)
        rows["sta flex (eager)"] = _timed(lambda: engine.sparse_self_attention(
            q, k, v, grid, specs["flex"], compile_flex=False)[0], args.repeats)
        if args.compile_flex:
            rows["sta flex (compiled)"] = _timed(lambda: engine.sparse_self_attention(
                q, k, v, grid, specs["flex"], compile_flex=True)[0], args.repeats)
        want = None
        if not args.no_reference:
            rows["reference (masked softmax)"] = _timed(
                lambda: reference.sparse_self_attention(q, k, v, grid, specs["sdpa"])[0], args.repeats)
            want = rows["reference (masked softmax)"][2]
    _, removed = engine.sparse_self_attention(q, k, v, grid, specs["sdpa"])
    stats = engine.flex_block_stats(grid, specs["flex"])
    per_head = S * S
    print(f"sta attention, grid {grid} ({S} tokens), tile {tuple(args.tile)}, window {tuple(args.window)}, "
          f"B={args.batch} heads={args.heads} d={args.head_dim} {args.dtype} CPU threads={args.threads}")
    print(f"  mask removes {removed / (per_head * args.batch * args.heads):.1%} of (query, key) pairs; the "
          f"BlockMask skips {stats['blocks_skipped']}/{stats['blocks']} blocks = "
          f"{stats['pairs_skipped_by_kernel'] / per_head:.1%} of pairs")
    base = rows["dense sdpa"][0]
    for name, (sec, setup, out) in rows.items():
        err = "" if want is None or name in ("dense sdpa", "reference (masked softmax)") else \
            f"  max|row - ref| {(out.flatten(2, 3).float() - want.float()).abs().max().item():.1e}"
        print(f"  {name:28s} {sec * 1e3:9.2f} ms  (setup {setup:6.2f} s)  dense/row {base / sec:5.2f}x{err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
