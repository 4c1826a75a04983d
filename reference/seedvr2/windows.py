"""SeedVR2 3D window partitions on a post-patch token grid (t, h, w), read top to bottom.

The window *size* is normalised to a 720p reference area, so bigger frames get more windows, not bigger ones.
Both methods return an exact partition of the grid as a list of half-open boxes ((t0,t1),(h0,h1),(w0,w1)),
enumerated w outermost, then h, then t innermost (upstream order).
"""

from __future__ import annotations

import math

from manifests.seedvr2.config import MAX_TEMPORAL_WINDOW, REFERENCE_AREA_TOKENS

Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def window_size(grid: tuple[int, int, int], num_windows: tuple[int, int, int]) -> tuple[int, int, int]:
    t, h, w = grid
    nt, nh, nw = num_windows
    scale = math.sqrt(REFERENCE_AREA_TOKENS / (h * w))
    # Python round() is half-to-even, as upstream
    return (math.ceil(min(t, MAX_TEMPORAL_WINDOW) / nt),
            math.ceil(round(h * scale) / nh),
            math.ceil(round(w * scale) / nw))


def regular_cuts(n: int, k: int) -> list[tuple[int, int]]:
    return [(i * k, min((i + 1) * k, n)) for i in range(math.ceil(n / k))]


def shifted_cuts(n: int, k: int) -> list[tuple[int, int]]:
    """Every cut moved by half a window and clipped at the grid boundary (not a cyclic roll)."""
    shift = 0.5 if k < n else 0.0
    count = math.ceil((n - shift) / k) + 1 if shift > 0 else 1
    cuts = [(max(int((i - shift) * k), 0), min(int((i - shift + 1) * k), n)) for i in range(count)]
    return [(a, b) for a, b in cuts if b > a]  # empty windows dropped


def windows(grid: tuple[int, int, int], num_windows: tuple[int, int, int], method: str) -> list[Box]:
    wt, wh, ww = window_size(grid, num_windows)
    cuts = regular_cuts if method == "regular" else shifted_cuts
    if method not in ("regular", "shifted"):
        raise ValueError(f"unknown window method {method!r}")
    t_cuts, h_cuts, w_cuts = cuts(grid[0], wt), cuts(grid[1], wh), cuts(grid[2], ww)
    return [(tc, hc, wc) for wc in w_cuts for hc in h_cuts for tc in t_cuts]
