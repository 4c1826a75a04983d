"""seedvr2 C0 inputs: the NaDiT cases (fixed grids plus grids picked by rule), the window-geometry grids, seeded
canonical weights.

Grids by rule (`rule_grids`): the window size is `ceil(round(n * scale) / n_windows)` per spatial axis and
`ceil(min(t, 30) / 4)` in time (upstream window.py). Two porting bugs only show on particular grids, so those
grids are generated from the rule, not listed: the smallest token grids where truncating `n * scale` instead of
rounding it moves a window cut (on h, on w), and the shortest clip where the temporal cap of 30 moves a cut. The
rule uses upstream's constants written here (45x80 reference area, cap 30, (4,3,3) windows), not the manifests'
(a manifest bug must not move the grids that test it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from manifests.seedvr2 import nadit_key_shapes
from parity.weights import fan_in_init, random_state_dict

Grid = tuple[int, int, int]
UPSTREAM_AREA_TOKENS, UPSTREAM_T_CAP, UPSTREAM_NUM_WINDOWS = 45 * 80, 30, (4, 3, 3)


@dataclass(frozen=True)
class NaDiTInputs:
    vid: torch.Tensor
    vid_shape: torch.Tensor
    txt: torch.Tensor
    txt_shape: torch.Tensor
    timestep: torch.Tensor

    def args(self, dtype: torch.dtype = torch.float32):
        return (self.vid.to(dtype), self.vid_shape, self.txt.to(dtype), self.txt_shape, self.timestep)


@dataclass(frozen=True)
class NaDiTCase:
    name: str
    grids: tuple[Grid, ...]          # latent (T, H, W) per sample
    text_lens: tuple[int, ...]
    world_sizes: str = "all"         # "all": every requested SP size; "1": world size 1 only (rule cases)


# ------------------------------------------------------------------------------------------------
# Grids by rule
# ------------------------------------------------------------------------------------------------

def _cuts(n: int, k: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(regular, shifted) cuts of an axis of n tokens by windows of k (upstream's half-window clipped shift)."""
    regular = [(a, min(a + k, n)) for a in range(0, n, k)]
    if k >= n:
        return regular, [(0, n)]
    shifted = [(max(int((i - 0.5) * k), 0), min(int((i + 0.5) * k), n)) for i in range(math.ceil((n - 0.5) / k) + 1)]
    return regular, [(a, b) for a, b in shifted if b > a]


def _spatial_extent(h: int, w: int, to_int: Callable[[float], int]) -> tuple[int, int]:
    s = math.sqrt(UPSTREAM_AREA_TOKENS / (h * w))
    _, nh, nw = UPSTREAM_NUM_WINDOWS
    return math.ceil(to_int(h * s) / nh), math.ceil(to_int(w * s) / nw)


def rounding_grids(axis: int, count: int, max_side: int = 120) -> list[tuple[int, int]]:
    """The `count` smallest (by area, then h) token frames (h, w) whose cuts on `axis` (0 = h, 1 = w) differ when
    the scaled size is truncated instead of rounded half-to-even."""
    found = []
    for h in range(1, max_side):
        for w in range(1, max_side):
            a, b = _spatial_extent(h, w, round)[axis], _spatial_extent(h, w, int)[axis]
            if a != b and _cuts((h, w)[axis], a) != _cuts((h, w)[axis], b):
                found.append((h * w, h, w))
    return [(h, w) for _, h, w in sorted(found)[:count]]


def t_cap_frames(count: int) -> list[int]:
    """The `count` shortest token clips whose temporal cuts differ with and without the cap of 30."""
    nt = UPSTREAM_NUM_WINDOWS[0]
    out, t = [], 1
    while len(out) < count:
        if _cuts(t, math.ceil(min(t, UPSTREAM_T_CAP) / nt)) != _cuts(t, math.ceil(t / nt)):
            out.append(t)
        t += 1
    return out


