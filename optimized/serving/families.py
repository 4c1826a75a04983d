"""What serving needs from each family beyond its `FamilyEntry`: the media chain (which VAE decodes its latents, how
they are de-normalised, how a conditioning image becomes latents) and a request built from plain fields (token ids,
pixel size, frames, steps, guidance, seed, image). This is the one module of `optimized/serving` that names
families; each adapter belongs in its family's entry (`FamilyEntry.media` / `FamilyEntry.processor`) once those
fields exist, and `adapter_for` already prefers an entry's own `media` hook when it has one.

    wan      the instance's own VAE; its "vae_decode" loop (batched across requests); WanPipeline's de-normalisation
             latents / (1 / std) + mean; 16 fps (the Wan pipelines' export default); the image rides in the request
             (the denoise loop encodes it)
    cosmos3  the instance holds the transformer only: a Wan2.2-geometry VAE is attached (`attach_media`), or, for
             random-weight variants, a seeded tiny one with z_dim = latent_channels; z * std + mean; the request's
             fps; an image is repeated over the clip, encoded by the chunked VAE encode loop (a scheduled stage),
             normalised, and conditions latent frame 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from optimized.runtime.loop import LoopKernel


class ServingError(ValueError):
    """A request serving cannot build (bad field, missing component); the message names the field."""


@dataclass
class MediaChain:
    """Latents -> media (and an image -> conditioning) for one engine. One decode / encode kernel per engine, so
    the scheduler batches decode chunks of different requests together."""
    vae: Any                                              # optimized.models.wan.FastWanVAE
    decode_kernel: LoopKernel                             # chunked VAE decode loop
    encode_kernel: LoopKernel | None                      # chunked VAE encode loop (None: the denoise loop encodes)
    decode_request: Callable[[str, torch.Tensor], Any]    # (stage id, model latents) -> decode loop request
    encode_request: Callable[[str, torch.Tensor, Any], Any] | None  # (stage id, image [3,H,W], request) -> request
    condition: Callable[[Any, Any], Any] | None           # (request, encode result) -> conditioned request
    fps: Callable[[Any], float]                           # request -> frames per second of the clip
    sound: Any = None                                     # sound decoder (`.decode(latents)`), optional
    sample_rate: int | None = None
    weights_version: str | None = None                    # of the media components (None: the model's)

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, F, H, W] in [-1, 1] -> normalised latents (mu - mean) / std, through the chunked encode loop on a
        private scheduler (for processors that ask for an encoder while they build a request)."""
        from optimized.runtime.scheduler import run_request
        if self.encode_kernel is None:
            raise ServingError("image: this model conditions inside its denoise loop; no encoder to offer")
        probe = self.encode_request("processor/encode", pixels[0, :, 0], None, clip=pixels)
        post = run_request(self.encode_kernel, probe)
        mean, std = _stats(self.vae.cfg, post.mean)
        return ((post.mean - mean) / std).to(torch.float32)

    def decode_audio(self, latents: dict) -> torch.Tensor | None:
        if self.sound is None or latents.get("sound") is None:
            return None
        with torch.no_grad():
            audio = self.sound.decode(latents["sound"])
        return audio[0] if audio.ndim == 3 else audio


@dataclass(frozen=True)
class RequestFields:
    """Plain generation fields (what fvgen and the HTTP server take), before a family turns them into a request."""
    text_ids: torch.Tensor
    negative_text_ids: torch.Tensor | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    num_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = 0
    image: torch.Tensor | None = None                     # [3, H, W] in [-1, 1]


@dataclass(frozen=True)
class FamilyAdapter:
    name: str
    defaults: dict                                        # num_frames, height, width, num_steps, guidance_scale
    build: Callable[[Any, RequestFields], Any]            # (engine, fields) -> the family's request
    media: Callable[[Any], MediaChain]                    # engine -> its media chain
    seed_of: Callable[[Any], int | None] = lambda r: getattr(r, "seed", None)
    image_in_request: bool = False                        # True: the request carries the image itself


