"""seedvr2 optimized path: fast NaDiT with window-aligned SP (Plan A), window geometry + plan cache, model spec, the
one-step restoration loop, and the family entry `FAMILY` (instance = NaDiT + VAE, loop "restore")."""

from __future__ import annotations

import torch

from manifests.seedvr2.config import NaDiTConfig, list_variants, load_vae_variant, load_variant
from manifests.seedvr2.keys import nadit_key_shapes, vae_key_shapes
from optimized.models.seedvr2.model import FastNaDiT, load_fast_nadit
from optimized.models.seedvr2.pipeline import RestorationLoop, RestoreOutput, RestoreRequest, SeedVR2Instance
from optimized.models.seedvr2.spec import nadit_component, seedvr2_model_spec, vae_component, validate_parallel_plan
from optimized.models.seedvr2.vae import FastVAE, load_fast_vae
from optimized.models.seedvr2.windows import PlanCache, build_geometry, make_plan
from optimized.parallel.plan import ParallelismContract
from optimized.runtime.family import Capabilities, FamilyEntry, LoopOptions, RequestExtent, seeded_random_state

DIT, VAE = "dit", "vae"


def vae_variant_for(cfg: NaDiTConfig) -> str:
    """The VAE the restoration model pairs with its NaDiT: the tiny VAE for the tiny (golden) NaDiTs."""
    return "tiny" if any(cfg == load_variant(v) for v in list_variants() if v.startswith("tiny")) else "released"


def _load(cfg: NaDiTConfig, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
          dtype: torch.dtype = torch.float32, weights_version: str | None = None) -> SeedVR2Instance:
    if set(weights) != {DIT, VAE}:
        raise ValueError(f"seedvr2 takes components {[DIT, VAE]}, got {sorted(weights)}")
    vae = load_fast_vae(load_vae_variant(vae_variant_for(cfg)), weights[VAE], device, dtype)
    return SeedVR2Instance(cfg, load_fast_nadit(cfg, weights[DIT], device, dtype), vae)


def _random_weights(cfg: NaDiTConfig, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    vae_cfg = load_vae_variant(vae_variant_for(cfg))
    return {DIT: seeded_random_state(nadit_key_shapes(cfg), seed),
            VAE: seeded_random_state(vae_key_shapes(vae_cfg), seed + 1, ones=("norm1.weight", "norm2.weight",
                                                                              "group_norm.weight", "norm_out.weight"))}


def _extent(request) -> RequestExtent | None:
    """Pixel sizes of the low-quality clip (3, F, H, W)."""
    v = getattr(request, "lq_video", None)
    return RequestExtent(*v.shape[1:]) if isinstance(v, torch.Tensor) and v.ndim == 4 else None


# window-aligned SP keeps every head on every rank (no head rule) and balances ragged windows by token count
PARALLELISM = ParallelismContract(family="seedvr2", axes=("sp_window",), implemented=("sp_window",), seq_rule="none",
                                  max_cfgp=1)


FAMILY = FamilyEntry(
    name="seedvr2",
    config_class=NaDiTConfig,
    load_variant=load_variant,
    list_variants=list_variants,
    config_from_dict=NaDiTConfig.from_dict,
    load=_load,
    random_weights=_random_weights,
    components=lambda cfg: (nadit_component(cfg), vae_component(load_vae_variant(vae_variant_for(cfg)))),
    loops={"restore": lambda inst, opts: RestorationLoop(inst.dit, inst.vae, opts.group)},
    request_types={RestoreRequest: "restore"},
    capabilities=Capabilities(modalities=("video",), cfg_policies=(), max_frames=1025, max_height=4096,
                              max_width=4096, extent=_extent),
    parallelize=PARALLELISM,
)

__all__ = ["FAMILY", "FastNaDiT", "FastVAE", "PlanCache", "RestorationLoop", "RestoreOutput",
           "RestoreRequest", "SeedVR2Instance", "build_geometry", "load_fast_nadit", "load_fast_vae", "make_plan",
           "nadit_component", "seedvr2_model_spec", "validate_parallel_plan"]
