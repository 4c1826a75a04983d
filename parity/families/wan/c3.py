"""wan C3: rollout distributions of the engine against the reference pipelines: K seeded SDE rollouts per side,
compared as distributions. The checks (reference_vs_engine, batch_composition, control/<knob>, power/<knob>) and
the tests are parity/rollout_checks.py's (rollout_distribution_checks), at alpha = 0.01.
"""

from __future__ import annotations

import torch

from manifests.solvers import SDEConfig
from parity.families.wan.c2 import sde_request
from parity.families.wan.common import reference_pipeline, resolve_models
from parity.family import DTYPES, Fault
from parity.report import CheckResult, Report, exceptions_fail
from parity.rollout_checks import (C3_ALPHA, C3_BASE, check_fault, cpu_threads, engine_sides, guidance_drift,
                                   rollout_distribution_checks, sample_set)

import optimized

K = 128
DEFAULT_VARIANTS = ("tiny-2.1-t2v",)
NOISE_LEVEL, GUIDANCE = C3_BASE["noise_level"], C3_BASE["guidance"]


def _guidance_drift():
    from optimized.models.wan import denoise
    return guidance_drift(denoise)


C3_FAULTS = {"guidance-drift": _guidance_drift}
FAULTS = (Fault("guidance-drift", "the engine's CFG combine uses 1.1 x the guidance scale", "C3"),)


def _req(cfg, seed: int, noise_level: float = NOISE_LEVEL, guidance: float = GUIDANCE):
    return sde_request(cfg, seed, guidance=guidance, sde=SDEConfig(noise_level))


def reference_side(pipe, cfg, seeds, **kw):
    finals, lps = [], []
    for s in seeds:
        res = pipe.generate(_req(cfg, s, **kw))
        finals.append(res.latents)
        lps.append(torch.tensor([float(x) for x in res.logprobs]))
    return sample_set(finals, lps)


def c3_checks(prefix: str, m, device: str, dname: str, fault: str | None, progress) -> list[CheckResult]:
    dtype, cfg, state = DTYPES[dname], m.cfg, m.weights
    engine = optimized.Engine.from_weights(cfg, state, device, dtype, batching="greedy")
    model = reference_pipeline(m, device)
    small = lambda: optimized.Engine.from_weights(cfg, state, device, dtype, max_batch=3, batching="greedy")
    sides = engine_sides(lambda seeds, **kw: reference_side(model, cfg, seeds, **kw), engine, small,
                         lambda s, **kw: _req(cfg, s, **kw),
                         lambda k: sde_request(cfg, 10_000 + k, prompt=5, sde=SDEConfig(0.5)), C3_FAULTS, fault)
    return rollout_distribution_checks(prefix, sides, K, progress)


def run_c3(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress, **_) -> Report:
    check_fault("wan", "C3", C3_FAULTS, fault)
    report = Report("wan", "C3", {"variants": variants or list(DEFAULT_VARIANTS), "checkpoint": checkpoint,
                                      "device": device,
                                      "dtypes": dtypes, "seed": seed, "fault": fault, "K": K, "alpha": C3_ALPHA})
    chosen = variants or ([] if checkpoint else list(DEFAULT_VARIANTS))
    for m in resolve_models(chosen, checkpoint, seed, kinds=("model",)):
        for dname in dtypes:
            with cpu_threads(device), exceptions_fail(report.checks, f"{m.name}/{dname}"):  # fails these rows only
                report.checks += c3_checks(f"{m.name}/{dname}", m, device, dname, fault, progress)
    return report
