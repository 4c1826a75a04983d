"""ltx2 forward inputs: the LTX2VideoTransformer3DModel.forward tensor arguments, seeded. Upstream (fvparity align) and both
sides are called with these by name, so keep the upstream names.

The RoPE coordinates are passed as tensors, as LTX2Pipeline does (it builds them once with the transformer's
`rope.prepare_video_coords` / `audio_rope.prepare_audio_coords`); they are rebuilt here by the same arithmetic so
that the positions are realistic. The video timestep is per token (the image-to-video shape, (B, N_video)), the
audio one per sample ((B,)), so both modulation broadcasts are exercised; the text masks pad the second sample;
`sigma` / `audio_sigma` differ, so a side that reads one for the other fails.
"""

from __future__ import annotations

import torch

from manifests.ltx2 import Ltx2Config

VIDEO_GRID = (2, 2, 3)      # latent frames, height, width (patch size 1: one token each)
AUDIO_FRAMES = 5
TEXT_LEN = 6
FPS = 24.0


def video_coords(cfg: Ltx2Config, batch: int, grid: tuple[int, int, int] = VIDEO_GRID,
                 fps: float = FPS) -> torch.Tensor:
    """[B, 3, N, 2] pixel-space [start, end) per token: frames in seconds (causal first frame), rows, columns."""
    sizes = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
    axes = [torch.arange(0, n, p, dtype=torch.float32) for n, p in zip(grid, sizes)]
    start = torch.stack(torch.meshgrid(*axes, indexing="ij"), 0).flatten(1)            # [3, N]
    latent = torch.stack([start, start + torch.tensor(sizes, dtype=torch.float32)[:, None]], -1)
    pixel = latent * torch.tensor(cfg.vae_scale_factors, dtype=torch.float32)[:, None, None]
    pixel[0] = (pixel[0] + cfg.causal_offset - cfg.vae_scale_factors[0]).clamp(min=0) / fps
    return pixel[None].repeat(batch, 1, 1, 1)


def audio_coords(cfg: Ltx2Config, batch: int, frames: int = AUDIO_FRAMES) -> torch.Tensor:
    """[B, 1, N, 2] [start, end) of each audio latent in seconds (mel frames * hop / rate, causal first frame)."""
    f, s = torch.arange(0, frames, cfg.audio_patch_size_t, dtype=torch.float32), cfg.audio_scale_factor
    def seconds(mel):
        return (mel + cfg.causal_offset - s).clip(min=0) * cfg.audio_hop_length / cfg.audio_sampling_rate
    bounds = torch.stack([seconds(f * s), seconds((f + cfg.audio_patch_size_t) * s)], -1)
    return bounds[None, None].expand(batch, 1, -1, -1).contiguous()


def make_inputs(cfg: Ltx2Config, seed: int, batch: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_video = VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2]
    mask = torch.ones(batch, TEXT_LEN)
    mask[1:, TEXT_LEN - 2:] = 0.0
    return {
        "hidden_states": torch.randn(batch, n_video, cfg.in_channels, generator=g),
        "audio_hidden_states": torch.randn(batch, AUDIO_FRAMES, cfg.audio_in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, cfg.caption_channels, generator=g),
        "audio_encoder_hidden_states": torch.randn(batch, TEXT_LEN, cfg.caption_channels, generator=g),
        "timestep": torch.rand(batch, n_video, generator=g) * 1000,
        "audio_timestep": torch.rand(batch, generator=g) * 1000,
        "encoder_attention_mask": mask,
        "audio_encoder_attention_mask": mask.clone(),
        "video_coords": video_coords(cfg, batch),
        "audio_coords": audio_coords(cfg, batch),
        # the text keys / values' modulation (LTX-2.3 configs; 2.0 ignores them), drawn last: earlier draws unchanged
        "sigma": torch.rand(batch, generator=g),
        "audio_sigma": torch.rand(batch, generator=g),
        # tokens of the first latent frame (a single pixel frame: the causal VAE's first) take LTX-2.5's keyframe
        # embedding; the second sample marks none
        "video_keyframes_mask": first_frame_marker(batch),
    }


def first_frame_marker(batch: int) -> torch.Tensor:
    per_frame = VIDEO_GRID[1] * VIDEO_GRID[2]
    marker = torch.zeros(batch, VIDEO_GRID[0] * per_frame, 1)
    marker[0, :per_frame] = 1.0
    return marker
