"""PSNR / SSIM of a clip against the exact run on the same seed (scikit-image; `data_range` explicit; frames as
float in [0, 1] or uint8). PSNR is over the whole clip (inf when identical); SSIM is per frame (RGB, 7x7 window or
the largest odd one that fits), its mean and minimum reported."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageQuality:
    psnr_db: float
    ssim_mean: float
    ssim_min: float

    def to_dict(self) -> dict:
        return {"psnr_db": self.psnr_db if math.isfinite(self.psnr_db) else "inf",
                "ssim_mean": self.ssim_mean, "ssim_min": self.ssim_min}


def _pair(exact: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(exact), np.asarray(other)
    if a.shape != b.shape:
        raise ValueError(f"PSNR / SSIM need equal shapes: exact {a.shape} vs other {b.shape}")
    to01 = lambda x: x.astype(np.float64) / 255.0 if x.dtype == np.uint8 else x.astype(np.float64)
    return to01(a), to01(b)


def psnr(exact: np.ndarray, other: np.ndarray, data_range: float = 1.0) -> float:
    """10 log10(data_range^2 / MSE) over every value; inf when identical."""
    from skimage.metrics import peak_signal_noise_ratio
    a, b = _pair(exact, other)
    if np.array_equal(a, b):
        return math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(peak_signal_noise_ratio(a, b, data_range=data_range))


def ssim(exact: np.ndarray, other: np.ndarray, data_range: float = 1.0) -> list[float]:
    """Per-frame SSIM of [F, H, W, 3] clips (or one [H, W, 3] image: a list of one)."""
    from skimage.metrics import structural_similarity
    a, b = _pair(exact, other)
    if a.ndim == 3:
        a, b = a[None], b[None]
    m = min(a.shape[1:3])
    win = min(7, m if m % 2 else m - 1)
    return [float(structural_similarity(a[t], b[t], data_range=data_range, channel_axis=-1, win_size=win))
            for t in range(a.shape[0])]


def video_quality(exact: np.ndarray, other: np.ndarray, data_range: float = 1.0) -> ImageQuality:
    s = ssim(exact, other, data_range)
    return ImageQuality(psnr(exact, other, data_range), float(np.mean(s)), float(min(s)))
