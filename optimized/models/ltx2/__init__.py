"""ltx2 on the v2 runtime: the whole LTX-2 model (DiT + text connectors + Gemma 3 + video VAE + audio VAE + vocoder,
`instance.Ltx2ModelInstance`) and its loops ("denoise": LTX2Pipeline's text-to-video+audio loop, batched across
requests; "vae_decode": the video VAE over the whole clip), as the family entry `FAMILY`. The fast transformer alone
(`FastLtx2`, `load_model`) is what the parity kit's C0 compares."""

from __future__ import annotations

import torch

from manifests.ltx2.model import (
    Ltx2ModelConfig,
    list_model_variants,
    load_model_variant,
)
from manifests.ltx2.request import Ltx2GenerateRequest
from optimized.models.ltx2.model import FastLtx2, component, load_model
from optimized.runtime.family import (
    Capabilities,
    FamilyEntry,
    LoopOptions,
    RequestExtent,
)
from optimized.runtime.spec import ComponentSpec

TRANSFORMER = "transformer"


def _load(cfg: Ltx2ModelConfig, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
          dtype: torch.dtype = torch.float32, weights_version: str | None = None):
    from optimized.models.ltx2.instance import Ltx2ModelInstance
    return Ltx2ModelInstance(cfg, weights, device, dtype, weights_version)


def _random_weights(cfg: Ltx2ModelConfig, seed: int):
    from optimized.models.ltx2.instance import random_weights
    return random_weights(cfg, seed)


def _components(cfg: Ltx2ModelConfig) -> tuple[ComponentSpec, ...]:
    from optimized.models.ltx2.audio_vae import audio_vae_component
    from optimized.models.ltx2.connectors import connectors_component
    from optimized.models.ltx2.instance import component_key_shapes
    from optimized.models.ltx2.video_vae import video_vae_component
    from optimized.models.ltx2.vocoder import vocoder_component
    from optimized.runtime.spec import LoadTransform
    gemma = component_key_shapes(cfg)["text_encoder"]
    text = ComponentSpec("text_encoder", "gemma3_text", tuple(gemma.items()),
                         tuple(LoadTransform(f"cast.{k}", (k,), k, "cast") for k in gemma)).validate()
    # the components' own ids as the model directory names them
    specs = (component(cfg.transformer), connectors_component(cfg.connectors), text,
             video_vae_component(cfg.vae), audio_vae_component(cfg.audio_vae), vocoder_component(cfg.vocoder))
    names = ("transformer", "connectors", "text_encoder", "vae", "audio_vae", "vocoder")
    from dataclasses import replace
    return tuple(s if s.component_id == n else replace(s, component_id=n) for s, n in zip(specs, names))


def _denoise(instance, opts: LoopOptions):
    from optimized.models.ltx2.denoise import Ltx2DenoiseLoop
    return Ltx2DenoiseLoop(instance, opts.cfg_policy)


def _vae_decode(instance, opts: LoopOptions):
    from optimized.models.ltx2.media import Ltx2VaeDecodeKernel
    return Ltx2VaeDecodeKernel(instance)


def _denoise_job(request: Ltx2GenerateRequest, record_trajectory: bool = False):
    from optimized.models.ltx2.denoise import Ltx2DenoiseJob
    return Ltx2DenoiseJob(request, record_trajectory)


def _extent(request) -> RequestExtent | None:
    if isinstance(request, Ltx2GenerateRequest):
        texts = [t for t in (request.text_ids, request.negative_text_ids) if isinstance(t, torch.Tensor)]
        return RequestExtent(frames=request.num_frames, height=request.height, width=request.width,
                             tokens=max((t.numel() for t in texts), default=None))
    return None


def _processor(tokenizer_dir):
    from optimized.models.ltx2.processor import Ltx2Processor
    return Ltx2Processor(tokenizer_dir)


def _media():
    from optimized.models.ltx2 import media
    return media


FAMILY = FamilyEntry(
    name="ltx2",
    config_class=Ltx2ModelConfig,
    load_variant=load_model_variant,
    list_variants=list_model_variants,
    config_from_dict=Ltx2ModelConfig.from_dict,
    load=_load,
    random_weights=_random_weights,
    components=_components,
    loops={"denoise": _denoise, "vae_decode": _vae_decode},
    request_types={Ltx2GenerateRequest: "denoise"},
    capabilities=Capabilities(modalities=("video", "sound"), cfg_policies=("batched",), max_frames=1025,
                              max_height=4096, max_width=4096, extent=_extent),
    jobs={"denoise": _denoise_job},
    caches=lambda instance: (instance.text_cache,),
    processor=_processor,
    media=lambda engine: _media().media(engine),
    request_from_fields=lambda engine, fields: _media().request_from_fields(engine, fields),
    processor_options=lambda engine: _media().processor_options(engine),
    request_cost=lambda engine, request, phases: _media().request_cost(engine, request, phases),
    request_defaults={"num_frames": 9, "height": 64, "width": 64, "num_steps": 4, "guidance_scale": 3.0},
)

__all__ = ["FAMILY", "FastLtx2", "component", "load_model"]
