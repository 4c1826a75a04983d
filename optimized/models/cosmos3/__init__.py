"""cosmos3 on the v2 runtime: spec (model plane + load transforms), packing, the fast batched model, and its family
entry `FAMILY` (one resident `Cosmos3Fast` runs two loops: "denoise" and "reasoning")."""

from __future__ import annotations

from dataclasses import replace

import torch

from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes, list_variants, load_variant
from manifests.cosmos3.reasoning import ReasonRequest
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, video_request
from optimized.models.cosmos3 import ops, packing
from optimized.models.cosmos3.model import Cosmos3Fast, Cosmos3FastStats, UndKV, load_fast, run_layer
from optimized.models.cosmos3.packing import PackedLayout, pack_layout, timestep_embedding_rows
from optimized.models.cosmos3.spec import TRANSFORMER, cosmos3_model_spec, transformer_component
from optimized.models.cosmos3.parallelize import Cosmos3Parallelism
from optimized.parallel.plan import AttentionShape, ModelShapes
from optimized.runtime.family import Capabilities, FamilyEntry, LoopOptions, RequestExtent, seeded_random_state


def _load(cfg: Cosmos3Config, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
          dtype: torch.dtype = torch.float32, weights_version: str | None = None) -> Cosmos3Fast:
    if set(weights) != {TRANSFORMER}:
        raise ValueError(f"cosmos3 takes exactly one component {TRANSFORMER!r}, got {sorted(weights)}")
    return Cosmos3Fast(cfg, weights[TRANSFORMER], device=device, dtype=dtype, weights_version=weights_version)


def _denoise(fast: Cosmos3Fast, opts: LoopOptions):
    from optimized.models.cosmos3.loops import FlowDenoiseLoop
    return FlowDenoiseLoop(fast, opts.cfg_policy)


def _reasoning(fast: Cosmos3Fast, opts: LoopOptions):
    from optimized.models.cosmos3.reasoner import ARDecodeLoop
    return ARDecodeLoop(fast, opts.kv_blocks, opts.kv_block_size)


def _denoise_job(request: Cosmos3GenerateRequest, record_trajectory: bool = False):
    from optimized.models.cosmos3.loops import DenoiseJob
    return DenoiseJob(request, record_trajectory)


def _reason_job(request: ReasonRequest, record_logits: bool = False, export_und_kv: bool = False):
    from optimized.models.cosmos3.reasoner import ReasonJob
    return ReasonJob(request, record_logits, export_und_kv)


def _video(fast: Cosmos3Fast, **kw) -> Cosmos3GenerateRequest:
    """From pixel sizes (num_frames 4k + 1, height/width multiples of 16)."""
    return video_request(fast.cfg, **kw)


def reason_then_generate(engine, reasoning: ReasonRequest, generation: Cosmos3GenerateRequest):
    """Reasoning, then denoising with `generation.text_ids` replaced by the reasoning's prompt + generated text (a
    final EOS dropped); the reasoning hands its und-stream K/V to the generator's cache (keyed by the text's content
    hash, so the generator hits it exactly when its prompt is that text)."""
    from optimized.programs import chain
    return chain(engine, reasoning, lambda result: replace(generation, text_ids=result["text_ids"]),
                 first_options={"export_und_kv": True}, names=("reasoning", "generation"))


def _extent(request) -> RequestExtent | None:
    """Pixel sizes of a generation (the Wan2.2 VAE: 4x causal temporal, 16x spatial); tokens of a prompt."""
    if isinstance(request, Cosmos3GenerateRequest):
        texts = [t for t in (request.text_ids, request.negative_text_ids) if isinstance(t, torch.Tensor)]
        return RequestExtent(frames=(request.latent_frames - 1) * 4 + 1, height=request.latent_height * 16,
                             width=request.latent_width * 16, tokens=max((t.numel() for t in texts), default=None))
    if isinstance(request, ReasonRequest):
        return RequestExtent(tokens=request.max_total_tokens)
    return None


