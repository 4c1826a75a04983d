"""Decoded media on disk, written atomically: a temp file (or temp directory) beside the target, then a rename.
A failed or cancelled write leaves nothing at the target path.

  write_png_frames(video, dir)    video [3, T, H, W] (or [1, 3, T, H, W]) in [-1, 1] -> dir/frame_00000.png ...
  write_wav(audio, path, rate)    audio [C, N] in [-1, 1] -> 16-bit PCM WAV (standard library `wave`)
  write_mp4(video, path, fps)     needs the optional video extra (`imageio-ffmpeg`, which ships an ffmpeg binary)
  FrameSink                       streaming: frames chunk by chunk into a temp dir, committed (renamed) at the end

PNG is encoded with the standard library (zlib + CRC chunks): 8-bit RGB, no filter, no extra dependency.
Pixel mapping (the diffusers video processor's): uint8 = round((x + 1) / 2 * 255) after clamping to [-1, 1].
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import wave
import zlib
from pathlib import Path

import torch


class ArtifactError(RuntimeError):
    """Bad media tensor or a failed write; nothing was left at the target."""


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """[3, T, H, W] or [1, 3, T, H, W] float in [-1, 1] -> uint8 [T, H, W, 3]."""
    if video.ndim == 5:
        if video.shape[0] != 1:
            raise ArtifactError(f"one video at a time, got a batch of {video.shape[0]}")
        video = video[0]
    if video.ndim != 4 or video.shape[0] != 3:
        raise ArtifactError(f"video must be [3, T, H, W], got {list(video.shape)}")
    if not torch.isfinite(video).all():
        raise ArtifactError("video holds NaN or Inf values; nothing written")
    x = ((video.detach().float().cpu().clamp(-1, 1) + 1) / 2 * 255).round().to(torch.uint8)
    return x.permute(1, 2, 3, 0).contiguous()


def png_bytes(rgb: torch.Tensor) -> bytes:
    """uint8 [H, W, 3] -> PNG file bytes."""
    H, W, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].numpy().tobytes() for y in range(H))  # filter type 0 per row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def current_umask() -> int:
    """The process umask, read without changing it where the OS says it (os.umask would set it, racing threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | Path, directory: bool = False) -> None:
    """Give a tempfile-made file (0600) or directory (0700) the permissions any other written file gets: 0666 (0777)
    less the umask."""
    os.chmod(path, (0o777 if directory else 0o666) & ~current_umask())


def _atomic_write_bytes(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        honour_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class FrameSink:
    """Write PNG frames as chunks arrive into a hidden temp directory; `commit()` renames it to `out_dir`,
    `abort()` (or leaving the `with` block on an exception) removes it. `out_dir` must not exist yet."""

    def __init__(self, out_dir: str | Path, prefix: str = "frame_"):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists():
            raise ArtifactError(f"{self.out_dir} already exists; refusing to overwrite")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.out_dir.parent, prefix=f".{self.out_dir.name}.", suffix=".tmp"))
        honour_umask(self.tmp, directory=True)
        self.prefix, self.count, self.done = prefix, 0, False

    def add(self, video_chunk: torch.Tensor) -> None:
        for rgb in to_uint8_frames(video_chunk):
            (self.tmp / f"{self.prefix}{self.count:05d}.png").write_bytes(png_bytes(rgb))
            self.count += 1

    def commit(self) -> Path:
        os.replace(self.tmp, self.out_dir)
        self.done = True
        return self.out_dir

    def abort(self) -> None:
        if not self.done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.done = True

    def __enter__(self) -> "FrameSink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self.done:
            self.commit()


def write_png_frames(video: torch.Tensor, out_dir: str | Path, prefix: str = "frame_") -> Path:
    frames = to_uint8_frames(video)  # validate before touching the disk
    with FrameSink(out_dir, prefix) as sink:
        for rgb in frames:
            (sink.tmp / f"{prefix}{sink.count:05d}.png").write_bytes(png_bytes(rgb))
            sink.count += 1
    return Path(out_dir)


def write_wav(audio: torch.Tensor, path: str | Path, sample_rate: int) -> Path:
    """[C, N] (or [1, C, N]) float in [-1, 1] -> 16-bit PCM WAV, interleaved channels."""
    if audio.ndim == 3 and audio.shape[0] == 1:
        audio = audio[0]
    if audio.ndim != 2 or audio.shape[0] < 1:
        raise ArtifactError(f"audio must be [channels, samples], got {list(audio.shape)}")
    if not torch.isfinite(audio).all():
        raise ArtifactError("audio holds NaN or Inf values; nothing written")
    pcm = (audio.detach().float().cpu().clamp(-1, 1) * 32767).round().to(torch.int16).T.contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with wave.open(tmp, "wb") as w:
            w.setnchannels(audio.shape[0])
            w.setsampwidth(2)
            w.setframerate(int(sample_rate))
            w.writeframes(pcm.numpy().astype("<i2").tobytes())
        honour_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def ffmpeg_exe() -> str | None:
    """The ffmpeg binary of the optional video extra (`imageio-ffmpeg`), or None when it is not installed."""
    try:
        import imageio_ffmpeg  # optional extra
    except ImportError:
        return None
    try:
        return imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError:
        return None


def write_mp4(video: torch.Tensor, path: str | Path, fps: float = 24.0) -> Path:
    """H.264 MP4 through ffmpeg (yuv420p: H and W are padded to even sizes by ffmpeg's scale filter)."""
    exe = ffmpeg_exe()
    if exe is None:
        raise ArtifactError("MP4 needs the optional video extra: pip install imageio-ffmpeg")
    frames = to_uint8_frames(video)
    T, H, W, _ = frames.shape
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".mp4")
    os.close(fd)
    cmd = [exe, "-y", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{W}x{H}", "-r", str(fps),
           "-i", "-", "-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2", "-c:v", "libx264", "-pix_fmt", "yuv420p", tmp]
    try:
        proc = subprocess.run(cmd, input=frames.numpy().tobytes(), capture_output=True)
        if proc.returncode != 0:
            raise ArtifactError(f"ffmpeg failed: {proc.stderr.decode(errors='replace')[-500:]}")
        honour_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
