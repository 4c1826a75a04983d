"""Closed-form prompt adherence of a decoded clip against its caption (the `shapes` grammar), no learned model:

    foreground   pixels whose brightest channel exceeds FOREGROUND (the background is black); a frame with fewer
                 than MIN_PIXELS of them has no shape
    colour       the mean foreground RGB's nearest palette colour (Euclidean, in [0, 1] RGB)
    shape        per frame, extent = area / bounding-box area (square 1, circle pi/4, triangle 1/2) and compactness
                 = 4 pi area / perimeter^2 (circle 1, square pi/4, triangle ~0.60); the median over frames of each,
                 matched to the nearest of the three analytic (extent, compactness) points
                 (compactness weighted by COMPACTNESS_WEIGHT)
    direction    the centroid's least-squares velocity (pixels per frame) over the frames with a shape; the axis
                 with the larger |velocity| and its sign; |velocity| * (F - 1) under MIN_TRAVEL pixels is "none"
    speed        reported (nearest named speed), not scored: the total is colour, shape and direction

A clip scores total = (number of correct attributes) / 3; `adherence_rate` is the mean total over a set."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from parity.quality.shapes import COLOURS, DIRECTIONS, SPEEDS, Caption, parse_caption

FOREGROUND = 0.35          # brightest channel above this: the shape (the background is 0, a shape's channel is 1)
MIN_PIXELS = 4
MIN_TRAVEL = 2.0           # pixels over the clip, at 32 px (scaled with size)
# analytic (extent, compactness) of the three shapes (upright, filled)
SHAPE_POINTS = {"square": (1.0, math.pi / 4), "circle": (math.pi / 4, 1.0),
                "triangle": (0.5, 4 * math.pi * 0.5 / (1 + math.sqrt(5)) ** 2)}
SCORED = ("colour", "shape", "direction")
COMPACTNESS_WEIGHT = 0.25  # a pixel perimeter of a ~10 px shape is coarse: extent (area / bbox) weighs more


@dataclass(frozen=True)
class AttributeVerdict:
    name: str
    expected: str
    measured: str
    ok: bool
    detail: str = ""


@dataclass
class AdherenceScore:
    caption: str
    verdicts: dict[str, AttributeVerdict]
    speed_px_per_frame: float = float("nan")
    measured_speed: str = ""
    frames_with_shape: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.verdicts[n].ok for n in SCORED) / len(SCORED)

    @property
    def all_ok(self) -> bool:
        return all(self.verdicts[n].ok for n in SCORED)

    def to_dict(self) -> dict:
        return {"caption": self.caption, "total": self.total,
                "verdicts": {n: vars(v) for n, v in self.verdicts.items()},
                "speed_px_per_frame": self.speed_px_per_frame, "measured_speed": self.measured_speed,
                "frames_with_shape": self.frames_with_shape}


def _as_float01(video: np.ndarray) -> np.ndarray:
    v = np.asarray(video)
    if v.ndim != 4 or v.shape[-1] != 3:
        raise ValueError(f"a clip is [F, H, W, 3], got shape {v.shape}")
    return v.astype(np.float64) / 255.0 if v.dtype == np.uint8 else v.astype(np.float64)


def _perimeter(mask: np.ndarray) -> float:
    from skimage.measure import perimeter
    return float(perimeter(mask, neighborhood=4))


def _largest_component(mask: np.ndarray) -> np.ndarray:
    from skimage.measure import label
    lab = label(mask, connectivity=2)
    if lab.max() <= 1:
        return mask
    sizes = np.bincount(lab.ravel())
    sizes[0] = 0
    return lab == sizes.argmax()


def score_clip(video: np.ndarray, caption: Caption | str) -> AdherenceScore:
    """`video`: [F, H, W, 3], uint8 or float in [0, 1]. Never raises on a bad clip: a clip with no shape fails every
    attribute ("none")."""
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    v = _as_float01(video)
    F, H, W, _ = v.shape
    scale = min(H, W) / 32
    brightest = v.max(axis=-1)
    fg_pixels, extents, compact, centres, frames_seen = [], [], [], [], []
    for f in range(F):
        mask = brightest[f] > FOREGROUND
        if mask.sum() < MIN_PIXELS:
            continue
        mask = _largest_component(mask)
        fg_pixels.append(v[f][mask])
        ys, xs = np.nonzero(mask)
        area = float(mask.sum())
        bbox = float((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
        extents.append(area / bbox)
        p = _perimeter(mask)
        compact.append(4 * math.pi * area / (p * p) if p > 0 else 0.0)
        centres.append((xs.mean(), ys.mean()))
        frames_seen.append(f)

    none = lambda name, want: AttributeVerdict(name, want, "none", False, "no frame has a shape")
    if not frames_seen:
        return AdherenceScore(cap.text, {"colour": none("colour", cap.colour), "shape": none("shape", cap.shape),
                                         "direction": none("direction", cap.direction)})
    mean_rgb = np.concatenate(fg_pixels).mean(axis=0)
    colour = min(COLOURS, key=lambda c: float(((mean_rgb - np.array(COLOURS[c])) ** 2).sum()))
    ext, com = float(np.median(extents)), float(np.median(compact))
    shape = min(SHAPE_POINTS, key=lambda s: (ext - SHAPE_POINTS[s][0]) ** 2
                + COMPACTNESS_WEIGHT * (com - SHAPE_POINTS[s][1]) ** 2)
    if len(frames_seen) >= 2:
        t = np.array(frames_seen, dtype=np.float64)
        c = np.array(centres)
        vx, vy = (np.polyfit(t, c[:, i], 1)[0] for i in range(2))
    else:
        vx = vy = 0.0
    if max(abs(vx), abs(vy)) * (F - 1) < MIN_TRAVEL * scale:
        direction = "none"
    else:
        step = (int(np.sign(vx)), 0) if abs(vx) >= abs(vy) else (0, int(np.sign(vy)))
        direction = next(d for d, s in DIRECTIONS.items() if s == step)
    speed = float(math.hypot(vx, vy)) / scale
    named = min(SPEEDS, key=lambda s: abs(SPEEDS[s] - speed))
    verdicts = {
        "colour": AttributeVerdict("colour", cap.colour, colour, colour == cap.colour,
                                   f"mean foreground RGB {np.round(mean_rgb, 3).tolist()}"),
        "shape": AttributeVerdict("shape", cap.shape, shape, shape == cap.shape,
                                  f"extent {ext:.3f}, compactness {com:.3f}"),
        "direction": AttributeVerdict("direction", cap.direction, direction, direction == cap.direction,
                                      f"centroid velocity ({vx:.2f}, {vy:.2f}) px/frame"),
    }
    return AdherenceScore(cap.text, verdicts, speed, named or "medium", len(frames_seen))


def adherence_rate(scores: list[AdherenceScore]) -> float:
    """The mean per-clip total over a set: the fraction of (clip, attribute) verdicts that are correct."""
    if not scores:
        raise ValueError("adherence_rate of an empty set")
    return float(np.mean([s.total for s in scores]))
