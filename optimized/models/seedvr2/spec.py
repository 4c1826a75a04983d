"""seedvr2 model plane: canonical keys of the NaDiT and the VAE and their declared load transforms.

Transforms: the rope frequency buffers and the time-embedding stay fp32 whatever the run dtype (they are
multiplied by positions up to ~1000 / by t = 1000); every other key is cast to the run dtype under its
canonical name. Nothing is fused: the 3B shares `.all` weights between video and text, which fusing would
duplicate.
"""

from __future__ import annotations

from manifests.seedvr2.config import NaDiTConfig, VAEConfig
from manifests.seedvr2.keys import nadit_fp32_keys, nadit_key_shapes, vae_key_shapes
from optimized.parallel.group import ParallelPlan
from optimized.runtime.spec import ComponentSpec, LoadTransform, ModelSpec

MODEL_ID = "seedvr2"
SUPPORTED_SP_MODES = ("window",)
REJECTED_SP_MODES = {"ulysses": "head-sharded Ulysses", "ring": "ring attention", "allgather": "all-gather SP",
                     "advanced_uaa": "advanced_uaa", "ulysses_a2a_permute": "ulysses_a2a_permute"}


def nadit_component(cfg: NaDiTConfig) -> ComponentSpec:
    shapes, fp32 = nadit_key_shapes(cfg), set(nadit_fp32_keys(cfg))   # one fp32 rule: manifests/seedvr2/keys.py
    return ComponentSpec("dit", "nadit_window_transformer", tuple(shapes.items()), tuple(
        LoadTransform(f"cast.{k}", (k,), k, "cast", dtype="float32" if k in fp32 else None) for k in shapes)).validate()


def vae_component(cfg: VAEConfig) -> ComponentSpec:
    shapes = vae_key_shapes(cfg)
    return ComponentSpec("vae", "causal_video_vae", tuple(shapes.items()),
                         tuple(LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes)).validate()


def seedvr2_model_spec(cfg: NaDiTConfig, vae: VAEConfig | None = None) -> ModelSpec:
    comps = (nadit_component(cfg),) + ((vae_component(vae),) if vae is not None else ())
    return ModelSpec(MODEL_ID, "seedvr2", comps).validate()


def validate_parallel_plan(plan: ParallelPlan) -> ParallelPlan:
    """SeedVR2 runs window-aligned SP (Plan A) on the sp axis; every other SP flavour is refused at load."""
    if plan.sp_mode in REJECTED_SP_MODES:
        raise_plan(f"SeedVR2 NaDiT rejects sp_mode {plan.sp_mode!r} ({REJECTED_SP_MODES[plan.sp_mode]}): its "
                   f"attention is window-local, so it runs window-aligned sequence parallelism (sp_mode 'window', "
                   f"every rank keeps all heads). Use sp_mode='window'.")
    return plan.validate(supported_axes=("sp",), supported_sp_modes=SUPPORTED_SP_MODES, who="SeedVR2 NaDiT")


def raise_plan(msg: str):
    from optimized.parallel.group import ParallelPlanError
    raise ParallelPlanError(msg)
