"""wan's serving hooks (`FamilyEntry.media` / `request_from_fields` / `request_defaults`): the instance's own VAE
decodes through the engine's "vae_decode" loop (batched across requests) after WanPipeline's de-normalisation
latents / (1 / std) + mean; clips play at 16 fps (the Wan pipelines' export default); a conditioning image rides in
the request (the denoise loop encodes it)."""

from __future__ import annotations

from typing import Any

import torch

from manifests.wan.sampling import WanGenerateRequest
from optimized.serving.families import MediaChain, RequestFields, ServingError, latent_stats, resize_image

FPS = 16.0


def request_from_fields(engine: Any, f: RequestFields) -> WanGenerateRequest:
    f = f.filled(dict(engine.family.request_defaults))   # the entry says what an unset field means
    cfg = engine.model.cfg
    negative = f.negative_text_ids
    if negative is None and f.guidance_scale > 1.0:  # an empty negative prompt still runs CFG (upstream "")
        negative = torch.zeros(1, dtype=torch.int64)
    image = f.image if cfg.task in ("i2v", "ti2v") else None
    if f.image is not None and image is None:
        raise ServingError(f"image: this wan {cfg.task} model takes no image")
    if image is not None and tuple(image.shape[1:]) != (f.height, f.width):
        image = resize_image(image, f.height, f.width)
    return WanGenerateRequest(text_ids=f.text_ids, negative_text_ids=negative, num_frames=f.num_frames,
                              height=f.height, width=f.width, num_steps=f.num_steps,
                              guidance_scale=float(f.guidance_scale), seed=f.seed, image=image)


def media(engine: Any) -> MediaChain:
    vae = engine.model.vae

    def decode_request(rid: str, latents: torch.Tensor):
        from optimized.models.wan.vae_loops import DecodeRequest
        x = latents.to(torch.float32)
        mean, std = latent_stats(vae.cfg, x)
        return DecodeRequest(rid, (x / (1.0 / std) + mean).to(vae.dtype))  # divide by the reciprocal std (upstream)

    return MediaChain(vae, engine.loop("vae_decode"), None, decode_request, None, None, fps=lambda r: FPS)


__all__ = ["FPS", "media", "request_from_fields"]
