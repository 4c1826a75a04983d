"""Closed-form prompt adherence of a decoded clip against its caption (the `shapes` grammar), no learned model:

    foreground   pixels whose brightest channel exceeds FOREGROUND (the background is black); a frame with fewer
                 than MIN_PIXELS of them has no shape
    colour       the mean foreground RGB's nearest palette colour (Euclidean, in [0, 1] RGB)
    shape        a matched template, over the frames whose shape does not touch the frame's border (all frames if
                 every one does): each of the three shapes rendered at the grammar's size (times TEMPLATE_SCALES),
                 its centroid on the frame's brightness centroid, blurred by a Gaussian (TEMPLATE_SIGMAS pixels at
                 32 px), amplitude fitted by least squares; the residual |b - a T|^2 / |b|^2 of the brightest channel
                 b in a window around the shape, its minimum over scale and blur, averaged over frames: the shape with
                 the smallest. Not the area / perimeter of a thresholded mask (extent = area / bbox area, compactness
                 = 4 pi area / perimeter^2; still reported): a fixed threshold rounds a blurred square's corners, so
                 that classifier measured the blur, not the shape (ground-truth clips blurred by a 1 px Gaussian
                 scored 0.917, by 1.5 px 0.833; every triangle / square read as a circle); this one scores them 1.0
    direction    the centroid's least-squares velocity (pixels per frame) over the frames with a shape; the axis
                 with the larger |velocity| and its sign; |velocity| * (F - 1) under MIN_TRAVEL pixels is "none"
    speed        reported (nearest named speed), not scored: the total is colour, shape and direction

A clip scores total = (number of correct attributes) / 3; `adherence_rate` is the mean total over a set."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from parity.quality.shapes import (
    COLOURS,
    DIRECTIONS,
    SHAPE_FRACTION,
    SHAPES,
    SPEEDS,
    Caption,
    parse_caption,
    shape_coverage,
)

FOREGROUND = 0.35          # brightest channel above this: the shape (the background is 0, a shape's channel is 1)
MIN_PIXELS = 4
MIN_TRAVEL = 2.0           # pixels over the clip, at 32 px (scaled with size)
SCORED = ("colour", "shape", "direction")
TEMPLATE_SCALES = (0.8, 0.9, 1.0, 1.1, 1.2)   # the template's side over the grammar's (a generated shape's size drifts)
TEMPLATE_SIGMAS = (0.0, 0.5, 1.0, 1.5, 2.0)   # Gaussian blur of the template, pixels at 32 px (scaled with size)
TEMPLATE_WINDOW = 3                           # pixels (at 32 px) around the shape's mask the residual is taken over


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


def _template_residuals(brightness: np.ndarray, mask: np.ndarray, scale: float) -> dict[str, float]:
    """Per shape, the smallest normalised residual of a fitted template (see the module doc) on one frame."""
    from scipy.ndimage import binary_dilation, gaussian_filter
    H, W = brightness.shape
    window = binary_dilation(mask, iterations=max(1, round(TEMPLATE_WINDOW * scale)))
    img = brightness * window
    total = float(img.sum())
    ys, xs = np.mgrid[0:H, 0:W]
    cx, cy = float((img * (xs + 0.5)).sum()) / total, float((img * (ys + 0.5)).sum()) / total
    energy = float((img * img).sum())
    side0 = SHAPE_FRACTION * min(H, W)
    out = {}
    for shape in SHAPES:
        best = math.inf
        for k in TEMPLATE_SCALES:
            side = k * side0
            # an upright triangle's centroid is side / 6 below its bounding box's centre
            base = shape_coverage(shape, cx, cy - (side / 6 if shape == "triangle" else 0.0), side, H, W)
            for sigma in TEMPLATE_SIGMAS:
                t = gaussian_filter(base, sigma * scale) if sigma else base
                tt = float((t * t).sum())
                if tt <= 0:
                    continue
                a = float((img * t).sum()) / tt
                best = min(best, float(((img - a * t) ** 2).sum()) / energy)
        out[shape] = best
    return out


def score_clip(video: np.ndarray, caption: Caption | str) -> AdherenceScore:
    """`video`: [F, H, W, 3], uint8 or float in [0, 1]. Never raises on a bad clip: a clip with no shape fails every
    attribute ("none")."""
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    v = _as_float01(video)
    F, H, W, _ = v.shape
    scale = min(H, W) / 32
    brightest = v.max(axis=-1)
    fg_pixels, extents, compact, centres, frames_seen = [], [], [], [], []
    interior, border = [], []                 # per frame template residuals: shape inside the frame / touching it
    for f in range(F):
        mask = brightest[f] > FOREGROUND
        if mask.sum() < MIN_PIXELS:
            continue
        mask = _largest_component(mask)
        fg_pixels.append(v[f][mask])
        ys, xs = np.nonzero(mask)
        touches = ys.min() == 0 or xs.min() == 0 or ys.max() == H - 1 or xs.max() == W - 1
        (border if touches else interior).append(_template_residuals(brightest[f], mask, scale))
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
    residuals = interior or border            # a shape cut by the border is not its shape: those frames only if all are
    fit = {s: float(np.mean([r[s] for r in residuals])) for s in SHAPES}
    shape = min(SHAPES, key=lambda s: fit[s])
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
                                  "template residual " + ", ".join(f"{s} {fit[s]:.3f}" for s in SHAPES)
                                  + f" ({len(residuals)} frames); mask extent {ext:.3f}, compactness {com:.3f}"),
        "direction": AttributeVerdict("direction", cap.direction, direction, direction == cap.direction,
                                      f"centroid velocity ({vx:.2f}, {vy:.2f}) px/frame"),
    }
    return AdherenceScore(cap.text, verdicts, speed, named or "medium", len(frames_seen))


def adherence_rate(scores: list[AdherenceScore]) -> float:
    """The mean per-clip total over a set: the fraction of (clip, attribute) verdicts that are correct."""
    if not scores:
        raise ValueError("adherence_rate of an empty set")
    return float(np.mean([s.total for s in scores]))
