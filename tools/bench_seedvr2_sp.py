"""Window-aligned SP (Plan A) planner benchmark for SeedVR2, no GPU needed: for 720p and 1080p clips at SP world
sizes 2-8, the LPT planner's load balance (max / mean video tokens per rank, per layout) and the bytes exchanged per
layer transition (regular <-> shifted), against the bytes head-sharded Ulysses would move per layer (all_to_all of
Q, K, V before attention and of the output after: 4 x N x D x (W-1)/W elements across the group).

    python tools/bench_seedvr2_sp.py [--variant 3b] [--frames 81] [--bytes-per-element 2]
"""

from __future__ import annotations

import argparse
import time

from tabulate import tabulate

from manifests.seedvr2 import load_variant
from optimized.models.seedvr2.windows import build_geometry, make_plan
from optimized.parallel.redistribute import build_transition

# (name, frame height, width) -> latent /8 (upstream crops to a multiple of 16), token grid /2 (1x2x2 patch)
CLIPS = (("720p", 720, 1280), ("1080p", 1080, 1920))


def token_grid(frames: int, height: int, width: int) -> tuple[int, int, int]:
    h, w = (height // 16 * 16) // 8, (width // 16 * 16) // 8
    return ((frames - 1) // 4 + 1, h // 2, w // 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="3b")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--bytes-per-element", type=int, default=2, help="2 = bf16 activations")
    ap.add_argument("--world-sizes", default="2,3,4,5,6,7,8")
    args = ap.parse_args()
    cfg = load_variant(args.variant)
    D, E = cfg.dim, args.bytes_per_element
    transitions = sum(1 for a, b in zip(cfg.schedule, cfg.schedule[1:]) if a != b)
    rows = []
    t0 = time.perf_counter()
    for name, H, W in CLIPS:
        grid = token_grid(args.frames, H, W)
        N = grid[0] * grid[1] * grid[2]
        geo = {m: build_geometry((grid,), cfg.num_windows, m) for m in ("regular", "shifted")}
        for ws in (int(x) for x in args.world_sizes.split(",")):
            plans = {m: make_plan(g, ws) for m, g in geo.items()}
            moved = [build_transition(plans[a].layout, plans[b].layout, 0).moved_rows()
                     for a, b in (("regular", "shifted"), ("shifted", "regular"))]
            plan_a = sum(moved) / 2 * D * E
            ulysses = 4 * N * D * (ws - 1) / ws * E
            rows.append([name, f"{grid}", N, ws, f"{geo['regular'].num_windows}/{geo['shifted'].num_windows}",
                         f"{plans['regular'].assignment.imbalance:.3f}", f"{plans['shifted'].assignment.imbalance:.3f}",
                         f"{plan_a / 2**20:.1f}", f"{ulysses / 2**20:.1f}", f"{plan_a / ulysses:.2f}"])
    print(f"SeedVR2 {args.variant}: dim {D}, {cfg.num_layers} layers ({transitions} layout transitions), "
          f"{args.frames} frames, {E} bytes/element; planning took {time.perf_counter() - t0:.2f} s")
    print(tabulate(rows, headers=["clip", "token grid", "tokens", "SP", "windows reg/shift",
                                  "max/mean reg", "max/mean shift", "Plan A MiB/transition",
                                  "Ulysses MiB/layer", "Plan A / Ulysses"], tablefmt="simple"))
    print("Plan A also all-reduces the text (L x D per layer) and gathers the output once; Ulysses also "
          "exchanges the text stream. Bytes are totals across the group.")


if __name__ == "__main__":
    main()
