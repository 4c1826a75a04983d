"""Readable single-device Wan: VAE (2.1 / 2.2, whole-clip encoder and decoder with upstream's chunked semantics),
DiT (`WanTransformer`) and UMT5 text encoder (`UMT5Encoder`, `encode_prompts`)."""

from reference.wan.text_encoder import UMT5Encoder, encode_prompts, load_umt5
from reference.wan.transformer import WanTransformer, load_wan_transformer
from reference.wan.vae import (Posterior, WanVAE, check_latents, check_video, denormalize_latents, load_vae,
                               normalize_latents, patchify, unpatchify)

__all__ = ["Posterior", "UMT5Encoder", "WanTransformer", "WanVAE", "check_latents", "check_video",
           "denormalize_latents", "encode_prompts", "load_umt5", "load_vae", "load_wan_transformer",
           "normalize_latents", "patchify", "unpatchify"]

# the readable generation loop (WanPipeline / WanImageToVideoPipeline semantics)
from reference.wan.pipeline import WanGenerateResult, WanReferencePipeline  # noqa: E402

__all__ += ["WanGenerateResult", "WanReferencePipeline"]