def _load_sharded(path, mesh, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Cosmos3Fast:
    """This tp rank's Cosmos3Fast read from a canonical checkpoint as slices only (tp.py)."""
    from optimized.models.cosmos3.model import load_sharded
    return load_sharded(path, mesh, device, dtype)


PARALLELISM = Cosmos3Parallelism(   # attaches the gen-stream SP (parallelize.py) under ulysses x ring > 1
    family="cosmos3", axes=("dp", "cfgp", "sp_ulysses", "sp_ring", "tp"),
    implemented=("cfgp", "sp_ulysses", "sp_ring", "tp"),
    shapes=lambda cfg: ModelShapes(
        tuple(AttentionShape(p, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) for p in ("und", "gen")),
        (cfg.intermediate_size,), cfg.hidden_size),
    kv_rule="replicate", seq_rule="pad",
    notes=("the und (text) and gen pathways share one head layout: both are split by the same ulysses x tp",
           "gen tokens are sharded by sequence (padded to a multiple of ulysses x ring, padded keys masked); the und "
           "(text) stream runs whole on every rank and its K/V are kept sharded by heads",
           "und K/V cache entries are per plan (sharded by KV head under ulysses / tp): the plan hash is in their key",
           "tp: q / k / v by heads (KV heads replicated when tp exceeds them), o_proj and down_proj row-parallel, "
           "MLP gate / up column-parallel, in both pathways (optimized/models/cosmos3/tp.py) and in the AR decode "
           "loop (each rank's KV pool holds its KV heads)"),
    load_sharded=_load_sharded,
)   # no `cache_keys` override: Cosmos3Fast.und_cache_key reads the plan hash that parallelize.py sets


def _processor(tokenizer_dir):
    """prompt / image -> Cosmos3GenerateRequest (optimized/models/cosmos3/processor.py)."""
    from optimized.models.cosmos3.processor import Cosmos3Processor
    return Cosmos3Processor(tokenizer_dir)


def _media():
    """Serving hooks (media chain, requests from plain fields): media.py, imported on first use."""
    from optimized.models.cosmos3 import media
    return media


FAMILY = FamilyEntry(
    name="cosmos3",
    config_class=Cosmos3Config,
    load_variant=load_variant,
    list_variants=list_variants,
    config_from_dict=Cosmos3Config.from_dict,
    load=_load,
    random_weights=lambda cfg, seed: {TRANSFORMER: seeded_random_state(canonical_key_shapes(cfg), seed)},
    components=lambda cfg: (transformer_component(cfg),),
    loops={"denoise": _denoise, "reasoning": _reasoning},
    request_types={Cosmos3GenerateRequest: "denoise", ReasonRequest: "reasoning"},
    capabilities=Capabilities(modalities=("video", "image", "sound", "action", "text"),
                              cfg_policies=("two-forward", "batched", "identity"),
                              max_frames=1025, max_height=4096, max_width=4096, max_tokens=131072,
                              extent=_extent),  # released default: 189 frames at 720x1280
    jobs={"denoise": _denoise_job, "reasoning": _reason_job},
    request_builders={"video": _video},
    programs={"reason_then_generate": reason_then_generate},
    caches=lambda fast: (fast.und_cache,),
    parallelize=PARALLELISM,
    processor=_processor,
    media=lambda engine: _media().media(engine),
    request_from_fields=lambda engine, fields: _media().request_from_fields(engine, fields),
    request_defaults=dict(num_frames=5, height=32, width=32, num_steps=4, guidance_scale=5.0),
    processor_options=lambda engine: _media().processor_options(engine),
    instance_config=lambda model_cfg: model_cfg.transformer,   # a model directory: transformer + media components
    request_cost=lambda engine, request, phases: _media().request_cost(engine, request, phases),
)

__all__ = ["Cosmos3Fast", "Cosmos3FastStats", "FAMILY", "PackedLayout", "UndKV", "cosmos3_model_spec", "load_fast",
           "ops", "pack_layout", "packing", "run_layer", "timestep_embedding_rows", "transformer_component"]
