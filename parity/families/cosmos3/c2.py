"""cosmos3 C2: logprob identity. SDE rollouts through the engine (the serving loop with behavior capture) against
the trainer's recompute of the same steps, per SDE step: mean / max |delta logp| and the ratio exp(delta).

Engine rollout vs engine recompute (batch-invariant mode) must be identical (0.0, ratio exactly 1, step 0
included): Flow-GRPO with CFG and without, DanceGRPO, an SDE window, two and three stepped modalities (vision +
sound, vision + sound + action), a batch of 8 against each sample alone, with and without the und cache, and after
a weight update. The readable reference recomputes the same records and re-samples the same seeds (tolerance: two
implementations of the model); a multi-modality sample is compared per modality and as a whole (the sample's
logprob: each side's own element-weighted mean over modalities). The faults below are planted around the engine's
rollouts only (the recompute is clean) and must fail.
"""

from __future__ import annotations

import torch

from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.sampling import ActionSpec, Cosmos3GenerateRequest, SDEConfig, UniPCConfig
from parity.families.cosmos3.cases import condition
from parity.families.cosmos3.common import load_reference, resolve_models
from parity.family import DTYPES, Fault
from parity.report import CheckResult, Report
from parity.rollout_checks import (LogprobIdentity, ReferenceLogprobs, c2_faults, check_fault, cpu_threads,
                                   record_modalities_weighed_equally)

import optimized
import reference.cosmos3 as ref
from reference.cosmos3.recompute import recompute_logprobs as reference_recompute
from reference.solvers.sde import sample_logprobs

STEPS = 4
REFERENCE_TOL = {"fp32": 1e-4, "bf16": 5e-2}   # |delta logp| between the two implementations
SERVING_BATCH_TOL = 1e-5                        # plain batched forwards (not batch-invariant mode) vs alone
SOUND_FRAMES = 8                                # 64 sound elements beside 288 vision ones: unequal weights


def request(cfg: Cosmos3Config, seed: int, guidance: float = 5.0, sde: SDEConfig = SDEConfig(0.7),
            prompt_seed: int = 0, **kw) -> Cosmos3GenerateRequest:
    g = torch.Generator().manual_seed(3000 + prompt_seed)
    base = dict(text_ids=torch.randint(0, cfg.vocab_size, (7,), generator=g),
                negative_text_ids=torch.randint(0, cfg.vocab_size, (3,), generator=g),
                latent_frames=3, latent_height=4, latent_width=6, num_steps=STEPS, guidance_scale=guidance,
                seed=seed, scheduler=UniPCConfig(flow_shift=3.0), sde=sde)
    base.update(kw)
    return Cosmos3GenerateRequest(**base)


def multi_modality_cases(cfg: Cosmos3Config) -> dict[str, Cosmos3GenerateRequest]:
    """Rollouts that step more than vision: vision + sound, and vision + sound + action (policy mode: every action
    row noisy, padded channels re-zeroed), as far as the model has the heads."""
    cases = {}
    if cfg.has_sound:
        cases["vision_sound"] = request(cfg, 5, sound_frames=SOUND_FRAMES)
        if cfg.has_action:
            raw, dom = max(1, cfg.action_dim - 2), cfg.num_embodiment_domains - 1
            cases["vision_sound_action"] = request(
                cfg, 6, sound_frames=SOUND_FRAMES, action=ActionSpec("policy", 3, dom, raw_action_dim=raw),
                vision_condition_frames=(0,), condition_latents=condition(cfg, 6))
    return cases


def reference_rollout(reference, r: Cosmos3GenerateRequest) -> ReferenceLogprobs:
    """The reference re-samples the request's seed: its logprobs per modality and as a whole."""
    out = ref.generate(reference, r)
    final = {"vision": out.vision, "sound": out.sound, "action": out.action}
    return ReferenceLogprobs(out.logprobs, sample_logprobs(out.logprobs, {m: final[m].numel() for m in out.logprobs}))


def perturbed_state(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The "updated policy": every weight nudged by 1e-2 N(0, 1), seeded."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in sorted(state.items())}


# ------------------------------------------------------------------------------------------------ faults

C2_FAULTS, FAULTS = c2_faults("und", "a weight update keeps the old version's und K/V cache")
C2_FAULTS["record-modalities-weighed-equally"] = record_modalities_weighed_equally
FAULTS += (Fault("record-modalities-weighed-equally", "the rollout's record weighs every stepped modality "
                 "equally: its sample logprob is the plain mean over modalities", "C2"),)


# ------------------------------------------------------------------------------------------------ the runner

def c2_checks(prefix: str, cfg: Cosmos3Config, state: dict[str, torch.Tensor], device: str, dname: str,
              fault: str | None, progress) -> list[CheckResult]:
    dtype = DTYPES[dname]
    engine = optimized.Engine.from_state_dict(cfg, state, device=device, dtype=dtype, weights_version="policy-v1",
                                              batching="greedy")   # batch composition must not depend on timing
    reference = load_reference(cfg, state, device, dtype)
    c2 = LogprobIdentity(prefix, engine, C2_FAULTS, fault)

    progress(f"[C2] {prefix}: single rollouts")
    cases = {
        "flow_grpo_cfg": request(cfg, 1),
        "flow_grpo_no_cfg": request(cfg, 2, guidance=1.0),
        "dance_grpo_cfg": request(cfg, 3, sde=SDEConfig(0.7, "dance_grpo")),
        "sde_window": request(cfg, 4, sde=SDEConfig(0.7, sde_window=(1, 3))),
        **multi_modality_cases(cfg),
    }
    samples = c2.single_cases(cases)
    # the und cache: a recompute that computes every prompt's und stream afresh, and a rollout that does too
    c2.without_cache("flow_grpo_cfg", samples, cases, "und")

    progress(f"[C2] {prefix}: a group of 8 in one batch")
    c2.group_of_8([request(cfg, 100 + k, guidance=5.0) for k in range(8)], SERVING_BATCH_TOL)

    progress(f"[C2] {prefix}: the readable reference")
    c2.against_reference(
        ("flow_grpo_cfg", "dance_grpo_cfg", "sde_window", *multi_modality_cases(cfg)), samples,
        lambda s: reference_recompute(reference, s.request, [s.record.latents_at(i) for i in range(STEPS + 1)]),
        lambda r: reference_rollout(reference, r), REFERENCE_TOL[dname])

    progress(f"[C2] {prefix}: after a weight update")
    c2.after_weight_update(request(cfg, 7, prompt_seed=9), {"transformer": perturbed_state(state, 11)}, "und")
    return c2.checks


def run_c2(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress, **_) -> Report:
    check_fault("cosmos3", "C2", C2_FAULTS, fault)
    report = Report("cosmos3", "C2", {"variants": variants or "default", "checkpoint": checkpoint, "device": device,
                                      "dtypes": dtypes, "seed": seed, "fault": fault, "steps": STEPS})
    for vname, cfg, state in resolve_models(variants, checkpoint, seed):
        for dname in dtypes:
            with cpu_threads(device):
                report.checks += c2_checks(f"{vname}/{dname}", cfg, state, device, dname, fault, progress)
    return report
