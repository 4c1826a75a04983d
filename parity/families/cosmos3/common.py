"""cosmos3 parity: what every level shares. The two sides behind one small adapter each (the only place the
harness knows their APIs), the per-output comparison, and the models a run checks."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes, list_variants, load_variant
from manifests.cosmos3.io import Cosmos3ForwardInputs, Cosmos3Prediction
from parity.checkpoints import models_to_check
from parity.metrics import compare, within
from parity.report import CheckResult

import optimized.models.cosmos3 as opt
import reference.cosmos3 as ref

DEFAULT_VARIANTS = ("tiny", "tiny-edge")


def variants() -> list[str]:
    return list_variants()


def resolve_models(variants: list[str], checkpoint: str | None, seed: int):
    """(name, config, canonical state dict) per model to check."""
    return models_to_check("cosmos3", variants, DEFAULT_VARIANTS, checkpoint, seed, load_variant, canonical_key_shapes)


def cast_inputs(inp: Cosmos3ForwardInputs, dtype: torch.dtype) -> Cosmos3ForwardInputs:
    """Latents enter the model in the run dtype, as the pipeline casts them before each call."""
    c = lambda t: None if t is None else t.to(dtype)
    return replace(inp, vision_latents=c(inp.vision_latents), sound_latents=c(inp.sound_latents),
                   action_latents=c(inp.action_latents))


def load_reference(cfg: Cosmos3Config, state: dict[str, torch.Tensor], device: str, dtype: torch.dtype):
    return ref.load_transformer(cfg, state, device=device, dtype=dtype)


def run_reference(model, inp: Cosmos3ForwardInputs, trace=None) -> Cosmos3Prediction:
    with torch.no_grad():
        return model(inp, trace=trace)


def load_optimized(cfg: Cosmos3Config, state: dict[str, torch.Tensor], device: str, dtype: torch.dtype):
    return opt.load_fast(cfg, state, device=device, dtype=dtype)


def run_optimized(model, inputs: list[Cosmos3ForwardInputs], trace=None) -> list[Cosmos3Prediction]:
    with torch.no_grad():
        return model.forward_batch(inputs, trace=trace)


OUTPUTS = ("vision", "sound", "action")


def compare_predictions(name: str, got: Cosmos3Prediction, want: Cosmos3Prediction, tol,
                        localise: Callable[[], str | None] | None = None) -> list[CheckResult]:
    results = []
    for out in OUTPUTS:
        a, b = getattr(got, out), getattr(want, out)
        if a is None and b is None:
            continue
        if (a is None) != (b is None):
            results.append(CheckResult(f"{name}:{out}", False, detail=f"{out} missing on one side"))
            continue
        m = compare(a, b)
        results.append(CheckResult(f"{name}:{out}", within(m, tol), m, tol))
    if localise is not None and not all(r.passed for r in results):
        where = localise()
        for r in results:
            if not r.passed:
                r.divergence = where or "outputs only (every traced layer within tolerance)"
    return results


