"""What serving needs from a family, read from its `FamilyEntry` (this module names no family):

    entry.media(engine) -> MediaChain          which VAE decodes its latents, how they are de-normalised, how a
                                                conditioning image becomes latents, fps, sound decoder
    entry.request_from_fields(engine, fields)  a generation request from plain fields (token ids, pixel size,
                                                frames, steps, guidance, seed, image)
    entry.request_defaults                     what an unset field means (num_frames, height, width, num_steps,
                                                guidance_scale)

The families implement them in `optimized/models/<family>/media.py`. `attach_media` gives an engine media
components its instance does not hold (e.g. a VAE for a transformer-only checkpoint).
"""

from __future__ import annotations

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
    vae: Any                                              # a chunked VAE (e.g. a FastWanVAE): `.cfg` has latents stats
    decode_kernel: LoopKernel                             # chunked VAE decode loop
    encode_kernel: LoopKernel | None                      # chunked VAE encode loop (None: the denoise loop encodes)
    decode_request: Callable[[str, torch.Tensor], Any]    # (stage id, model latents) -> decode loop request
    encode_request: Callable[..., Any] | None             # (stage id, image [3,H,W], request, clip=None) -> request
    condition: Callable[[Any, Any], Any] | None           # (request, encode result) -> conditioned request
    fps: Callable[[Any], float]                           # request -> frames per second of the clip
    sound: Any = None                                     # sound decoder (`.decode(latents)`), optional
    sample_rate: int | None = None
    weights_version: str | None = None                    # of the media components (None: the model's)
    mux_audio: bool = False                               # OUT.mp4 carries the audio track too (AAC), beside OUT.wav

    @property
    def image_in_request(self) -> bool:
        """True: the family's request carries the conditioning image itself (its denoise loop encodes it)."""
        return self.encode_kernel is None

    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, F, H, W] in [-1, 1] -> normalised latents (mu - mean) / std, through the chunked encode loop on a
        private scheduler (for processors that ask for an encoder while they build a request)."""
        from optimized.runtime.scheduler import run_request
        if self.encode_kernel is None:
            raise ServingError("image: this model conditions inside its denoise loop; no encoder to offer")
        probe = self.encode_request("processor/encode", pixels[0, :, 0], None, clip=pixels)
        post = run_request(self.encode_kernel, probe)
        mean, std = latent_stats(self.vae.cfg, post.mean)
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

    def filled(self, defaults: dict) -> "RequestFields":
        """Unset fields (None) take the family's defaults."""
        return replace(self, **{k: v if getattr(self, k) is None else getattr(self, k) for k, v in defaults.items()
                                if hasattr(self, k)})


@dataclass(frozen=True)
class FamilyAdapter:
    """A family's serving hooks, gathered from its entry."""
    name: str
    defaults: dict                                        # num_frames, height, width, num_steps, guidance_scale
    build: Callable[[Any, RequestFields], Any]            # (engine, fields) -> the family's request
    media: Callable[[Any], MediaChain]                    # engine -> its media chain
    seed_of: Callable[[Any], int | None] = lambda r: getattr(r, "seed", None)


def latent_stats(cfg: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (latents_mean, latents_std) of a VAE config, shaped [1, C, 1, 1, 1] like `like`."""
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1).to(like)
    std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1).to(like)
    return mean, std


def resize_image(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bilinear resize of [3, H, W] (a convenience for serving; exact preprocessing belongs to the processors)."""
    return torch.nn.functional.interpolate(image[None].float(), size=(height, width), mode="bilinear",
                                           align_corners=False)[0].clamp(-1, 1)


def adapter_for(engine: Any) -> FamilyAdapter:
    entry = engine.family
    if entry.media is None or entry.request_from_fields is None:
        raise ServingError(f"family {entry.name!r} declares no video serving hooks (FamilyEntry.media / "
                           f"request_from_fields)")
    return FamilyAdapter(entry.name, dict(entry.request_defaults), entry.request_from_fields, entry.media)


def attach_media(engine: Any, *, vae: Any = None, sound: Any = None, vae_version: str | None = None) -> None:
    """Give an engine whose instance holds no VAE (a transformer-only checkpoint) the media components it decodes
    with. Must be called before the first video request."""
    engine.__dict__.setdefault("_media_components", {}).update(
        {k: v for k, v in (("vae", vae), ("sound", sound), ("vae_version", vae_version)) if v is not None})
    engine.__dict__.pop("_media_chain", None)


def attached_media(engine: Any) -> dict:
    """What `attach_media` gave this engine ({"vae", "sound", "vae_version"}, any may be absent)."""
    return engine.__dict__.get("_media_components", {})


def media_chain(engine: Any) -> MediaChain:
    """The engine's media chain, built once (its kernels are the engine's: the scheduler batches by kernel)."""
    chain = engine.__dict__.get("_media_chain")
    if chain is None:
        chain = engine.__dict__["_media_chain"] = adapter_for(engine).media(engine)
    return chain


__all__ = ["FamilyAdapter", "MediaChain", "RequestFields", "ServingError", "adapter_for", "attach_media",
           "attached_media", "latent_stats", "media_chain", "resize_image"]
