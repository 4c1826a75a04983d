"""ltx2 optimized path: the fast LTX2VideoTransformer3DModel and the family entry `FAMILY` (a component-only family: one
transformer, no loop yet)."""

from __future__ import annotations

import torch

from manifests.ltx2 import Ltx2Config, key_shapes, list_variants, load_variant
from manifests.ltx2.keys import GAINS
from optimized.models.ltx2.model import FastLtx2, component, load_model
from optimized.runtime.family import Capabilities, FamilyEntry, seeded_random_state

TRANSFORMER = "transformer"


def _load(cfg: Ltx2Config, weights: dict[str, dict[str, torch.Tensor]], device: str = "cpu",
          dtype: torch.dtype = torch.float32, weights_version: str | None = None) -> FastLtx2:
    if set(weights) != {TRANSFORMER}:
        raise ValueError(f"ltx2 takes components [{TRANSFORMER!r}], got {sorted(weights)}")
    return load_model(cfg, weights[TRANSFORMER], device, dtype)


FAMILY = FamilyEntry(
    name="ltx2",
    config_class=Ltx2Config,
    load_variant=load_variant,
    list_variants=list_variants,
    config_from_dict=Ltx2Config.from_dict,
    load=_load,
    random_weights=lambda cfg, seed: {TRANSFORMER: seeded_random_state(key_shapes(cfg), seed, ones=GAINS)},
    components=lambda cfg: (component(cfg),),
    loops={},
    request_types={},
    capabilities=Capabilities(modalities=("video",)),
)

__all__ = ["FAMILY", "FastLtx2", "component", "load_model"]
