"""wan C2: logprob identity. SDE rollouts through the engine (WanDenoiseLoop with behavior capture) against the
trainer's recompute, per SDE step: mean / max |delta logp| and the ratio exp(delta).

Engine rollout vs engine recompute (batch-invariant mode) must be identical (0.0, ratio exactly 1, step 0
included): Flow-GRPO on the Euler tables with CFG and without, on the UniPC tables, DanceGRPO, an SDE window, a
group of 8 in one batch against each sample alone, with and without the text-embedding cache, after a weight
update; two-expert models switch experts inside the rollout. The readable reference pipeline recomputes the same
records and re-samples the same seeds. Faults are planted around the engine's rollouts only and must fail.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import torch

from manifests.solvers import SDEConfig
from manifests.wan import WanModelConfig
from parity.errors import SetupError
from parity.families.wan.common import ModelUnderTest, make_request, reference_pipeline, resolve_models
from parity.family import DTYPES, Fault
from parity.report import CheckResult, Report
from parity.rollout_checks import (cpu_threads, exact_check, logprob_check, sde_noise_level_mismatch,
                                   sde_sigma_off_by_one, stale_cache_after_update)

import optimized
from optimized.training.records import CaptureSpec
from optimized.training.recompute import cache_use, recompute_logprobs
from optimized.training.rollout import rollout
from reference.wan.recompute import recompute_logprobs as reference_recompute

DEFAULT_VARIANTS = ("tiny-2.1-t2v", "tiny-2.2-t2v-a14b")
REFERENCE_TOL = {"fp32": 1e-4, "bf16": 5e-2}
SERVING_BATCH_TOL = 1e-5                     # plain batched forwards (not batch-invariant mode) vs alone

C2_FAULTS = {
    "sde-sigma-off-by-one": sde_sigma_off_by_one,
    "sde-noise-level-mismatch": sde_noise_level_mismatch,
    "stale-text-cache-after-update": stale_cache_after_update,
}
FAULTS = (
    Fault("sde-sigma-off-by-one", "the rollout's SDE steps read the sigma table one step late", "C2"),
    Fault("sde-noise-level-mismatch", "the rollout samples with noise_level 0.75, the record says 0.7", "C2"),
    Fault("stale-text-cache-after-update", "a weight update keeps the old version's text embeddings", "C2"),
)


@contextlib.contextmanager
def planted(fault: str | None) -> Iterator[None]:
    if fault is None:
        yield
        return
    with C2_FAULTS[fault]():
        yield


def sde_request(cfg: WanModelConfig, seed: int, guidance: float = 5.0, sde: SDEConfig = SDEConfig(0.7),
                solver: str = "euler", prompt: int = 0):
    """One prompt (`prompt`), any seed: make_request draws the prompt from its seed, so the seed is set after."""
    return replace(make_request(cfg, prompt, guidance=guidance, solver=solver, sde=sde), seed=seed)


def perturbed(weights: dict[str, dict[str, torch.Tensor]], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """The "updated policy": every DiT and text-encoder weight nudged by 1e-2 N(0, 1), seeded (the VAE kept)."""
    g = torch.Generator().manual_seed(seed)
    return {c: ({k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in sorted(s.items())} if c != "vae" else s)
            for c, s in weights.items()}


def c2_checks(prefix: str, m: ModelUnderTest, device: str, dname: str, fault: str | None,
              progress) -> list[CheckResult]:
    cfg = m.cfg
    engine = optimized.Engine.from_weights(cfg, m.weights, device, DTYPES[dname], weights_version="policy-v1")
    pipe = reference_pipeline(m, device)
    bi = CaptureSpec(latents=True, batch_invariant=True)
    checks: list[CheckResult] = []

    def run(reqs, capture=bi):
        with planted(fault):
            return rollout(engine, reqs, capture)

    def identity(name: str, sample, want_steps=None, use_cache=True) -> None:
        rc = recompute_logprobs(engine, sample.record, sample.request, use_cache=use_cache)
        checks.append(logprob_check(f"{prefix}/{name}", sample.record.logprob, rc.logprob, 0.0, want_steps))
        if rc.table_mismatch:
            checks.append(exact_check(f"{prefix}/{name}:tables", False, rc.table_mismatch))

    progress(f"[C2] {prefix}: single rollouts")
    cases = {
        "flow_grpo_euler_cfg": sde_request(cfg, 1),
        "flow_grpo_euler_no_cfg": sde_request(cfg, 2, guidance=1.0),
        "flow_grpo_unipc_tables": sde_request(cfg, 3, solver="unipc"),
        "dance_grpo_cfg": sde_request(cfg, 4, sde=SDEConfig(0.7, "dance_grpo")),
        "sde_window": sde_request(cfg, 5, sde=SDEConfig(0.7, sde_window=(1, 3))),
    }
    samples = dict(zip(cases, run(list(cases.values()))))
    for name, s in samples.items():
        identity(name, s, want_steps=[1, 2] if name == "sde_window" else None)
    if cfg.two_experts:
        experts = samples["flow_grpo_euler_cfg"].record.experts
        checks.append(exact_check(f"{prefix}/flow_grpo_euler_cfg:experts", set(experts) == {1, 2},
                                  f"experts per step {experts} (both must run)"))

    s = samples["flow_grpo_euler_cfg"]
    identity("flow_grpo_euler_cfg/recompute_without_text_cache", s, use_cache=False)
    with cache_use(engine.model, False):
        cold, = run([cases["flow_grpo_euler_cfg"]])
    checks.append(logprob_check(f"{prefix}/flow_grpo_euler_cfg/rollout_without_text_cache", s.record.logprob,
                                cold.record.logprob, 0.0))

    progress(f"[C2] {prefix}: a group of 8 in one batch")
    group = [sde_request(cfg, 100 + k) for k in range(8)]
    batched = run(group)
    alone = [run([r])[0] for r in group]
    sizes = sorted({b for x in batched for b in x.record.batch_sizes})
    checks.append(exact_check(f"{prefix}/batch8/ran_as_one_batch", sizes == [8], f"batch sizes {sizes}"))
    for k in (0, 7):
        checks.append(logprob_check(f"{prefix}/batch8/sample{k}_vs_alone", alone[k].record.logprob,
                                    batched[k].record.logprob, 0.0))
        identity(f"batch8/sample{k}", batched[k])
    serving = run(group, CaptureSpec(latents=True, batch_invariant=False))
    checks.append(logprob_check(f"{prefix}/batch8_serving_batched/sample3_vs_alone", alone[3].record.logprob,
                                serving[3].record.logprob, SERVING_BATCH_TOL))

    progress(f"[C2] {prefix}: the readable reference")
    tol = REFERENCE_TOL[dname]
    for name in ("flow_grpo_euler_cfg", "dance_grpo_cfg", "sde_window"):
        s = samples[name]
        lp = reference_recompute(pipe, s.request, s.record.latents["vision"])
        ref_lp = torch.tensor([float("nan") if x is None else float(x) for x in lp])
        checks.append(logprob_check(f"{prefix}/{name}/reference_recompute", s.record.logprob, ref_lp, tol))
        res = pipe.generate(s.request)
        ref_roll = torch.tensor([float("nan") if x is None else float(x) for x in res.logprobs])
        checks.append(logprob_check(f"{prefix}/{name}/reference_rollout", s.record.logprob, ref_roll, tol))

    progress(f"[C2] {prefix}: after a weight update")
    warm = sde_request(cfg, 7, prompt=9)
    run([warm])  # the prompt's embeddings are now cached under policy-v1
    with planted(fault):
        update = engine.update_weights(perturbed(m.weights, 11), "policy-v2")
    after, = run([warm])
    checks.append(exact_check(f"{prefix}/weight_update/record_version", after.record.weights_version == "policy-v2",
                              f"record carries {after.record.weights_version!r}, update {update}"))
    identity("weight_update/recompute_without_text_cache", after, use_cache=False)
    return checks


def run_c2(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress, **_) -> Report:
    if fault is not None and fault not in C2_FAULTS:
        raise SetupError(f"fault {fault!r} is not planted at C2 for wan (C2 faults: {', '.join(C2_FAULTS)})")
    report = Report("wan", "C2", {"variants": variants or list(DEFAULT_VARIANTS), "checkpoint": checkpoint,
                                  "device": device, "dtypes": dtypes, "seed": seed, "fault": fault})
    chosen = variants or ([] if checkpoint else list(DEFAULT_VARIANTS))
    for m in resolve_models(chosen, checkpoint, seed, kinds=("model",)):
        for dname in dtypes:
            with cpu_threads(device):
                report.checks += c2_checks(f"{m.name}/{dname}", m, device, dname, fault, progress)
    return report
