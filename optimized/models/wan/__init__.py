"""wan on the v2 runtime: the whole model (DiT expert(s) + UMT5 + VAE [+ CLIP image encoder], `instance.WanModelInstance`) and its loops
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
from optimized.parallel.plan import AttentionShape, ModelShapes, ParallelismContract, ParallelPlanError
from optimized.runtime.family import Capabilities, FamilyEntry, LoopOptions, RequestExtent
from optimized.runtime.spec import ComponentSpec


def _load(cfg: WanModelConfig, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
          dtype: torch.dtype = torch.float32, weights_version: str | None = None):
    from optimized.models.wan.instance import WanModelInstance
    return WanModelInstance(cfg, weights, device, dtype, weights_version)


def _random_weights(cfg: WanModelConfig, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    from optimized.models.wan.instance import WanModelInstance
    return WanModelInstance.random_weights(cfg, seed)


def _components(cfg: WanModelConfig) -> tuple[ComponentSpec, ...]:
    from optimized.models.wan.image_encoder import clip_component
    from optimized.models.wan.instance import component_names
    from optimized.models.wan.spec import dit_component, umt5_component
    specs = {"transformer": lambda: dit_component(cfg.dit), "text_encoder": lambda: umt5_component(cfg.text_encoder),
             "vae": lambda: vae_component(cfg.vae), "transformer_2": lambda: dit_component(cfg.dit_2, "transformer_2"),
             "image_encoder": lambda: clip_component(cfg.image_encoder)}
    return tuple(specs[name]() for name in component_names(cfg))


def _denoise(instance, opts: LoopOptions):
    from optimized.models.wan.denoise import WanDenoiseLoop
    return WanDenoiseLoop(instance, opts.cfg_policy)


def _denoise_job(request: WanGenerateRequest, record_trajectory: bool = False):
    from optimized.models.wan.denoise import WanDenoiseJob
    return WanDenoiseJob(request, record_trajectory)


def _extent(request) -> RequestExtent | None:
    """Pixel sizes of a generation or an encode. The limits are the DiT's: RoPE tables of rope_max_seq_len (1024)
    positions per axis = 1024 latent frames (4 * 1023 + 1 pixel frames) and 1024 patches of 2 x 8 pixels (2.1)."""
    if isinstance(request, WanGenerateRequest):
        return RequestExtent(frames=request.num_frames, height=request.height, width=request.width)
    if isinstance(request, EncodeRequest) and isinstance(request.video, torch.Tensor) and request.video.ndim == 5:
        return RequestExtent(*request.video.shape[2:])
    return None


def _parallel_shapes(cfg: WanModelConfig) -> ModelShapes:
    """Every DiT's self- and cross-attention heads (MHA: kv = heads) and FFN width; UMT5 and the VAE replicate."""
    dits = [("dit", cfg.dit)] + ([("dit_2", cfg.dit_2)] if cfg.two_experts else [])
    return ModelShapes(tuple(AttentionShape(f"{name}.{kind}", d.num_heads, d.num_heads, d.head_dim)
                             for name, d in dits for kind in ("self", "cross")),
                       tuple(d.ffn_dim for _, d in dits), cfg.dit.hidden_size)


class _WanParallelism(ParallelismContract):
    """The contract plus wan's attach step: with ulysses x ring > 1 every DiT expert runs sequence-parallel; with
    tp > 1 every expert keeps only its tp shard (already loaded sharded, or re-sharded here: parallelize.py)."""

    def __call__(self, instance, mesh):
        instance = super().__call__(instance, mesh)
        plan = mesh.plan if hasattr(mesh, "plan") else mesh
        for dit in instance.experts():
            dit.graph_cache.parallel_plan_hash = plan.hash()   # every GraphKey of this expert names the layout
        if not hasattr(mesh, "axis"):
            return instance
        for dit in (instance.dit, instance.dit_2):
            if dit is None:
                continue
            if plan.sp_ulysses * plan.sp_ring > 1:
                dit.sp_mesh = mesh
            if plan.tp > 1:
                if dit.tp is not None and dit.tp.world_size != plan.tp:
                    raise ParallelPlanError(f"wan DiT loaded for tp = {dit.tp.world_size}, the plan has tp = {plan.tp}")
                dit.shard_tp(mesh.axis("tp"))
        return instance


PARALLELISM = _WanParallelism(
    family="wan", axes=("dp", "cfgp", "sp_ulysses", "sp_ring", "tp"),
    implemented=("cfgp", "sp_ulysses", "sp_ring", "tp"),
    shapes=_parallel_shapes, kv_rule="divide", seq_rule="pad",
    notes=("ulysses / ring shard the video tokens of self-attention (padded to a multiple of ulysses x ring, "
           "padded keys masked); cross-attention keeps the whole text on every rank (kv_replicated)",
           "tp splits the heads of self- and cross-attention and the FFN width (column / row parallel); UMT5, the "
           "VAE and the DiT embeddings replicate",),
    cache_keys=lambda instance: ((instance.text_encoder, "cache_key"),),
    load_sharded=lambda *a, **kw: _load_sharded(*a, **kw))


def _load_sharded(path, mesh, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from optimized.models.wan.instance import load_sharded_instance
    return load_sharded_instance(path, mesh, device, dtype)


def _processor(tokenizer_dir):
    """prompt / image -> WanGenerateRequest (optimized/models/wan/processor.py)."""
    from optimized.models.wan.processor import WanProcessor
    return WanProcessor(tokenizer_dir)


def _media():
    """Serving hooks (media chain, requests from plain fields): media.py, imported on first use."""
    from optimized.models.wan import media
    return media


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
    capabilities=Capabilities(modalities=("video",), cfg_policies=("two-forward", "batched"),
                              max_frames=4093, max_height=16384, max_width=16384, extent=_extent),
    jobs={"denoise": _denoise_job},
    caches=lambda instance: (instance.text_encoder.cache,),
    parallelize=PARALLELISM,
    processor=_processor,
    media=lambda engine: _media().media(engine),
    request_from_fields=lambda engine, fields: _media().request_from_fields(engine, fields),
    processor_options=lambda engine: _media().processor_options(engine),
    request_defaults=dict(num_frames=5, height=32, width=32, num_steps=4, guidance_scale=5.0),
    request_cost=lambda engine, request, phases: _media().request_cost(engine, request, phases),
)

__all__ = ["ConvCache", "DECODE_LOOP", "DecodeRequest", "ENCODE_LOOP", "EncodeRequest", "FAMILY", "FastPosterior",
           "FastWanVAE", "VideoChunkEvent", "WanVaeDecodeKernel", "WanVaeEncodeKernel", "chunk_bytes", "load_fast_vae",
           "vae_component", "wan_vae_model_spec"]
