"""cosmos3 C2: logprob identity. SDE rollouts through the engine (the serving loop with behavior capture) against
the trainer's recompute of the same steps, per SDE step: mean / max |delta logp| and the ratio exp(delta).

Engine rollout vs engine recompute (batch-invariant mode) must be identical (0.0, ratio exactly 1, step 0
included): Flow-GRPO with CFG and without, DanceGRPO, an SDE window, a batch of 8 against each sample alone, with
and without the und cache, and after a weight update. The readable reference recomputes the same records and
re-samples the same seeds (tolerance: two implementations of the model). The faults below are planted around the
engine's rollouts only (the recompute is clean) and must fail.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, SDEConfig, UniPCConfig
from parity.errors import SetupError
from parity.families.cosmos3.common import load_reference, resolve_models
from parity.family import DTYPES, Fault
from parity.report import CheckResult, Report
from parity.rollout_checks import (cpu_threads, exact_check, logprob_check, sde_noise_level_mismatch,
                                   sde_sigma_off_by_one, stale_cache_after_update)

import optimized
import reference.cosmos3 as ref
from optimized.training.records import CaptureSpec
from optimized.training.recompute import cache_use, recompute_logprobs
from optimized.training.rollout import rollout
from reference.cosmos3.recompute import recompute_logprobs as reference_recompute

STEPS = 4
REFERENCE_TOL = {"fp32": 1e-4, "bf16": 5e-2}   # |delta logp| between the two implementations
SERVING_BATCH_TOL = 1e-5                        # plain batched forwards (not batch-invariant mode) vs alone


def request(cfg: Cosmos3Config, seed: int, guidance: float = 5.0, sde: SDEConfig = SDEConfig(0.7),
            prompt_seed: int = 0, **kw) -> Cosmos3GenerateRequest:
    g = torch.Generator().manual_seed(3000 + prompt_seed)
    base = dict(text_ids=torch.randint(0, cfg.vocab_size, (7,), generator=g),
                negative_text_ids=torch.randint(0, cfg.vocab_size, (3,), generator=g),
                latent_frames=3, latent_height=4, latent_width=6, num_steps=STEPS, guidance_scale=guidance,
                seed=seed, scheduler=UniPCConfig(flow_shift=3.0), sde=sde)
    base.update(kw)
    return Cosmos3GenerateRequest(**base)


def perturbed_state(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The "updated policy": every weight nudged by 1e-2 N(0, 1), seeded."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in sorted(state.items())}


# ------------------------------------------------------------------------------------------------ faults

C2_FAULTS = {
    "sde-sigma-off-by-one": sde_sigma_off_by_one,
    "sde-noise-level-mismatch": sde_noise_level_mismatch,
    "stale-und-cache-after-update": stale_cache_after_update,
}

FAULTS = (
    Fault("sde-sigma-off-by-one", "the rollout's SDE steps read the sigma table one step late", "C2"),
    Fault("sde-noise-level-mismatch", "the rollout samples with noise_level 0.75, the record says 0.7", "C2"),
    Fault("stale-und-cache-after-update", "a weight update keeps the old version's und K/V cache", "C2"),
)


def check_fault(fault: str | None) -> None:
    if fault is not None and fault not in C2_FAULTS:
        raise SetupError(f"fault {fault!r} is not planted at C2 for cosmos3 (C2 faults: {', '.join(C2_FAULTS)})")


@contextlib.contextmanager
def planted(fault: str | None) -> Iterator[None]:
    if fault is None:
        yield
        return
    with C2_FAULTS[fault]():
        yield


# ------------------------------------------------------------------------------------------------ the runner

def c2_checks(prefix: str, cfg: Cosmos3Config, state: dict[str, torch.Tensor], device: str, dname: str,
              fault: str | None, progress) -> list[CheckResult]:
    dtype = DTYPES[dname]
    engine = optimized.Engine.from_state_dict(cfg, state, device=device, dtype=dtype, weights_version="policy-v1")
    reference = load_reference(cfg, state, device, dtype)
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
        "flow_grpo_cfg": request(cfg, 1),
        "flow_grpo_no_cfg": request(cfg, 2, guidance=1.0),
        "dance_grpo_cfg": request(cfg, 3, sde=SDEConfig(0.7, "dance_grpo")),
        "sde_window": request(cfg, 4, sde=SDEConfig(0.7, sde_window=(1, 3))),
    }
    samples = dict(zip(cases, run(list(cases.values()))))
    for name, s in samples.items():
        identity(name, s, want_steps=[1, 2] if name == "sde_window" else None)

    # the und cache: a recompute that computes every prompt's und stream afresh, and a rollout that does too
    s = samples["flow_grpo_cfg"]
    identity("flow_grpo_cfg/recompute_without_und_cache", s, use_cache=False)
    with cache_use(engine.model, False):
        cold, = run([cases["flow_grpo_cfg"]])
    checks.append(logprob_check(f"{prefix}/flow_grpo_cfg/rollout_without_und_cache", s.record.logprob,
                                cold.record.logprob, 0.0))

    progress(f"[C2] {prefix}: a group of 8 in one batch")
    group = [request(cfg, 100 + k, guidance=5.0) for k in range(8)]
    batched = run(group)
    alone = [run([r])[0] for r in group]
    sizes = sorted({b for s in batched for b in s.record.batch_sizes})
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
    for name in ("flow_grpo_cfg", "dance_grpo_cfg", "sde_window"):
        s = samples[name]
        lp = reference_recompute(reference, s.request, [s.record.latents_at(i) for i in range(STEPS + 1)])
        ref_lp = torch.tensor([float("nan") if x is None else float(x) for x in lp["vision"]])
        checks.append(logprob_check(f"{prefix}/{name}/reference_recompute", s.record.logprob, ref_lp, tol))
        res = ref.generate(reference, s.request)
        ref_roll = torch.tensor([float("nan") if x is None else float(x) for x in res.logprobs["vision"]])
        checks.append(logprob_check(f"{prefix}/{name}/reference_rollout", s.record.logprob, ref_roll, tol))

    progress(f"[C2] {prefix}: after a weight update")
    warm = request(cfg, 7, prompt_seed=9)
    run([warm])  # the prompt's und K/V are now cached under policy-v1
    with planted(fault):
        update = engine.update_weights({"transformer": perturbed_state(state, 11)}, "policy-v2")
    after, = run([warm])
    checks.append(exact_check(f"{prefix}/weight_update/record_version", after.record.weights_version == "policy-v2",
                              f"record carries {after.record.weights_version!r}, update {update}"))
    identity("weight_update/recompute_without_und_cache", after, use_cache=False)
    return checks


def run_c2(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress, **_) -> Report:
    check_fault(fault)
    report = Report("cosmos3", "C2", {"variants": variants or "default", "checkpoint": checkpoint, "device": device,
                                      "dtypes": dtypes, "seed": seed, "fault": fault, "steps": STEPS})
    for vname, cfg, state in resolve_models(variants, checkpoint, seed):
        for dname in dtypes:
            with cpu_threads(device):
                report.checks += c2_checks(f"{vname}/{dname}", cfg, state, device, dname, fault, progress)
    return report
