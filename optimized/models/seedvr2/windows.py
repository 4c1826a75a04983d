"""Window geometry of a packed batch as index tensors, the window-to-rank plan and its LRU plan cache.

Geometry (the same facts as the reference, written independently): per sample a post-patch token grid (t,h,w);
window size normalised to the 720p token area; regular cuts [i*k, min((i+1)*k, n)); shifted cuts moved by half
a window and clipped at the boundary (never rolled); enumeration w outermost, t innermost; tokens row-major in a
window. A canonical token id is sample_offset + (t*H + h)*W + w.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from manifests.seedvr2.config import MAX_TEMPORAL_WINDOW, REFERENCE_AREA_TOKENS
from optimized.parallel.planner import PLANNER_VERSION, Assignment, lpt_assign
from optimized.parallel.redistribute import RowLayout
from optimized.runtime.cache import CacheKey, CacheStore, tensor_nbytes

GEOMETRY_VERSION = "seedvr2.windows.v1"
Grid = tuple[int, int, int]


def axis_cuts(n: int, k: int, method: str) -> list[tuple[int, int]]:
    if method == "regular":
        return [(a, min(a + k, n)) for a in range(0, n, k)]
    if method == "shifted":
        if k >= n:
            return [(0, n)]
        half = 0.5
        out = []
        for i in range(math.ceil((n - half) / k) + 1):
            a, b = max(int((i - half) * k), 0), min(int((i - half + 1) * k), n)
            if b > a:
                out.append((a, b))
        return out
    raise ValueError(f"unknown window method {method!r}")


def window_extent(grid: Grid, num_windows: tuple[int, int, int]) -> Grid:
    t, h, w = grid
    s = math.sqrt(REFERENCE_AREA_TOKENS / (h * w))
    return (-(-min(t, MAX_TEMPORAL_WINDOW) // num_windows[0]), math.ceil(round(h * s) / num_windows[1]),
            math.ceil(round(w * s) / num_windows[2]))


def fingerprint(grids: tuple[Grid, ...], num_windows: tuple[int, int, int], method: str) -> str:
    return hashlib.sha1(repr((GEOMETRY_VERSION, grids, num_windows, method)).encode()).hexdigest()


@dataclass(frozen=True)
class WindowGeometry:
    """Every window of a packed batch for one method, in upstream order (samples in batch order)."""

    method: str
    grids: tuple[Grid, ...]
    boxes: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]   # (sample, ((t0,t1),(h0,h1),(w0,w1)))
    window_tokens: tuple[int, ...]
    token_ids: torch.Tensor          # (N,) canonical ids, windows concatenated
    local_coords: torch.Tensor       # (N, 3) window-local (dt, dh, dw)
    extents: torch.Tensor            # (N, 3) extent of the token's window on each axis
    window_start: tuple[int, ...]    # offset of each window in token_ids

    @property
    def num_windows(self) -> int:
        return len(self.boxes)

    def windows_of_sample(self, sample: int) -> int:
        return sum(1 for s, _ in self.boxes if s == sample)


def build_geometry(grids: tuple[Grid, ...], num_windows: tuple[int, int, int], method: str) -> WindowGeometry:
    boxes, tokens, ids, coords, extents, starts = [], [], [], [], [], []
    offset, start = 0, 0
    for s, (T, H, W) in enumerate(grids):
        kt, kh, kw = window_extent((T, H, W), num_windows)
        tc, hc, wc = axis_cuts(T, kt, method), axis_cuts(H, kh, method), axis_cuts(W, kw, method)
        canon = torch.arange(T * H * W).view(T, H, W)
        for w_cut in wc:
            for h_cut in hc:
                for t_cut in tc:
                    box = (t_cut, h_cut, w_cut)
                    n = [b - a for a, b in box]
                    block = canon[t_cut[0]:t_cut[1], h_cut[0]:h_cut[1], w_cut[0]:w_cut[1]]
                    ids.append(block.reshape(-1) + offset)
                    grid = torch.meshgrid(*[torch.arange(m) for m in n], indexing="ij")
                    coords.append(torch.stack([g.reshape(-1) for g in grid], -1))
                    extents.append(torch.tensor(n).expand(block.numel(), 3))
                    boxes.append((s, box))
                    tokens.append(block.numel())
                    starts.append(start)
                    start += block.numel()
        offset += T * H * W
    return WindowGeometry(method, tuple(grids), tuple(boxes), tuple(tokens), torch.cat(ids), torch.cat(coords),
                          torch.cat(extents), tuple(starts))


@dataclass(frozen=True)
class WindowPlan:
    """A geometry, its window-to-rank assignment and the resulting row layout."""

    geometry: WindowGeometry
    assignment: Assignment
    layout: RowLayout

    @property
    def world_size(self) -> int:
        return self.assignment.world_size

    def rank_token_positions(self, rank: int) -> torch.Tensor:
        """Positions in geometry.token_ids of this rank's rows (its windows in ascending order)."""
        g = self.geometry
        parts = [torch.arange(g.window_start[w], g.window_start[w] + g.window_tokens[w])
                 for w in self.assignment.items_of(rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def make_plan(geometry: WindowGeometry, world_size: int) -> WindowPlan:
    assignment = lpt_assign(list(geometry.window_tokens), world_size)
    g = geometry
    rows = []
    for r in range(world_size):
        parts = [g.token_ids[g.window_start[w]:g.window_start[w] + g.window_tokens[w]] for w in assignment.items_of(r)]
        rows.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
    return WindowPlan(geometry, assignment, RowLayout(g.method, tuple(rows), int(g.token_ids.numel())))


class PlanCache:
    """LRU (bytes-bounded CacheStore) of WindowPlans keyed by grid, method + geometry fingerprint, geometry version,
    SP world size and planner version: a different degree can never reuse a stale assignment."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.store = CacheStore(max_bytes=max_bytes, name="seedvr2.window_plans")

    def key(self, grids: tuple[Grid, ...], num_windows, method: str, world_size: int) -> CacheKey:
        return CacheKey(model_id="seedvr2", component_id="window_plan", weights_version="independent",
                        precision="independent", shape_signature=repr(grids),
                        layout_signature=f"{method}:{num_windows}:{fingerprint(grids, num_windows, method)}",
                        cache_contract_version=f"{GEOMETRY_VERSION}+{PLANNER_VERSION}",
                        parallel_plan_hash=f"sp={world_size}")

    def get(self, grids: tuple[Grid, ...], num_windows, method: str, world_size: int) -> WindowPlan:
        key = self.key(grids, num_windows, method, world_size)
        plan = self.store.get(key)
        if plan is None:
            plan = make_plan(build_geometry(grids, num_windows, method), world_size)
            self.store.put(key, plan, nbytes=tensor_nbytes(plan.layout.rank_rows) + tensor_nbytes(
                [plan.geometry.token_ids, plan.geometry.local_coords, plan.geometry.extents]))
        return plan
