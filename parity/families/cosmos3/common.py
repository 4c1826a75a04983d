"""cosmos3 parity: what every level shares. The two sides behind one small adapter each (the only place the
harness knows their APIs), the per-output comparison, and the models a run checks."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from manifests.cosmos3 import Cosmos3Config, canonical_key_shapes, list_variants, load_variant
from manifests.cosmos3.io import Cosmos3ForwardInputs, Cosmos3Prediction
from parity.checkpoints import models_to_check
from parity.weights import random_state_dict
from parity.localise import TraceRecorder
from parity.metrics import compare, within
from parity.report import CheckResult

import optimized.models.cosmos3 as opt
import reference.cosmos3 as ref

DEFAULT_VARIANTS = ("tiny", "tiny-edge")


def variants() -> list[str]:
    return list_variants()


def resolve_models(variants: list[str], checkpoint: str | None, seed: int, permutations: str | None = None):
    """(name, config, canonical state dict) per model to check; with `permutations` (a case matrix, random
    weights only) each variant is followed by its config permutations (parity/families/cosmos3/cases.py),
    named `<variant>+<switches>`, each with its own seeded weights."""
    models = models_to_check("cosmos3", variants, DEFAULT_VARIANTS, checkpoint, seed, load_variant,
                             canonical_key_shapes)
    if permutations is None or checkpoint is not None:
        return models
    from parity.families.cosmos3.cases import config_permutations
    out = []
    for name, cfg, state in models:
        out.append((name, cfg, state))
        out += [(f"{name}+{suffix}", pcfg, random_state_dict(canonical_key_shapes(pcfg), seed))
                for suffix, pcfg in config_permutations(cfg, permutations)]
    return out


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


def reference_time_embedding(model, timesteps: list[float], dtype: torch.dtype) -> torch.Tensor:
    """[N, D] the reference's timestep embedding as its forward adds it (fp32 MLP, cast to `dtype`)."""
    with torch.no_grad():
        return torch.cat([model.timestep_embedding(t, 1, dtype) for t in timesteps])


def optimized_time_embedding(fast, timesteps: list[float]) -> torch.Tensor:
    """[N, D] the optimized side's timestep embedding as its batched embed adds it (one row per sample)."""
    from optimized.models.cosmos3 import ops
    P, cfg = fast.params, fast.cfg
    t = torch.tensor(timesteps, dtype=torch.float32, device=fast.device) * cfg.timestep_scale
    with torch.no_grad():
        return ops.time_embedding(t, P["time_embed.linear_1.weight"], P["time_embed.linear_1.bias"],
                                  P["time_embed.linear_2.weight"], P["time_embed.linear_2.bias"], fast.dtype)


def replay_batched_forward(fast, cfg_policy: str, cond: list[Cosmos3ForwardInputs],
                           uncond: list[Cosmos3ForwardInputs], target: Cosmos3ForwardInputs) -> dict:
    """Re-run one step's batched forward(s) exactly as the engine composed them (the batch mates' cond inputs,
    then the guided ones' uncond inputs, through the same CFG policy) and return the trace of `target`'s
    sample in the call that carried it."""
    from optimized.solvers.policies import make_policy
    records: dict = {}

    def forward(inputs):
        pos = next((i for i, x in enumerate(inputs) if x is target), None)
        rec = TraceRecorder(sample=pos if pos is not None else -1)
        out = fast.forward_batch(inputs, trace=rec)
        if pos is not None:
            records.update(rec.records)
        return out
    with torch.no_grad():
        make_policy(cfg_policy).run(forward, cond, uncond)
    return records


OUTPUTS = ("vision", "sound", "action")


def compare_predictions(name: str, got: Cosmos3Prediction, want: Cosmos3Prediction, tol,
                        localise: Callable[[], str | None] | None = None,
                        zero: dict[str, str] | None = None) -> list[CheckResult]:
    """One check per output present. `zero` {output: why}: outputs zero by construction (cases.py
    `zero_by_construction`) are checked as exactly 0 on both sides and say so, never as a tolerance."""
    results = []
    for out in OUTPUTS:
        a, b = getattr(got, out), getattr(want, out)
        if a is None and b is None:
            continue
        if (a is None) != (b is None):
            results.append(CheckResult(f"{name}:{out}", False, detail=f"{out} missing on one side"))
            continue
        if zero and out in zero:
            ok = not bool(a.count_nonzero()) and not bool(b.count_nonzero())
            results.append(CheckResult(f"{name}:{out}(zero by construction)", ok, detail=f"{zero[out]}: both "
                                       f"sides exactly 0" if ok else f"{zero[out]}, yet nonzero: optimized "
                                       f"{int(a.count_nonzero())}, reference {int(b.count_nonzero())} elements"))
            continue
        m = compare(a, b)
        results.append(CheckResult(f"{name}:{out}", within(m, tol), m, tol))
    if localise is not None and not all(r.passed for r in results):
        where = localise()
        for r in results:
            if not r.passed:
                r.divergence = where or "outputs only (every traced layer within tolerance)"
    return results


