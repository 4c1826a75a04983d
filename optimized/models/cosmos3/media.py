"""cosmos3's serving hooks (`FamilyEntry.media` / `request_from_fields` / `request_defaults` / `processor_options`).

The resident instance is the transformer; its media chain is a Wan2.2-geometry VAE (diffusers AutoencoderKLWan) and,
when the model makes sound, the AVAE sound decoder, found in this order:
  1. components given with `optimized.serving.attach_media(engine, vae=..., sound=...)`;
  2. the model directory the engine was loaded from (`fvconvert cosmos3 --from diffusers <pipeline root>`: its
     "vae" and "sound_tokenizer" components; `Engine.from_checkpoint` builds the chain at once);
  3. for random-weight variants only, a seeded tiny VAE with z_dim = latent_channels.
Latents are de-normalised z * std + mean; clips play at the request's fps; an image is repeated over the clip,
encoded by the chunked VAE encode loop (a scheduled stage), normalised, and conditions latent frame 0.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from manifests.cosmos3.sampling import Cosmos3GenerateRequest, video_request
from optimized.runtime.family import RequestCost
from optimized.serving.families import (MediaChain, RequestFields, ServingError, attached_media, latent_stats,
                                        resize_image)

RANDOM_VAE_SEED = 1
SOLVER_COPIES = 4       # latents held by a denoise request: x + the UniPC history (loops.py admission)
ACTIVATION_WIDTHS = 8   # hidden-size activations alive per token at a layer's widest (loops.py plan_step)


def request_cost(engine: Any, request: Any, phases: tuple[str, ...]) -> RequestCost | None:
    """A Cosmos3GenerateRequest's peak bytes by phase, from its fields (None for other requests or unusable fields:
    the request's validation refuses those). Decode / artifact are costed when the engine has its media VAE."""
    from optimized.models.wan.media import video_phase_bytes
    if not isinstance(request, Cosmos3GenerateRequest):
        return None
    cfg = engine.model.cfg
    try:
        T, h, w = int(request.latent_frames), int(request.latent_height), int(request.latent_width)
        texts = [int(request.text_ids.numel())] + ([int(request.negative_text_ids.numel())] if request.uses_cfg
                                                   else [])
        extra = int(request.sound_frames) + (int(request.action.chunk_size) if request.action else 0)
    except (TypeError, ValueError, AttributeError, ArithmeticError):
        return None
    if min(T, h, w) <= 0:
        return None
    C, p = cfg.latent_channels, cfg.patch_size
    gen = T * math.ceil(h / p) * math.ceil(w / p) + max(extra, 0)
    latents = C * T * h * w * 4
    step = (texts[0] + gen) * len(texts) * cfg.hidden_size * 4 * ACTIVATION_WIDTHS
    out = {"denoise": latents * SOLVER_COPIES + step}
    vae_cfg = _media_vae_config(engine) if "decode" in phases or "artifact" in phases else None
    if vae_cfg is not None:   # None: no media VAE (the program itself refuses to start)
        s, t = vae_cfg.spatial_compression, vae_cfg.temporal_compression
        out.update(video_phase_bytes(vae_cfg, (C, T, h, w), (T - 1) * t + 1, h * s, w * s, 4, latents))
    return RequestCost({k: v for k, v in out.items() if k in phases}, ("num_frames", "height", "width"))


def model_config(engine: Any) -> Any | None:
    """The whole-model config (`Cosmos3ModelConfig`) of the model directory the engine was loaded from, or None."""
    ckpt = engine.__dict__.get("checkpoint")
    return ckpt.typed_config() if ckpt is not None and ckpt.is_model else None


def processor_options(engine: Any) -> dict:
    """The loaded model's own request settings: its scheduler, and sound (sampling rate, hop) when it has a sound
    tokenizer and the transformer makes sound."""
    cfg = model_config(engine)
    if cfg is None:
        return {}
    opts: dict = {"scheduler": cfg.scheduler}
    if cfg.sound is not None and cfg.transformer.sound_dim is not None:
        opts["sound"] = (cfg.sound.sampling_rate, cfg.sound.hop)
    return opts


def request_from_fields(engine: Any, f: RequestFields) -> Cosmos3GenerateRequest:
    f = f.filled(dict(engine.family.request_defaults))   # the entry says what an unset field means
    negative = f.negative_text_ids if f.negative_text_ids is not None else torch.zeros(1, dtype=torch.int64)
    opts = processor_options(engine)
    kw = {"scheduler": opts["scheduler"]} if "scheduler" in opts else {}
    return video_request(engine.model.cfg, num_frames=f.num_frames, height=f.height, width=f.width,
                         text_ids=f.text_ids, negative_text_ids=negative, num_steps=f.num_steps,
                         guidance_scale=float(f.guidance_scale), seed=f.seed, **kw)


def random_wan_vae_state(vcfg: Any, seed: int) -> dict[str, torch.Tensor]:
    """Seeded VAE weights that decode to structured frames mostly inside [-1, 1] (norm gains 1 + 0.1r, biases 0.1r,
    weights r / sqrt(fan_in), the output conv halved)."""
    from manifests.wan import canonical_key_shapes
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in sorted(canonical_key_shapes(vcfg).items()):
        r = torch.randn(shape, generator=g)
        if k.endswith("gamma"):
            out[k] = 1 + 0.1 * r
        elif len(shape) == 1:
            out[k] = 0.1 * r
        else:
            out[k] = r / math.sqrt(math.prod(shape[1:])) * (0.5 if k == "decoder.conv_out.weight" else 1.0)
    return out


