"""The procedural "moving shapes" video set: one filled shape of one colour moving in a straight line at constant
speed on a black background, and the caption grammar that names it:

    caption   := "a " COLOUR " " SHAPE " moving " DIRECTION [" " SPEED]
    COLOUR    := red | green | blue | yellow           (pure RGB primaries / yellow = red + green)
    SHAPE     := square | circle | triangle            (same bounding box: side = diameter = base = height)
    DIRECTION := left | right | up | down              (image axes: x to the right, y downwards)
    SPEED     := slowly | quickly                      (absent: the medium speed)

A clip is a function of (caption, seed, frames, size): the seed moves the path's centre by a few pixels (jitter,
both axes) so one caption has many clips. Pixels are in [0, 1], float32, [F, H, W, 3]; edges are anti-aliased by
4x4 supersampling. `HELD_OUT` is the contract's request set (captions never trained on, one seed each)."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

COLOURS: dict[str, tuple[float, float, float]] = {"red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0),
                                                   "blue": (0.0, 0.0, 1.0), "yellow": (1.0, 1.0, 0.0)}
SHAPES = ("square", "circle", "triangle")
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy)
SPEEDS: dict[str, float] = {"slowly": 1.0, "": 1.75, "quickly": 2.5}   # pixels per frame at 32 px (scaled with size)
SHAPE_FRACTION = 11 / 32      # the shape's bounding-box side as a fraction of the frame's shorter side
JITTER_FRACTION = 3 / 32      # the path centre moves by up to this fraction of the shorter side (uniform, each axis)
SUPERSAMPLE = 4

_CAPTION = re.compile(r"^a (\w+) (\w+) moving (\w+)(?: (\w+))?$")


@dataclass(frozen=True)
class Caption:
    colour: str
    shape: str
    direction: str
    speed: str = ""            # "" = medium, "slowly", "quickly"

    @property
    def text(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction}" + (f" {self.speed}" if self.speed else "")


def parse_caption(text: str) -> Caption:
    """The caption's attributes; ValueError (naming the word) for text outside the grammar."""
    m = _CAPTION.match(" ".join(text.strip().lower().split()))
    if m is None:
        raise ValueError(f"caption {text!r} is not 'a COLOUR SHAPE moving DIRECTION [SPEED]'")
    colour, shape, direction, speed = m.group(1), m.group(2), m.group(3), m.group(4) or ""
    for word, known in ((colour, COLOURS), (shape, SHAPES), (direction, DIRECTIONS), (speed, SPEEDS)):
        if word not in known:
            raise ValueError(f"caption {text!r}: {word!r} is not one of {', '.join(k for k in known if k)}")
    return Caption(colour, shape, direction, speed)


def all_captions() -> list[Caption]:
    return [Caption(c, s, d, v) for c, s, d, v in itertools.product(COLOURS, SHAPES, DIRECTIONS, SPEEDS)]


def shape_coverage(shape: str, cx: float, cy: float, side: float, h: int, w: int) -> np.ndarray:
    """Coverage in [0, 1] of each pixel [h, w] by the shape centred at (cx, cy) (pixel centres at i + 0.5)."""
    s = SUPERSAMPLE
    ys = (np.arange(h * s) + 0.5) / s
    xs = (np.arange(w * s) + 0.5) / s
    y, x = np.meshgrid(ys, xs, indexing="ij")
    u, v = x - cx, y - cy                      # v grows downwards
    half = side / 2
    if shape == "square":
        inside = (np.abs(u) <= half) & (np.abs(v) <= half)
    elif shape == "circle":
        inside = u * u + v * v <= half * half
    else:                                      # upright isosceles triangle: apex at the top, base at the bottom
        inside = (v >= -half) & (v <= half) & (np.abs(u) <= (v + half) / 2)
    return inside.reshape(h, s, w, s).mean(axis=(1, 3))


def path_centres(caption: Caption, seed: int, frames: int, size: tuple[int, int]) -> np.ndarray:
    """[F, 2] (x, y) centre of the shape in each frame: a straight path through the (jittered) frame centre."""
    h, w = size
    scale = min(h, w) / 32
    rng = np.random.default_rng(seed)
    jitter = rng.uniform(-1, 1, size=2) * JITTER_FRACTION * min(h, w)
    centre = np.array([w / 2, h / 2]) + jitter
    dx, dy = DIRECTIONS[caption.direction]
    step = SPEEDS[caption.speed] * scale * np.array([dx, dy], dtype=np.float64)
    t = np.arange(frames) - (frames - 1) / 2
    return centre[None] + t[:, None] * step[None]


def render_clip(caption: Caption | str, seed: int = 0, frames: int = 9, size: tuple[int, int] = (32, 32)
                ) -> np.ndarray:
    """The clip of `caption`: float32 [F, H, W, 3] in [0, 1] (deterministic in (caption, seed, frames, size))."""
    cap = parse_caption(caption) if isinstance(caption, str) else caption
    h, w = size
    side = SHAPE_FRACTION * min(h, w)
    colour = np.array(COLOURS[cap.colour], dtype=np.float32)
    out = np.zeros((frames, h, w, 3), dtype=np.float32)
    for f, (cx, cy) in enumerate(path_centres(cap, seed, frames, size)):
        out[f] = shape_coverage(cap.shape, cx, cy, side, h, w)[..., None].astype(np.float32) * colour
    return out


# ------------------------------------------------------------------------------------------------ the request set

@dataclass(frozen=True)
class HeldOutRequest:
    caption: str
    seed: int


def _held_out_captions() -> list[Caption]:
    """16 captions, balanced (each colour 4 times, each direction 4 times, every shape and speed present), chosen by
    a fixed rule so the training split never sees them; "a red square moving right" (the demo) stays in training."""
    picked = []
    for i, (colour, direction) in enumerate(itertools.product(COLOURS, DIRECTIONS)):
        shape = SHAPES[(i + i // 4) % len(SHAPES)]
        speed = list(SPEEDS)[(i // 2) % len(SPEEDS)]
        picked.append(Caption(colour, shape, direction, speed))
    return picked


HELD_OUT: tuple[HeldOutRequest, ...] = tuple(HeldOutRequest(c.text, 1000 + i)
                                             for i, c in enumerate(_held_out_captions()))


def training_captions() -> list[Caption]:
    """Every caption of the grammar except the held-out ones (128 of 144)."""
    held = {r.caption for r in HELD_OUT}
    return [c for c in all_captions() if c.text not in held]
