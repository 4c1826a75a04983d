"""cosmos3 C3: rollout distributions. K seeded SDE rollouts per side, disjoint seeds, compared as distributions
(parity/rollout_checks.py: an energy-distance permutation test on the final latents, KS tests on per-sample
statistics: final mean / std and every step's logprob; Bonferroni over the tests, alpha = 0.01).

    reference_vs_engine     the readable sampler vs the engine (K requests in one batch)        must NOT differ
    batch_composition       the engine in one batch vs the engine in batches of 3 beside other
                            requests (allowed nondeterminism)                                   must NOT differ
    control/noise_level     the engine at noise_level 0.75 vs the reference at 0.7              must differ
    control/guidance        the engine at guidance 5.5 vs the reference at 5.0                  must differ
    power/<knob>            the smallest relative perturbation of each knob detected at K (a sweep)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.sampling import SDEConfig
from parity.errors import SetupError
from parity.families.cosmos3.c2 import request
from parity.families.cosmos3.common import load_reference, resolve_models
from parity.family import DTYPES, Fault
from parity.report import CheckResult, Report
from parity.rollout_checks import cpu_threads, distribution_check, min_p, sample_set, two_sample_tests

import optimized
import reference.cosmos3 as ref
from optimized.training.records import CaptureSpec
from optimized.training.rollout import rollout

K = 64
DEFAULT_VARIANTS = ("tiny",)   # tiny-edge's guidance response is weaker: its power is below the control at K
ALPHA = 0.01
NOISE_LEVEL, GUIDANCE = 0.7, 5.0
POWER_SWEEP = (0.02, 0.04, 0.07, 0.1, 0.2)   # relative perturbations tried, smallest first


@contextlib.contextmanager
def _guidance_drift() -> Iterator[None]:
    """The engine's CFG combine uses 1.1 x the request's guidance scale."""
    from optimized.models.cosmos3 import loops
    original = loops.cfg_combine
    loops.cfg_combine = lambda c, u, scale: original(c, u, scale * 1.1)
    try:
        yield
    finally:
        loops.cfg_combine = original


C3_FAULTS = {"guidance-drift": _guidance_drift}
FAULTS = (Fault("guidance-drift", "the engine's CFG combine uses 1.1 x the guidance scale", "C3"),)


@contextlib.contextmanager
def planted(fault: str | None) -> Iterator[None]:
    if fault is None:
        yield
        return
    with C3_FAULTS[fault]():
        yield


def _req(cfg: Cosmos3Config, seed: int, noise_level: float = NOISE_LEVEL, guidance: float = GUIDANCE):
    return request(cfg, seed, guidance=guidance, sde=SDEConfig(noise_level))


def reference_side(model, cfg, seeds, **kw):
    finals, lps = [], []
    for s in seeds:
        res = ref.generate(model, _req(cfg, s, **kw))
        finals.append(res.vision)
        lps.append(torch.tensor([float(x) for x in res.logprobs["vision"]]))
    return sample_set(finals, lps)


def engine_side(engine, cfg, seeds, fault, **kw):
    with planted(fault):
        samples = rollout(engine, [_req(cfg, s, **kw) for s in seeds], CaptureSpec())
    return sample_set([s.latents["vision"] for s in samples], [s.record.logprob for s in samples])


def engine_side_mixed(cfg, state, device, dtype, seeds, fault):
    """The same requests in batches of at most 3, submitted one per tick beside requests of another prompt."""
    engine = optimized.Engine.from_state_dict(cfg, state, device=device, dtype=dtype, max_batch=3)
    from optimized.training.rollout import submit_rollout
    handles = []
    with planted(fault):
        for k, s in enumerate(seeds):
            handles.append(submit_rollout(engine, _req(cfg, s)))
            if k % 4 == 0:
                engine.submit(request(cfg, 10_000 + k, prompt_seed=5, sde=SDEConfig(0.5)))
            engine.step()
        engine.run_until_idle()
    results = [h.result() for h in handles]
    return sample_set([r["latents"]["vision"] for r in results], [r["behavior"].logprob for r in results])


def c3_checks(prefix: str, cfg: Cosmos3Config, state, device: str, dname: str, fault: str | None,
              progress) -> list[CheckResult]:
    dtype = DTYPES[dname]
    engine = optimized.Engine.from_state_dict(cfg, state, device=device, dtype=dtype)
    model = load_reference(cfg, state, device, dtype)
    seeds = lambda block: range(block * K, (block + 1) * K)   # disjoint seed blocks: independent samples
    progress(f"[C3] {prefix}: K={K} rollouts per side")
    reference = reference_side(model, cfg, seeds(0))
    checks = [distribution_check(f"{prefix}/reference_vs_engine", two_sample_tests(
        reference, engine_side(engine, cfg, seeds(1), fault)), ALPHA, expect_same=True)]
    batched = engine_side(engine, cfg, seeds(2), fault)
    mixed = engine_side_mixed(cfg, state, device, dtype, seeds(3), fault)
    checks.append(distribution_check(f"{prefix}/batch_composition", two_sample_tests(batched, mixed), ALPHA,
                                     expect_same=True))
    progress(f"[C3] {prefix}: perturbed controls and power")
    controls = {"noise_level": dict(noise_level=0.75), "guidance": dict(guidance=5.5)}
    for block, (knob, kw) in enumerate(controls.items(), start=4):
        tests = two_sample_tests(reference, engine_side(engine, cfg, seeds(block), fault, **kw))
        checks.append(distribution_check(f"{prefix}/control/{knob}", tests, ALPHA, expect_same=False))
    base = {"noise_level": NOISE_LEVEL, "guidance": GUIDANCE}
    for block, knob in enumerate(base, start=6):
        detected, swept = None, {}
        for rel in POWER_SWEEP:
            other = engine_side(engine, cfg, seeds(block), fault, **{knob: base[knob] * (1 + rel)})
            tests = two_sample_tests(reference, other)
            _, p = min_p(tests)
            swept[rel] = p
            if p <= ALPHA / len(tests):
                detected = rel
                break
        control = controls[knob][knob] / base[knob] - 1
        ok = detected is not None and detected <= control + 1e-9
        detail = (f"smallest detected perturbation at K={K}: {knob} x (1 + {detected})" if detected is not None
                  else f"no perturbation up to {POWER_SWEEP[-1]:.0%} detected at K={K}")
        checks.append(CheckResult(f"{prefix}/power/{knob}", ok, detail=detail,
                                  extra={"min_p_by_perturbation": swept, "control": control}))
    return checks


def run_c3(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress, **_) -> Report:
    if fault is not None and fault not in C3_FAULTS:
        raise SetupError(f"fault {fault!r} is not planted at C3 for cosmos3 (C3 faults: {', '.join(C3_FAULTS)})")
    report = Report("cosmos3", "C3", {"variants": variants or list(DEFAULT_VARIANTS), "checkpoint": checkpoint,
                                      "device": device,
                                      "dtypes": dtypes, "seed": seed, "fault": fault, "K": K, "alpha": ALPHA})
    chosen = variants or ([] if checkpoint else list(DEFAULT_VARIANTS))
    for vname, cfg, state in resolve_models(chosen, checkpoint, seed):
        for dname in dtypes:
            with cpu_threads(device):
                report.checks += c3_checks(f"{vname}/{dname}", cfg, state, device, dname, fault, progress)
    return report
