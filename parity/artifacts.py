"""Decoded-artifact comparison shared by every family's C4: SSIM / PSNR of frames (scikit-image, `data_range`
explicit), SNR of waveforms, and the written artifacts (PNG frames, WAV) read back from disk."""

from __future__ import annotations

import math
import warnings
import wave
from pathlib import Path

import numpy as np
import torch


def frames01(video: torch.Tensor) -> np.ndarray:
    """[1, 3, T, H, W] in [-1, 1] -> float64 [T, H, W, 3] in [0, 1] (the diffusers video processor's mapping)."""
    v = video[0] if video.ndim == 5 else video
    return ((v.detach().double().cpu().clamp(-1, 1) + 1) / 2).permute(1, 2, 3, 0).numpy()


def _psnr(want: np.ndarray, got: np.ndarray, data_range: float) -> float:
    from skimage.metrics import peak_signal_noise_ratio
    with warnings.catch_warnings(), np.errstate(divide="ignore"):
        warnings.simplefilter("ignore")
        return float(peak_signal_noise_ratio(want, got, data_range=data_range))  # inf when identical


def video_similarity(want: np.ndarray, got: np.ndarray, data_range: float) -> dict:
    """Per-frame SSIM (RGB, 7x7 uniform window, `data_range` explicit) and PSNR over the whole clip."""
    from skimage.metrics import structural_similarity
    if want.shape != got.shape:
        return {"ssim_min": -1.0, "ssim_mean": -1.0, "psnr_db": -math.inf, "ssim_per_frame": [],
                "shape_mismatch": f"{list(got.shape)} vs {list(want.shape)}"}
    a, b = want.astype(np.float64), got.astype(np.float64)
    m = min(a.shape[1:3])
    win = min(7, m if m % 2 else m - 1)  # skimage's default 7, or the largest odd size that fits
    ssim = [float(structural_similarity(a[t], b[t], data_range=data_range, channel_axis=-1, win_size=win))
            for t in range(a.shape[0])]
    return {"ssim_min": min(ssim), "ssim_mean": float(np.mean(ssim)), "psnr_db": _psnr(a, b, data_range),
            "ssim_per_frame": ssim}


def snr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    """10 log10(sum want^2 / sum (got - want)^2); inf when identical, -inf on a shape mismatch."""
    if tuple(want.shape) != tuple(got.shape):
        return -math.inf
    w, d = want.double(), (got.double() - want.double())
    noise, signal = float((d * d).sum()), float((w * w).sum())
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def fmt_db(x: float) -> str:
    return "inf" if math.isinf(x) and x > 0 else f"{x:.1f}"


def read_png_frames(directory: Path) -> np.ndarray:
    from PIL import Image
    files = sorted(directory.glob("frame_*.png"))
    return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files]) if files else np.zeros((0,))


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """-> int16 [channels, N], sample rate."""
    with wave.open(str(path), "rb") as w:
        n, c, rate = w.getnframes(), w.getnchannels(), w.getframerate()
        pcm = np.frombuffer(w.readframes(n), dtype="<i2").reshape(n, c).T.copy()
    return pcm, rate


def write_and_read_back(out, directory: Path, sample_rate: int | None) -> dict:
    """Write `out.video` [1, 3, T, H, W] (and `out.audio` [channels, N]) with the runtime's atomic writers, read them
    back; the expected quantised tensors and any temp files left behind come with them."""
    from optimized.runtime import artifacts
    got = {"frames_dir": artifacts.write_png_frames(out.video, directory / "frames")}
    got["frames"] = read_png_frames(got["frames_dir"])
    got["frames_expected"] = artifacts.to_uint8_frames(out.video).numpy()
    if out.audio is not None and sample_rate is not None:
        path = artifacts.write_wav(out.audio, directory / "audio.wav", sample_rate)
        got["pcm"], got["rate"] = read_wav(path)
        got["pcm_expected"] = (out.audio.detach().float().cpu().clamp(-1, 1) * 32767).round().to(torch.int16).numpy()
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".")]
    got["leftovers"] = leftovers
    return got


def png_frames_check(prefix: str, files: dict, bounds: dict, frame_tol):
    """The PNG frames both sides wrote, read back (uint8, data_range 255): SSIM min and PSNR within `bounds`."""
    from parity.report import CheckResult
    a, b = files["reference"]["frames"], files["optimized"]["frames"]
    sim8 = video_similarity(a, b, 255.0)
    ok = "shape_mismatch" not in sim8 and sim8["ssim_min"] >= bounds["min_ssim"] and \
        sim8["psnr_db"] >= bounds["min_psnr"]
    diff = int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max()) if a.shape == b.shape else -1
    c = CheckResult(f"{prefix}/png_frames", ok, None, frame_tol, divergence=None if ok else "see frames",
                    detail=f"uint8 PNG read-back: SSIM min {sim8['ssim_min']:.6f}, PSNR {fmt_db(sim8['psnr_db'])} dB"
                           f" (data_range 255), max |diff| {diff} levels")
    c.extra = {"ssim_min": sim8["ssim_min"], "psnr_db": str(sim8["psnr_db"]), "max_level_diff": diff}
    return c
