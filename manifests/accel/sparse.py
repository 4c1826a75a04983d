"""Training-free sparse attention: its kinds, and the typed parameters both sides read from a spec.

    sta   sliding-tile attention (Zhang et al. 2025, "Fast Video Generation with Sliding Tile Attention",
          arXiv 2502.04507; mask semantics of hao-ai-lab/FastVideo's flex-attention reference mask
          `generate_sta_mask`, fastvideo-kernel/tests/support_flex_sta.py / csrc/sliding_tile_attention/test/
          flex_sta_ref.py). The post-patch video grid (T, H, W) is cut into tiles of (tile_t, tile_h, tile_w)
          tokens; a query in tile (a, b, c) attends to the keys of the tiles whose index lies within
          `window` tiles of a kernel centre on every axis, where the centre is the query's tile clamped to
          [window, n_tiles - 1 - window] so that the kernel never hangs over the canvas edge: every query tile
          sees exactly min(2 * window + 1, n_tiles) tiles per axis. Upstream's kernel_size k = 2 * window + 1
          (its masks test |centre - kv| <= k // 2, so an even k acts as k + 1: only odd kernels are expressible
          here, on purpose).

Deviations from upstream, each on purpose: upstream requires tile | canvas on every axis (canvas // tile tiles);
here the last tile of an axis may be partial (ceil(n / tile) tiles), so any grid works and a divisible grid is
exactly upstream's mask. Upstream (FastVideo STA_inference) reads a per-(step, layer, head) window from a searched
mask_strategy file and keeps full attention on its first steps; here one window applies to the steps in
[start_step, end_step) and the DiT blocks in [start_block, end_block), dense attention elsewhere. The sequence is
video tokens only (Wan's self-attention has no text tokens: text enters through cross-attention), so upstream's
text rows / columns do not arise.

`keys_skipped` (AccelDecision) counts the (query, key) pairs the mask excludes, per batch row and head: the same
number on every backend. Which of them a kernel really never touches (FlexAttention skips whole 128 x 128
blocks only) is a kernel property, reported by the benchmark, not by the decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from manifests.accel import AccelKind, AccelSpec, AccelSpecError, Knob

BACKENDS = ("sdpa", "flex")   # sdpa: dense boolean mask; flex: torch FlexAttention with a BlockMask

KINDS: tuple[AccelKind, ...] = (
    AccelKind(
        name="sta", exact=False,
        summary="sliding-tile attention: each query tile attends to a clamped window of (2w+1)^3 key tiles",
        knobs=(Knob("tile_t", 6, int, "tile size along latent frames, in post-patch tokens (STA paper: 6)", low=1),
               Knob("tile_h", 8, int, "tile size along height, in post-patch tokens (STA paper: 8)", low=1),
               Knob("tile_w", 8, int, "tile size along width, in post-patch tokens (STA paper: 8)", low=1),
               Knob("window_t", 1, int, "key tiles on each side of the (clamped) kernel centre along frames; "
                    "upstream kernel_size = 2 * window + 1", low=0),
               Knob("window_h", 1, int, "key tiles on each side along height", low=0),
               Knob("window_w", 1, int, "key tiles on each side along width", low=0),
               Knob("start_step", 0, int, "first denoising step (0-based) that uses the sparse mask", low=0),
               Knob("end_step", None, int, "first step that is dense again (None: until the last)", low=1),
               Knob("start_block", 0, int, "first DiT block whose self-attention is sparse", low=0),
               Knob("end_block", None, int, "first block that is dense again (None: until the last)", low=1),
               Knob("backend", "sdpa", str, "sdpa (dense boolean mask) or flex (FlexAttention BlockMask); "
                    "the same mask, outputs equal to float rounding", choices=BACKENDS)),
        cache_key_fields=("accel", "grid"),   # a mask (or BlockMask) is valid for one spec and one grid
        loops=("wan.denoise",),
        upstream="FastVideo sliding-tile attention (generate_sta_mask, arXiv 2502.04507)"),
)

SPARSE_KIND_NAMES = frozenset(k.name for k in KINDS)


@dataclass(frozen=True)
class StaParams:
    """The `sta` knobs as typed values (validated across knobs, which a single Knob cannot do)."""
    tile: tuple[int, int, int]                 # (t, h, w) tokens per tile
    window: tuple[int, int, int]               # key tiles on each side of the clamped centre, per axis
    start_step: int
    end_step: int | None
    start_block: int
    end_block: int | None
    backend: str

    @classmethod
    def from_spec(cls, spec: AccelSpec) -> StaParams:
        if spec.name not in SPARSE_KIND_NAMES:
            raise AccelSpecError(f"accel {spec.name}: not a sparse-attention kind "
                                 f"({', '.join(sorted(SPARSE_KIND_NAMES))})")
        g = spec.get
        for knob in ("tile_t", "tile_h", "tile_w", "window_t", "window_h", "window_w", "start_step", "start_block"):
            if not isinstance(g(knob), int) or isinstance(g(knob), bool):   # a hand-built AccelSpec skips coercion
                raise AccelSpecError(f"accel {spec.name}: knob {knob} must be int, got {g(knob)!r}")
        params = cls(tile=(g("tile_t"), g("tile_h"), g("tile_w")), window=(g("window_t"), g("window_h"), g("window_w")),
                     start_step=g("start_step"), end_step=g("end_step"), start_block=g("start_block"),
                     end_block=g("end_block"), backend=g("backend"))
        if min(params.tile) < 1 or min(params.window) < 0:
            raise AccelSpecError(f"accel {spec.name}: tiles must be >= 1 and windows >= 0, got tile={params.tile} "
                                 f"window={params.window}")
        if params.end_step is not None and params.end_step <= params.start_step:
            raise AccelSpecError(f"accel {spec.name}: end_step ({params.end_step}) must be > start_step "
                                 f"({params.start_step})")
        if params.end_block is not None and params.end_block <= params.start_block:
            raise AccelSpecError(f"accel {spec.name}: end_block ({params.end_block}) must be > start_block "
                                 f"({params.start_block})")
        if params.backend not in BACKENDS:
            raise AccelSpecError(f"accel {spec.name}: backend must be one of {', '.join(BACKENDS)}, "
                                 f"got {params.backend!r}")
        return params

    @property
    def restricted(self) -> bool:
        """True when the spec limits steps or blocks (the caller must then say which step and block it is)."""
        return bool(self.start_step or self.end_step is not None or self.start_block or self.end_block is not None)


def attention_flops_skipped(keys_skipped: int, head_dim: int) -> int:
    """FLOPs a kernel that truly skips the removed pairs saves: 2 * head_dim for q.k and 2 * head_dim for p.v per
    (query, key) pair (multiply-adds counted as 2; the softmax's exp is not counted)."""
    return 4 * head_dim * keys_skipped


def check_grid(grid: object) -> tuple[int, int, int]:
    """The post-patch grid (T, H, W) as three positive ints; ValueError otherwise (a caller bug, not a bad spec)."""
    if (not isinstance(grid, (tuple, list)) or len(grid) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in grid)):
        raise ValueError(f"sparse attention: grid must be three positive ints (T, H/p, W/p), got {grid!r}")
    return int(grid[0]), int(grid[1]), int(grid[2])


__all__ = ["BACKENDS", "KINDS", "SPARSE_KIND_NAMES", "StaParams", "attention_flops_skipped", "check_grid"]
