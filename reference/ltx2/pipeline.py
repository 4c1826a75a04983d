"""ltx2 reference pipeline: `LTX2Pipeline.__call__` (diffusers 0.42.1) from the text encoder's hidden states to
the video and audio latents, as a plain for loop with explicit CFG (the contract: manifests/ltx2/sampling.py).

    hidden states -> connectors -> noise (video, then audio) -> for each sigma: DiT on [uncond, cond] -> x0 ->
    guided x0 (+ rescale) -> velocity -> Euler -> unpack + de-normalise

`trace(name, tensor)` gets `connectors.video` / `connectors.audio`, and per step `step.<i>.video` / `.audio` (the
packed latents after step i), so C1 names the first step that diverges.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from manifests.ltx2 import Ltx2Config
from manifests.ltx2.sampling import Ltx2Media, Ltx2Request, Ltx2SchedulerConfig


def sigma_schedule(steps: int, video_tokens: int, s: Ltx2SchedulerConfig) -> torch.Tensor:
    """[steps + 1] float32: FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=linspace(1, 1/n, n), mu), in numpy
    float32 as upstream computes it, then the terminal 0."""
    sigmas = np.linspace(1.0, 1 / steps, steps).astype(np.float32)
    slope = (s.max_shift - s.base_shift) / (s.max_image_seq_len - s.base_image_seq_len)
    mu = video_tokens * slope + (s.base_shift - slope * s.base_image_seq_len)
    sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)       # exponential time shift, sigma 1
    if s.shift_terminal:
        one_minus = 1 - sigmas
        sigmas = 1 - one_minus / (one_minus[-1] / (1 - s.shift_terminal))   # stretched: the last is shift_terminal
    return torch.cat([torch.from_numpy(sigmas).to(torch.float32), torch.zeros(1)])


def video_coords(cfg: Ltx2Config, batch: int, grid: tuple[int, int, int], fps: float) -> torch.Tensor:
    """[B, 3, N, 2] pixel-space [start, end) per latent token (rope.prepare_video_coords): frames in seconds with the
    causal first frame (shifted by causal_offset - 8, clamped at 0), rows and columns in pixels."""
    f, h, w = (torch.arange(n, dtype=torch.float32) for n in grid)
    start = torch.stack(torch.meshgrid(f, h, w, indexing="ij"), 0).flatten(1)         # [3, N] latent units
    scale = torch.tensor(cfg.vae_scale_factors, dtype=torch.float32)[:, None, None]
    pixel = torch.stack([start, start + 1], -1) * scale
    pixel[0] = (pixel[0] + cfg.causal_offset - cfg.vae_scale_factors[0]).clamp(min=0) / fps
    return pixel[None].repeat(batch, 1, 1, 1)


def audio_coords(cfg: Ltx2Config, batch: int, frames: int) -> torch.Tensor:
    """[B, 1, L, 2] [start, end) of each audio latent in seconds (audio_rope.prepare_audio_coords)."""
    mel = torch.arange(frames, dtype=torch.float32) * cfg.audio_scale_factor
    def seconds(m):
        return (m + cfg.causal_offset - cfg.audio_scale_factor).clip(min=0) * cfg.audio_hop_length \
            / cfg.audio_sampling_rate
    return torch.stack([seconds(mel), seconds(mel + cfg.audio_scale_factor)], -1)[None, None].repeat(batch, 1, 1, 1)


def rescale(guided: torch.Tensor, cond: torch.Tensor, factor: float) -> torch.Tensor:
    """rescale_noise_cfg: the guided prediction scaled to the conditional one's per-sample std, mixed by factor."""
    dims = list(range(1, guided.ndim))
    scaled = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return factor * scaled + (1 - factor) * guided


