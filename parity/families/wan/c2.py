"""wan C2: logprob identity. SDE rollouts through the engine (WanDenoiseLoop with behavior capture) against the
trainer's recompute, per SDE step: mean / max |delta logp| and the ratio exp(delta).

Engine rollout vs engine recompute (batch-invariant mode) must be identical (0.0, ratio exactly 1, step 0
included): Flow-GRPO on the Euler tables with CFG and without, on the UniPC tables, DanceGRPO, an SDE window, a
group of 8 in one batch against each sample alone, with and without the text-embedding cache, after a weight
update; two-expert models switch experts inside the rollout. The readable reference pipeline recomputes the same
records and re-samples the same seeds. Faults are planted around the engine's rollouts only and must fail.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from manifests.solvers import SDEConfig
from manifests.wan import WanModelConfig
from parity.families.wan.common import ModelUnderTest, make_request, reference_pipeline, resolve_models
from parity.family import DTYPES
from parity.report import CheckResult, Report
from parity.rollout_checks import (LogprobIdentity, ReferenceLogprobs, c2_faults, check_fault, cpu_threads,
                                   exact_check)

import optimized
from reference.wan.recompute import recompute_logprobs as reference_recompute

DEFAULT_VARIANTS = ("tiny-2.1-t2v", "tiny-2.2-t2v-a14b")
REFERENCE_TOL = {"fp32": 1e-4, "bf16": 5e-2}
SERVING_BATCH_TOL = 1e-5                     # plain batched forwards (not batch-invariant mode) vs alone

C2_FAULTS, FAULTS = c2_faults("text", "a weight update keeps the old version's text embeddings")


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
    engine = optimized.Engine.from_weights(cfg, m.weights, device, DTYPES[dname], weights_version="policy-v1",
                                           batching="greedy")   # batch composition must not depend on timing
    pipe = reference_pipeline(m, device)
    c2 = LogprobIdentity(prefix, engine, C2_FAULTS, fault)

    progress(f"[C2] {prefix}: single rollouts")
    cases = {
        "flow_grpo_euler_cfg": sde_request(cfg, 1),
        "flow_grpo_euler_no_cfg": sde_request(cfg, 2, guidance=1.0),
        "flow_grpo_unipc_tables": sde_request(cfg, 3, solver="unipc"),
        "dance_grpo_cfg": sde_request(cfg, 4, sde=SDEConfig(0.7, "dance_grpo")),
        "sde_window": sde_request(cfg, 5, sde=SDEConfig(0.7, sde_window=(1, 3))),
    }
    samples = c2.single_cases(cases)
    if cfg.two_experts:
        experts = samples["flow_grpo_euler_cfg"].record.experts
        c2.checks.append(exact_check(f"{prefix}/flow_grpo_euler_cfg:experts", set(experts) == {1, 2},
                                     f"experts per step {experts} (both must run)"))
    c2.without_cache("flow_grpo_euler_cfg", samples, cases, "text")

    progress(f"[C2] {prefix}: a group of 8 in one batch")
    c2.group_of_8([sde_request(cfg, 100 + k) for k in range(8)], SERVING_BATCH_TOL)

    progress(f"[C2] {prefix}: the readable reference")
    vision_only = lambda lps: ReferenceLogprobs({"vision": lps}, lps)  # noqa: E731 (one modality: its own)
    c2.against_reference(("flow_grpo_euler_cfg", "dance_grpo_cfg", "sde_window"), samples,
                         lambda s: vision_only(reference_recompute(pipe, s.request, s.record.latents["vision"])),
                         lambda r: vision_only(pipe.generate(r).logprobs), REFERENCE_TOL[dname])

    progress(f"[C2] {prefix}: after a weight update")
    # the prompt's embeddings are cached under policy-v1 before the update
    c2.after_weight_update(sde_request(cfg, 7, prompt=9), perturbed(m.weights, 11), "text")
    return c2.checks


def run_c2(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress, **_) -> Report:
    check_fault("wan", "C2", C2_FAULTS, fault)
    report = Report("wan", "C2", {"variants": variants or list(DEFAULT_VARIANTS), "checkpoint": checkpoint,
                                  "device": device, "dtypes": dtypes, "seed": seed, "fault": fault})
    chosen = variants or ([] if checkpoint else list(DEFAULT_VARIANTS))
    for m in resolve_models(chosen, checkpoint, seed, kinds=("model",)):
        for dname in dtypes:
            with cpu_threads(device):
                report.checks += c2_checks(f"{m.name}/{dname}", m, device, dname, fault, progress)
    return report