def cosmos3_media_vae_config(cfg: Any) -> Any:
    """The tiny Wan2.2-geometry VAE (manifests/wan tiny-2.2) with z_dim = the transformer's latent_channels and
    per-channel latents_mean / std that make a de-normalisation mistake visible."""
    from manifests.wan import load_variant
    z = cfg.latent_channels
    mean = tuple(round(0.3 * math.sin(1.7 * i + 0.3), 4) for i in range(z))
    std = tuple(round(1.0 + 0.5 * math.cos(2.3 * i), 4) for i in range(z))
    return replace(load_variant("tiny-2.2"), z_dim=z, latents_mean=mean, latents_std=std).validate()


def _media_vae_config(engine: Any) -> Any | None:
    """The media VAE's config by the order in the module doc, read without loading anything (admission is pure)."""
    chain = engine.__dict__.get("_media_chain")
    if chain is not None:
        return chain.vae.cfg
    attached = attached_media(engine).get("vae")
    if attached is not None:
        return attached.cfg
    cfg = model_config(engine)
    if cfg is not None:
        return cfg.vae
    if str(engine.model.weights_version or "").startswith("random:"):
        return cosmos3_media_vae_config(engine.model.cfg)
    return None


def _media_components(engine: Any) -> tuple[Any, Any, str | None]:
    """(vae, sound decoder | None, media weights version) by the order in the module doc."""
    from optimized.models.wan import load_fast_vae
    attached = attached_media(engine)
    if attached.get("vae") is not None:
        return attached["vae"], attached.get("sound"), attached.get("vae_version")
    device = str(engine.model.device)
    ckpt = engine.__dict__.get("checkpoint")
    if ckpt is not None and ckpt.is_model:
        from manifests.checkpoint import load_state
        cfg = ckpt.typed_config()
        vae = load_fast_vae(cfg.vae, load_state(ckpt, component="vae", check_finite=True), device=device)
        sound = None
        if cfg.sound is not None:
            from optimized.models.cosmos3.sound import load_fast_sound_decoder
            sound = load_fast_sound_decoder(cfg.sound, load_state(ckpt, component="sound_tokenizer",
                                                                  check_finite=True), device=device)
        return vae, sound, None     # part of the model directory: its weights_version covers them
    if not str(engine.model.weights_version or "").startswith("random:"):
        raise ServingError("cosmos3: this checkpoint holds the transformer only; convert the whole pipeline "
                           "(fvconvert cosmos3 --from diffusers <pipeline root> OUT) or attach its Wan2.2 VAE with "
                           "optimized.serving.attach_media(engine, vae=load_fast_vae(cfg, state))")
    vcfg = cosmos3_media_vae_config(engine.model.cfg)
    vae = load_fast_vae(vcfg, random_wan_vae_state(vcfg, RANDOM_VAE_SEED), device=device)
    return vae, None, f"random:wan-vae:{vcfg.version}:z{vcfg.z_dim}:{RANDOM_VAE_SEED}"


def media(engine: Any) -> MediaChain:
    from optimized.models.wan.vae_loops import DecodeRequest, EncodeRequest, WanVaeDecodeKernel, WanVaeEncodeKernel
    vae, sound, version = _media_components(engine)
    cfg = engine.model.cfg
    if vae.cfg.z_dim != cfg.latent_channels:
        raise ServingError(f"cosmos3: the VAE has z_dim {vae.cfg.z_dim}, the transformer latent_channels "
                           f"{cfg.latent_channels}")

    def decode_request(rid: str, latents: torch.Tensor):
        x = latents.to(torch.float32)
        mean, std = latent_stats(vae.cfg, x)
        return DecodeRequest(rid, (x * std + mean).to(vae.dtype))

    def encode_request(rid: str, image: torch.Tensor, request: Any, clip: torch.Tensor | None = None):
        if clip is not None:  # pixels already laid out as a clip (a processor's canvas)
            return EncodeRequest(rid, clip.to(engine.model.device, vae.dtype))
        T, h, w = request.latent_frames, request.latent_height, request.latent_width
        s, t = vae.cfg.spatial_compression, vae.cfg.temporal_compression
        frames, H, W = (T - 1) * t + 1, h * s, w * s
        image = resize_image(image, H, W) if tuple(image.shape[1:]) != (H, W) else image
        # the image on every frame of the clip (the pipeline's i2v repeat-padding)
        clip = image[None, :, None].expand(1, 3, frames, H, W).contiguous()
        return EncodeRequest(rid, clip.to(engine.model.device, vae.dtype))

    def condition(request: Any, posterior: Any):
        mean, std = latent_stats(vae.cfg, posterior.mean)
        latents = ((posterior.mean - mean) / std).to(torch.float32)  # argmax of the posterior, normalised (upstream)
        return replace(request, vision_condition_frames=(0,), condition_latents=latents).validate(cfg)

    return MediaChain(vae, WanVaeDecodeKernel(vae), WanVaeEncodeKernel(vae), decode_request, encode_request,
                      condition, fps=lambda r: float(r.fps), sound=sound,
                      sample_rate=None if sound is None else int(sound.cfg.sampling_rate), weights_version=version)


__all__ = ["cosmos3_media_vae_config", "media", "model_config", "processor_options",
           "random_wan_vae_state", "request_cost", "request_from_fields"]