def generate_latents(transformer, connectors, request: Ltx2Request, prompt_embeds: torch.Tensor,
                     prompt_mask: torch.Tensor, negative_embeds: torch.Tensor | None,
                     negative_mask: torch.Tensor | None, stats: dict[str, torch.Tensor], media: Ltx2Media,
                     scheduler: Ltx2SchedulerConfig, trace=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (video latents [B, C, F, H, W], audio latents [B, C, L, M]), de-normalised (output_type="latent").
    `stats`: video_mean / video_std [C] (video VAE latents_mean / std) and audio_mean / audio_std [C * M]."""
    record = trace or (lambda name, t: None)
    request.validate(media)
    cfg: Ltx2Config = transformer.cfg
    batch = prompt_embeds.shape[0]
    cfg_on = request.do_cfg

    # 1. text: [uncond, cond] through the connectors (Gemma's left padding)
    embeds, mask = prompt_embeds, prompt_mask
    if cfg_on:
        embeds, mask = torch.cat([negative_embeds, prompt_embeds]), torch.cat([negative_mask, prompt_mask])
    video_text, audio_text, text_mask = connectors(embeds, mask, padding_side="left")
    record("connectors.video", video_text)
    record("connectors.audio", audio_text)

    # 2. noise from one generator: video first, then audio; packed to tokens (patch size 1)
    frames, height, width = request.latent_grid(media)
    audio_frames = request.audio_frames(media)
    mel = media.mel_bins // media.mel_compression
    gen = torch.Generator().manual_seed(request.seed)
    video = torch.randn(batch, media.latent_channels, frames, height, width, generator=gen)
    video = video.permute(0, 2, 3, 4, 1).flatten(1, 3)                         # [B, F*H*W, C]
    audio = torch.randn(batch, media.audio_latent_channels, audio_frames, mel, generator=gen)
    audio = audio.transpose(1, 2).flatten(2, 3)                                # [B, L, C*M]

    # 3. schedule (the audio stream steps on an identical copy), positions
    sigmas = sigma_schedule(request.num_inference_steps, video.shape[1], scheduler)
    timesteps = sigmas[:-1] * scheduler.num_train_timesteps
    copies = 2 if cfg_on else 1
    v_coords = video_coords(cfg, batch * copies, (frames, height, width), request.frame_rate)
    a_coords = audio_coords(cfg, batch * copies, audio_frames)

    # 4. the loop
    for i, t in enumerate(timesteps):
        sigma = sigmas[i]
        t_in = t.expand(batch * copies)
        # both streams get t (so upstream's use_cross_timestep changes nothing); sigma=t feeds LTX-2.3's modulation
        v_pred, a_pred = transformer(
            hidden_states=torch.cat([video] * copies), audio_hidden_states=torch.cat([audio] * copies),
            encoder_hidden_states=video_text, audio_encoder_hidden_states=audio_text, timestep=t_in,
            encoder_attention_mask=text_mask, audio_encoder_attention_mask=text_mask,
            video_coords=v_coords, audio_coords=a_coords, sigma=t_in)
        new = []
        for x, pred, g, r in ((video, v_pred.float(), request.guidance_scale, request.guidance_rescale),
                              (audio, a_pred.float(), request.audio_guidance, request.audio_rescale)):
            if cfg_on:
                uncond, cond = pred.chunk(2)
                x0_cond, x0_uncond = x - cond * sigma, x - uncond * sigma
                guided = x0_cond + (g - 1) * (x0_cond - x0_uncond)           # the delta form (upstream)
            else:
                x0_cond = guided = x - pred * sigma
            if r > 0:
                guided = rescale(guided, x0_cond, r)
            velocity = (x - guided) / sigma
            new.append(x.float() + (sigmas[i + 1] - sigma) * velocity)        # Euler, in fp32
        video, audio = new
        record(f"step.{i}.video", video)
        record(f"step.{i}.audio", audio)

    # 5. unpack and de-normalise (video after unpacking, audio before: upstream's order)
    video = video.reshape(batch, frames, height, width, -1).permute(0, 4, 1, 2, 3)
    video = video * stats["video_std"].view(1, -1, 1, 1, 1) + stats["video_mean"].view(1, -1, 1, 1, 1)
    audio = audio * stats["audio_std"] + stats["audio_mean"]
    audio = audio.unflatten(2, (-1, mel)).transpose(1, 2)
    return video, audio