def rule_token_grids() -> dict[str, Grid]:
    """Token grids (t, h, w) by rule: the smallest per rule (one frame for the spatial rules, a 1x1 frame for T)."""
    (hh, hw), = rounding_grids(0, 1)
    (wh, ww), = rounding_grids(1, 1)
    t, = t_cap_frames(1)
    return {"size_rounding_h": (1, hh, hw), "size_rounding_w": (1, wh, ww), "t_cap": (t, 1, 1)}


def _latent(token_grid: Grid) -> Grid:
    t, h, w = token_grid
    return (t, 2 * h, 2 * w)   # the 1x2x2 patch


# (name, latent grids per sample, text lengths): ragged on all axes; batched; one window per frame (3 windows, so
# a 4-rank group has an empty rank); then the rule cases (world size 1: they test window geometry, not SP).
CASES = (
    NaDiTCase("ragged", ((5, 24, 80),), (7,)),
    NaDiTCase("batch2", ((5, 6, 8), (7, 16, 24)), (4, 5)),
    NaDiTCase("few_windows", ((5, 6, 8),), (7,)),
    *(NaDiTCase(name, (_latent(g),), (5,), world_sizes="1") for name, g in rule_token_grids().items()),
)

# token grids (t, h, w) for the geometry check (reference vs optimized listings); the rule grids come in pairs per
# axis and the T cap on a full 720p frame
GEOMETRY_GRIDS = ((5, 12, 40), (7, 8, 12), (5, 3, 4), (21, 45, 80), (1, 64, 64), (31, 68, 120), (3, 8, 12),
                  (2, 45, 80), (9, 23, 41),
                  *((2, h, w) for h, w in rounding_grids(0, 2) + rounding_grids(1, 2)),
                  *((t, 45, 80) for t in t_cap_frames(2)))


def make_inputs(cfg, grids, text_lens, seed: int, timestep: float = 1000.0) -> NaDiTInputs:
    g = torch.Generator().manual_seed(seed)
    vids = []
    for T, H, W in grids:
        x = torch.randn(T * H * W, 32, generator=g)
        vids.append(torch.cat([x, torch.ones(T * H * W, 1)], -1))
    return NaDiTInputs(torch.cat(vids), torch.tensor(grids, dtype=torch.int64),
                       torch.randn(sum(text_lens), cfg.txt_in_dim, generator=g),
                       torch.tensor([[L] for L in text_lens], dtype=torch.int64),
                       torch.full((len(grids),), timestep))


def nadit_overrides(cfg, name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor | None:
    """Init rule for a second pass over the fan-in weights: scaled like the goldens (every block changes the
    residual clearly); None keeps the first pass's weight."""
    if name.endswith(".attn.rope.freqs"):
        n = math.prod(shape)
        if cfg.is_3b:
            return 10000.0 ** (-2 * torch.arange(n).float() / cfg.rope_axis_dim)
        return torch.linspace(1.0, cfg.pixel_rope_max_freq / 2, n) * torch.pi
    if name.endswith("_shift"):
        return 0.3 * r
    if name.endswith("_scale") or name == "vid_out_norm.weight":
        return 1 + 0.3 * r
    if name.endswith("_gate"):
        return 0.5 * r
    if ".norm_q." in name or ".norm_k." in name:
        return 1.5 + 0.3 * r
    return None


def nadit_state(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random canonical weights: fan-in weights, then the golden-like scales drawn from seed + 1."""
    shapes = nadit_key_shapes(cfg)
    return {**random_state_dict(shapes, seed),
            **random_state_dict(shapes, seed + 1, init=lambda k, shape, r: nadit_overrides(cfg, k, shape, r))}


def vae_init(name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor:
    """The restoration VAE's norms near 1; everything else fan-in."""
    if name.endswith(("norm1.weight", "norm2.weight", "group_norm.weight", "conv_norm_out.weight")):
        return 1 + 0.1 * r
    return fan_in_init(name, shape, r)
