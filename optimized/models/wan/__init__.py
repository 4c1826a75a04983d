"""wan on the v2 runtime: the whole model (DiT expert(s) + UMT5 + VAE, `instance.WanModelInstance`) and its loops
("denoise", and the VAE's chunked "vae_decode" / "vae_encode" with typed conv-cache state), as the family entry
`FAMILY`. The VAE-only variants (`manifests.wan.list_variants()`: tiny-2.1, tiny-2.2, wan2.1, wan2.2) stay usable on
their own through `load_fast_vae` + the VAE kernels (run them with `optimized.runtime.scheduler.run_request`)."""

from __future__ import annotations

import torch

from manifests.wan.model import WanModelConfig, list_model_variants, load_model_variant
from manifests.wan.sampling import WanGenerateRequest
from optimized.models.wan.spec import DECODE_LOOP, ENCODE_LOOP, vae_component, wan_vae_model_spec
from optimized.models.wan.vae import ConvCache, FastWanVAE, load_fast_vae
from optimized.models.wan.vae_loops import (DecodeRequest, EncodeRequest, FastPosterior, VideoChunkEvent,
                                            WanVaeDecodeKernel, WanVaeEncodeKernel, chunk_bytes)
from optimized.runtime.family import Capabilities, FamilyEntry, LoopOptions
from optimized.runtime.spec import ComponentSpec


def _load(cfg: WanModelConfig, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
          dtype: torch.dtype = torch.float32, weights_version: str | None = None):
    from optimized.models.wan.instance import WanModelInstance
    return WanModelInstance(cfg, weights, device, dtype, weights_version)


def _random_weights(cfg: WanModelConfig, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    from optimized.models.wan.instance import WanModelInstance
    return WanModelInstance.random_weights(cfg, seed)


def _components(cfg: WanModelConfig) -> tuple[ComponentSpec, ...]:
    from optimized.models.wan.instance import component_names
    from optimized.models.wan.spec import dit_component, umt5_component
    specs = {"transformer": lambda: dit_component(cfg.dit), "text_encoder": lambda: umt5_component(cfg.text_encoder),
             "vae": lambda: vae_component(cfg.vae), "transformer_2": lambda: dit_component(cfg.dit_2, "transformer_2")}
    return tuple(specs[name]() for name in component_names(cfg))


def _denoise(instance, opts: LoopOptions):
    from optimized.models.wan.denoise import WanDenoiseLoop
    return WanDenoiseLoop(instance, opts.cfg_policy)


def _denoise_job(request: WanGenerateRequest, record_trajectory: bool = False):
    from optimized.models.wan.denoise import WanDenoiseJob
    return WanDenoiseJob(request, record_trajectory)


FAMILY = FamilyEntry(
    name="wan",
    config_class=WanModelConfig,
    load_variant=load_model_variant,
    list_variants=list_model_variants,
    config_from_dict=WanModelConfig.from_dict,
    load=_load,
    random_weights=_random_weights,
    components=_components,
    loops={"denoise": _denoise,
           "vae_decode": lambda instance, opts: WanVaeDecodeKernel(instance.vae),
           "vae_encode": lambda instance, opts: WanVaeEncodeKernel(instance.vae)},
    request_types={WanGenerateRequest: "denoise", DecodeRequest: "vae_decode", EncodeRequest: "vae_encode"},
    capabilities=Capabilities(modalities=("video",), cfg_policies=("two-forward", "batched")),
    jobs={"denoise": _denoise_job},
    caches=lambda instance: (instance.text_encoder.cache,),
)

__all__ = ["ConvCache", "DECODE_LOOP", "DecodeRequest", "ENCODE_LOOP", "EncodeRequest", "FAMILY", "FastPosterior",
           "FastWanVAE", "VideoChunkEvent", "WanVaeDecodeKernel", "WanVaeEncodeKernel", "chunk_bytes", "load_fast_vae",
           "vae_component", "wan_vae_model_spec"]
