"""wan's serving hooks (`FamilyEntry.media` / `request_from_fields` / `request_defaults`): the instance's own VAE
decodes through the engine's "vae_decode" loop (batched across requests) after WanPipeline's de-normalisation
latents / (1 / std) + mean; clips play at 16 fps (the Wan pipelines' export default); a conditioning image rides in
the request (the denoise loop encodes it). A Wan 2.1 I2V model with an image encoder computes the request's
`image_embeds` from the original image (before the resize) with it, through the engine's content-keyed CLIP cache
(`processor_options` hands the same encoder to the processor)."""

from __future__ import annotations

from typing import Any

import torch

from manifests.wan.sampling import WanGenerateRequest
from optimized.runtime.family import RequestCost
from optimized.serving.families import MediaChain, RequestFields, ServingError, latent_stats, resize_image

FPS = 16.0
SOLVER_COPIES = 6       # latents held by a denoise request: x, the initial noise, the velocity, solver history
ACTIVATION_WIDTHS = 12  # hidden-size activations alive at a DiT block's widest (q, k, v, attention out, MLP in...)


def video_phase_bytes(vae_cfg: Any, latent_shape: tuple[int, ...], frames: int, height: int, width: int,
                      vae_itemsize: int, held: int) -> dict[str, int]:
    """Peak bytes of the decode and artifact phases of one clip through a chunked Wan VAE, from sizes alone:
    decode = the latents held + the largest one-latent-frame chunk (`chunk_bytes`) + the decoded video so far (in
    the VAE dtype); artifact = the decoded float video + its uint8 frames + the writer's float / uint8 copies."""
    from optimized.models.wan.vae_loops import chunk_bytes
    _, _, h, w = latent_shape
    pixels = 3 * frames * height * width
    decoded = pixels * vae_itemsize
    decode = held + chunk_bytes(vae_cfg, 1, 1, h, w, vae_itemsize, decode=True) + decoded
    artifact = decoded + 2 * (pixels * 4 + pixels)   # to_uint8 (float32 + uint8), then the writer's copy of both
    return {"decode": decode, "artifact": artifact}


def request_cost(engine: Any, request: Any, phases: tuple[str, ...]) -> RequestCost | None:
    """A WanGenerateRequest's peak bytes by phase, from its fields (None for other requests or unusable fields:
    the request's validation refuses those)."""
    if not isinstance(request, WanGenerateRequest):
        return None
    cfg = engine.model.cfg
    try:
        C, T, h, w = (int(v) for v in request.latent_shape(cfg))
        frames, height, width = int(request.num_frames), int(request.height), int(request.width)
        branches = 2 if request.uses_cfg else 1
    except (TypeError, ValueError, ArithmeticError):
        return None
    if min(C, T, h, w, frames, height, width) <= 0:
        return None
    elem = engine.model.dtype.itemsize
    pt, ph, pw = cfg.dit.patch_size
    tokens = (T // pt) * (h // ph) * (w // pw)
    held = C * T * h * w * 4 * SOLVER_COPIES
    dit = cfg.dit if cfg.dit_2 is None else max(cfg.dit, cfg.dit_2, key=lambda d: d.hidden_size)
    step = branches * tokens * (dit.hidden_size * ACTIVATION_WIDTHS + dit.ffn_dim * 2) * elem
    out = {"denoise": held + step}
    if "decode" in phases or "artifact" in phases:
        out.update(video_phase_bytes(cfg.vae, (C, T, h, w), frames, height, width, engine.model.vae.dtype.itemsize,
                                     C * T * h * w * 4))
    return RequestCost({k: v for k, v in out.items() if k in phases}, ("num_frames", "height", "width"))


def image_encoder_of(engine: Any):
    """images -> [B, N, image_dim]: the model's CLIP image encoder; None when its DiT has no image branch. A DiT with
    an image branch but no encoder (a model directory converted without image_encoder/) refuses an image."""
    model = engine.model
    if not model.cfg.dit.has_image_branch:
        return None
    if getattr(model, "image_encoder", None) is not None:
        return model.encode_image

    def missing(images):
        raise ServingError("image: this Wan 2.1 I2V model has no image encoder (its model directory was converted "
                           "without the pipeline's image_encoder/ and image_processor/): reconvert the pipeline root "
                           "with fvconvert wan --from diffusers, or pass image_embeds in a request")
    return missing


def processor_options(engine: Any) -> dict:
    """What the processor's build_request takes from the loaded model: its image encoder (2.1 I2V)."""
    encode = image_encoder_of(engine)
    return {} if encode is None else {"encode_image": encode}


def request_from_fields(engine: Any, f: RequestFields) -> WanGenerateRequest:
    f = f.filled(dict(engine.family.request_defaults))   # the entry says what an unset field means
    cfg = engine.model.cfg
    negative = f.negative_text_ids
    if negative is None and f.guidance_scale > 1.0:  # an empty negative prompt still runs CFG (upstream "")
        negative = torch.zeros(1, dtype=torch.int64)
    image = f.image if cfg.task in ("i2v", "ti2v") else None
    if f.image is not None and image is None:
        raise ServingError(f"image: this wan {cfg.task} model takes no image")
    embeds = None
    encode = image_encoder_of(engine)
    if image is not None and encode is not None:   # the upload as given, before the resize (upstream encode_image)
        from optimized.models.wan.processor import WanProcessor
        embeds = encode([WanProcessor.clip_source(image, signed=True)])[0]   # fields carry [-1, 1] images
    if image is not None and tuple(image.shape[1:]) != (f.height, f.width):
        image = resize_image(image, f.height, f.width)
    return WanGenerateRequest(text_ids=f.text_ids, negative_text_ids=negative, num_frames=f.num_frames,
                              height=f.height, width=f.width, num_steps=f.num_steps,
                              guidance_scale=float(f.guidance_scale), seed=f.seed, image=image, image_embeds=embeds)


def media(engine: Any) -> MediaChain:
    vae = engine.model.vae

    def decode_request(rid: str, latents: torch.Tensor):
        from optimized.models.wan.vae_loops import DecodeRequest
        x = latents.to(torch.float32)
        mean, std = latent_stats(vae.cfg, x)
        return DecodeRequest(rid, (x / (1.0 / std) + mean).to(vae.dtype))  # divide by the reciprocal std (upstream)

    return MediaChain(vae, engine.loop("vae_decode"), None, decode_request, None, None, fps=lambda r: FPS)


__all__ = ["FPS", "image_encoder_of", "media", "processor_options", "request_cost", "request_from_fields", "video_phase_bytes"]
