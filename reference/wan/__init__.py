"""Readable single-device Wan VAE (2.1 / 2.2): whole-clip encoder and decoder with upstream's chunked semantics."""

from reference.wan.vae import (Posterior, WanVAE, check_latents, check_video, denormalize_latents, load_vae,
                               normalize_latents, patchify, unpatchify)

__all__ = ["Posterior", "WanVAE", "check_latents", "check_video", "denormalize_latents", "load_vae",
           "normalize_latents", "patchify", "unpatchify"]
