"""wan model plane: the VAE component (canonical keys, load transforms) and the loops it runs.

Declared load-time transforms: every canonical key is cast to the run dtype under its canonical name; nothing else
happens to the weights (RMS-norm scales sqrt(C) * gamma are derived values, recomputed at load, never stored).
"""

from __future__ import annotations

from manifests.wan import WanVAEConfig, canonical_key_shapes

from optimized.runtime.spec import ComponentSpec, LoadTransform, ModelSpec

MODEL_ID = "wan.vae"
VAE = "vae"
DECODE_LOOP = "wan.vae_decode"
ENCODE_LOOP = "wan.vae_encode"


def vae_component(cfg: WanVAEConfig) -> ComponentSpec:
    shapes = canonical_key_shapes(cfg)
    return ComponentSpec(
        component_id=VAE,
        kind=f"wan{cfg.version}_vae",
        key_shapes=tuple(shapes.items()),
        transforms=tuple(LoadTransform(f"cast.{k}", (k,), k, "cast") for k in shapes),
    ).validate()


def wan_vae_model_spec(cfg: WanVAEConfig) -> ModelSpec:
    return ModelSpec(model_id=MODEL_ID, family="wan", components=(vae_component(cfg),)).validate()
