"""The cosmos3 media chain around the diffusion model on the runtime: the Wan2.2 VAE (z48) encode of a conditioning
clip into normalised latents, and the decode of generated latents into video (+ the sound decoder for sound latents).
Both VAE directions are the chunked `wan.vae_encode` / `wan.vae_decode` loops, driven by the WorkUnit scheduler."""

from __future__ import annotations

from typing import Callable

import torch

from optimized.models.cosmos3.sound import FastSoundDecoder
from optimized.models.wan.vae_loops import DecodeRequest, EncodeRequest, WanVaeDecodeKernel, WanVaeEncodeKernel
from optimized.runtime.scheduler import run_request, stream_request


def _stats(cfg, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1).to(like)
    std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1).to(like)
    return mean, std


def decode_cosmos3_outputs(vae, sound: FastSoundDecoder | None, vision_latents: torch.Tensor,
                   sound_latents: torch.Tensor | None = None, chunk_frames: int = 1,
                   memory_budget_bytes: int = 8 << 30, on_chunk: Callable | None = None):
    """De-normalise vision latents (z * std + mean, per channel), decode them through the chunked `wan.vae_decode`
    loop (`vae` is an optimized.models.wan.FastWanVAE; each chunk runs only when its declared memory fits
    `memory_budget_bytes`; `on_chunk(event)` sees every VideoChunkEvent), and decode sound.
    Returns (video [B, 3, T, H, W] in [-1, 1], waveform or None)."""
    mean, std = _stats(vae.cfg, vision_latents)
    gen = stream_request(WanVaeDecodeKernel(vae), DecodeRequest("cosmos3", vision_latents * std + mean, chunk_frames),
                         memory_budget_bytes=memory_budget_bytes)
    while True:
        try:
            event = next(gen)
        except StopIteration as stop:
            video = stop.value
            break
        if on_chunk is not None:
            on_chunk(event)
    audio = None if sound_latents is None or sound is None else sound.decode(sound_latents)
    return video, audio


def encode_cosmos3_condition(vae, video: torch.Tensor, chunk_frames: int = 1, memory_budget_bytes: int = 8 << 30):
    """The conditioning seam (image-to-video / video-to-video): a clip [B, 3, 4k+1, H, W] in [-1, 1] -> the
    diffusion model's latents [B, z, 1+k, H/16, W/16]: the posterior mean of the chunked `wan.vae_encode` loop
    (`vae` is an optimized.models.wan.FastWanVAE), normalised per channel as (mu - latents_mean) / latents_std
    (upstream `Cosmos3OmniPipeline._encode_video`: argmax of the posterior, no sampling)."""
    mu = run_request(WanVaeEncodeKernel(vae), EncodeRequest("cosmos3-condition", video, chunk_frames),
                     memory_budget_bytes=memory_budget_bytes).mean
    mean, std = _stats(vae.cfg, mu)
    return (mu - mean) / std