def _stats(cfg, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1).to(like)
    std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1).to(like)
    return mean, std


def _positive(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ServingError(f"{name} must be a positive integer, got {v!r}")
    return v


def _fill(fields: RequestFields, defaults: dict) -> RequestFields:
    kw = {k: defaults[k] if getattr(fields, k) is None else getattr(fields, k) for k in defaults}
    return replace(fields, **kw)


# ---------------------------------------------------------------------------------------------------- wan
def _wan_build(engine: Any, f: RequestFields) -> Any:
    from manifests.wan.sampling import WanGenerateRequest
    f = _fill(f, WAN_DEFAULTS)
    cfg = engine.model.cfg
    negative = f.negative_text_ids
    if negative is None and f.guidance_scale > 1.0:  # an empty negative prompt still runs CFG (upstream "")
        negative = torch.zeros(1, dtype=torch.int64)
    image = f.image if cfg.task in ("i2v", "ti2v") else None
    if f.image is not None and image is None:
        raise ServingError(f"image: this wan {cfg.task} model takes no image")
    if image is not None and tuple(image.shape[1:]) != (f.height, f.width):
        image = _resize(image, f.height, f.width)
    return WanGenerateRequest(text_ids=f.text_ids, negative_text_ids=negative, num_frames=f.num_frames,
                              height=f.height, width=f.width, num_steps=f.num_steps,
                              guidance_scale=float(f.guidance_scale), seed=f.seed, image=image)


def _wan_media(engine: Any) -> MediaChain:
    vae = engine.model.vae

    def decode_request(rid: str, latents: torch.Tensor):
        from optimized.models.wan.vae_loops import DecodeRequest
        x = latents.to(torch.float32)
        mean, std = _stats(vae.cfg, x)
        return DecodeRequest(rid, (x / (1.0 / std) + mean).to(vae.dtype))  # divide by the reciprocal std (upstream)

    return MediaChain(vae, engine.loop("vae_decode"), None, decode_request, None, None, fps=lambda r: 16.0)


WAN_DEFAULTS = dict(num_frames=5, height=32, width=32, num_steps=4, guidance_scale=5.0)


# ---------------------------------------------------------------------------------------------------- cosmos3
def _cosmos3_build(engine: Any, f: RequestFields) -> Any:
    from manifests.cosmos3.sampling import video_request
    f = _fill(f, COSMOS3_DEFAULTS)
    negative = f.negative_text_ids if f.negative_text_ids is not None else torch.zeros(1, dtype=torch.int64)
    return video_request(engine.model.cfg, num_frames=f.num_frames, height=f.height, width=f.width,
                         text_ids=f.text_ids, negative_text_ids=negative, num_steps=f.num_steps,
                         guidance_scale=float(f.guidance_scale), seed=f.seed)


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


def _cosmos3_media(engine: Any) -> MediaChain:
    from optimized.models.wan import load_fast_vae
    from optimized.models.wan.vae_loops import DecodeRequest, EncodeRequest, WanVaeDecodeKernel, WanVaeEncodeKernel
    attached = engine.__dict__.get("_media_components", {})
    vae, version = attached.get("vae"), attached.get("vae_version")
    if vae is None:
        wv = engine.model.weights_version or ""
        if not wv.startswith("random:"):
            raise ServingError("cosmos3: this checkpoint holds the transformer only; attach its Wan2.2 VAE with "
                               "optimized.serving.attach_media(engine, vae=load_fast_vae(cfg, state))")
        vcfg = cosmos3_media_vae_config(engine.model.cfg)
        vae = load_fast_vae(vcfg, random_wan_vae_state(vcfg, 1), device=str(engine.model.device))
        version = f"random:wan-vae:{vcfg.version}:z{vcfg.z_dim}:1"
    cfg = engine.model.cfg
    if vae.cfg.z_dim != cfg.latent_channels:
        raise ServingError(f"cosmos3: the attached VAE has z_dim {vae.cfg.z_dim}, the transformer "
                           f"latent_channels {cfg.latent_channels}")

    def decode_request(rid: str, latents: torch.Tensor):
        x = latents.to(torch.float32)
        mean, std = _stats(vae.cfg, x)
        return DecodeRequest(rid, (x * std + mean).to(vae.dtype))

    def encode_request(rid: str, image: torch.Tensor, request: Any, clip: torch.Tensor | None = None):
        if clip is not None:  # pixels already laid out as a clip (a processor's canvas)
            return EncodeRequest(rid, clip.to(engine.model.device, vae.dtype))
        T, h, w = request.latent_frames, request.latent_height, request.latent_width
        s, t = vae.cfg.spatial_compression, vae.cfg.temporal_compression
        frames, H, W = (T - 1) * t + 1, h * s, w * s
        image = _resize(image, H, W) if tuple(image.shape[1:]) != (H, W) else image
        # the image on every frame of the clip (the pipeline's i2v repeat-padding)
        clip = image[None, :, None].expand(1, 3, frames, H, W).contiguous()
        return EncodeRequest(rid, clip.to(engine.model.device, vae.dtype))

    def condition(request: Any, posterior: Any):
        mean, std = _stats(vae.cfg, posterior.mean)
        latents = ((posterior.mean - mean) / std).to(torch.float32)  # argmax of the posterior, normalised (upstream)
        return replace(request, vision_condition_frames=(0,), condition_latents=latents).validate(cfg)

    sound = attached.get("sound")
    return MediaChain(vae, WanVaeDecodeKernel(vae), WanVaeEncodeKernel(vae), decode_request, encode_request,
                      condition, fps=lambda r: float(r.fps), sound=sound,
                      sample_rate=None if sound is None else int(sound.cfg.sampling_rate), weights_version=version)


COSMOS3_DEFAULTS = dict(num_frames=5, height=32, width=32, num_steps=4, guidance_scale=5.0)


def _resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bilinear resize of [3, H, W] (a convenience for serving; exact preprocessing belongs to the processors)."""
    return torch.nn.functional.interpolate(image[None].float(), size=(height, width), mode="bilinear",
                                           align_corners=False)[0].clamp(-1, 1)


ADAPTERS: dict[str, FamilyAdapter] = {
    "wan": FamilyAdapter("wan", WAN_DEFAULTS, _wan_build, _wan_media, image_in_request=True),
    "cosmos3": FamilyAdapter("cosmos3", COSMOS3_DEFAULTS, _cosmos3_build, _cosmos3_media),
}


def adapter_for(engine: Any) -> FamilyAdapter:
    name = engine.family.name
    if name not in ADAPTERS:
        raise ServingError(f"family {name!r} has no video serving adapter (families: {sorted(ADAPTERS)})")
    return ADAPTERS[name]


def attach_media(engine: Any, *, vae: Any = None, sound: Any = None, vae_version: str | None = None) -> None:
    """Give an engine whose instance holds no VAE (cosmos3: transformer only) the media components it decodes
    with. Must be called before the first video request."""
    engine.__dict__.setdefault("_media_components", {}).update(
        {k: v for k, v in (("vae", vae), ("sound", sound), ("vae_version", vae_version)) if v is not None})
    engine.__dict__.pop("_media_chain", None)


def media_chain(engine: Any) -> MediaChain:
    """The engine's media chain, built once (its kernels are the engine's: the scheduler batches by kernel)."""
    chain = engine.__dict__.get("_media_chain")
    if chain is None:
        hook = getattr(engine.family, "media", None)   # a family entry's own media hook, when it has one
        chain = hook(engine) if callable(hook) else adapter_for(engine).media(engine)
        engine.__dict__["_media_chain"] = chain
    return chain
