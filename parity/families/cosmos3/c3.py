"""cosmos3 C3: rollout distributions of the engine against the readable sampler: K seeded SDE rollouts per side,
compared as distributions. The checks (reference_vs_engine, batch_composition, control/<knob>, power/<knob>) and
the tests are parity/rollout_checks.py's (rollout_distribution_checks), at alpha = 0.01.
"""

from __future__ import annotations

import torch

from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.sampling import SDEConfig
from parity.families.cosmos3.c2 import request
from parity.families.cosmos3.common import load_reference, resolve_models
from parity.family import DTYPES, Fault
from parity.report import CheckResult, Report, exceptions_fail
from parity.rollout_checks import (C3_ALPHA, C3_BASE, check_fault, cpu_threads, engine_sides, guidance_drift,
                                   rollout_distribution_checks, sample_set)

import optimized
import reference.cosmos3 as ref

K = 64
DEFAULT_VARIANTS = ("tiny",)   # tiny-edge's guidance response is weaker: its power is below the control at K
NOISE_LEVEL, GUIDANCE = C3_BASE["noise_level"], C3_BASE["guidance"]


def _guidance_drift():
    from optimized.models.cosmos3 import loops
    return guidance_drift(loops)


C3_FAULTS = {"guidance-drift": _guidance_drift}
FAULTS = (Fault("guidance-drift", "the engine's CFG combine uses 1.1 x the guidance scale", "C3"),)


def _req(cfg: Cosmos3Config, seed: int, noise_level: float = NOISE_LEVEL, guidance: float = GUIDANCE):
    return request(cfg, seed, guidance=guidance, sde=SDEConfig(noise_level))


def reference_side(model, cfg, seeds, **kw):
    finals, lps = [], []
    for s in seeds:
        res = ref.generate(model, _req(cfg, s, **kw))
        finals.append(res.vision)
        lps.append(torch.tensor([float(x) for x in res.logprobs["vision"]]))
    return sample_set(finals, lps)


def c3_checks(prefix: str, cfg: Cosmos3Config, state, device: str, dname: str, fault: str | None,
              progress) -> list[CheckResult]:
    dtype = DTYPES[dname]
    engine = optimized.Engine.from_state_dict(cfg, state, device=device, dtype=dtype, batching="greedy")
    model = load_reference(cfg, state, device, dtype)
    small = lambda: optimized.Engine.from_state_dict(cfg, state, device=device, dtype=dtype, max_batch=3,
                                                     batching="greedy")
    sides = engine_sides(lambda seeds, **kw: reference_side(model, cfg, seeds, **kw), engine, small,
                         lambda s, **kw: _req(cfg, s, **kw),
                         lambda k: request(cfg, 10_000 + k, prompt_seed=5, sde=SDEConfig(0.5)), C3_FAULTS, fault)
    return rollout_distribution_checks(prefix, sides, K, progress)


def run_c3(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress, **_) -> Report:
    check_fault("cosmos3", "C3", C3_FAULTS, fault)
    report = Report("cosmos3", "C3", {"variants": variants or list(DEFAULT_VARIANTS), "checkpoint": checkpoint,
                                      "device": device,
                                      "dtypes": dtypes, "seed": seed, "fault": fault, "K": K, "alpha": C3_ALPHA})
    chosen = variants or ([] if checkpoint else list(DEFAULT_VARIANTS))
    for vname, cfg, state in resolve_models(chosen, checkpoint, seed):
        for dname in dtypes:
            with cpu_threads(device), exceptions_fail(report.checks, f"{vname}/{dname}"):  # fails these rows only
                report.checks += c3_checks(f"{vname}/{dname}", cfg, state, device, dname, fault, progress)
    return report
