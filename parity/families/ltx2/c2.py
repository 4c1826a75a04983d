"""ltx2 C2: logprob identity. SDE rollouts of each side's own LTX2Pipeline loop, driven with stochastic steps
(parity/families/ltx2/rollout.py: the ltx2 entry has no engine rollout, so the loops are driven directly), against
the trainer's recompute of the same records, per SDE step and per modality: mean / max |delta logp| and the ratio
exp(delta) (parity/rollout_checks.py's logprob_check).

Rows (under `<variant>/float32`):
  <case>, <case>:video, <case>:audio     optimized rollout vs optimized recompute: identical (0.0, ratio exactly 1,
                                         step 0 included); the sample logprob and each stepped modality
  <case>/reference_identity              the reference's own rollout vs its recompute: identical
  <case>/reference_recompute[:m]         the optimized record recomputed by the reference loop   |dlogp| <= 1e-4
  <case>/reference_rollout[:m]           the reference re-samples the same seed (same noise)    |dlogp| <= 1e-4
  <case>/reference_rollout:final_<m>     ... and its final latents vs the optimized ones (C1 tolerance)
  batch8/ran_as_one_batch                8 requests in one optimized call: 16 rows (CFG) per forward
  batch8/sample<k>_vs_alone              batched vs the request alone                          |dlogp| <= 1e-5
  batch8/sample<k>                       the batched rollout's batched recompute: identical
Cases: Flow-GRPO with CFG and without (guidance 1 on both streams), DanceGRPO, an SDE window (steps 1, 2 of 4).

Faults (planted around the optimized rollouts only; the recompute is clean; each must fail and name its step and
modality): the shared `sde-sigma-off-by-one`, `sde-noise-level-mismatch`, `record-modalities-weighed-equally`
(parity/rollout_checks.py, planted in optimized.solvers.sde / optimized.training.records, which the optimized
rollout uses) and `c2-audio-uses-video-guidance` (the optimized loop handed the video guidance scale for the audio
stream: the audio rows fail from step 0, the video rows stay identical: the recompute is teacher-forced on the
rollout's own states).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from manifests.ltx2 import key_shapes, load_variant
from manifests.ltx2.connectors import (
    connector_gains,
    connector_key_shapes,
    load_connectors_variant,
)
from manifests.ltx2.keys import GAINS
from manifests.ltx2.sampling import Ltx2Request, Ltx2SchedulerConfig
from manifests.parity import load_parity_contract
from manifests.solvers import SDEConfig
from parity.families.ltx2 import c1
from parity.families.ltx2.rollout import (
    MODALITIES,
    OptimizedSide,
    ReferenceSide,
    SdeCase,
    recompute,
    rollouts,
)
from parity.family import Fault
from parity.patching import patched
from parity.port.kit import gain_init
from parity.report import CheckResult, Report, exceptions_fail, tensor_check
from parity.rollout_checks import (
    check_fault,
    cpu_threads,
    exact_check,
    logprob_check,
    record_modalities_weighed_equally,
    sde_noise_level_mismatch,
    sde_sigma_off_by_one,
)
from parity.weights import random_state_dict

STEPS = 4
DEFAULT_VARIANTS = ("tiny", "tiny-2.3")
REFERENCE_TOL = 1e-4          # |delta logp| between the two implementations (measured <= 1e-6 on CPU fp32)
SERVING_BATCH_TOL = 1e-5      # a request batched with 7 others vs alone


def audio_uses_video_guidance():
    """The optimized loop guides the audio stream with the video scale (the C1 fault, now inside a rollout)."""
    from optimized.models.ltx2 import pipeline

    def make(original):   # planted in the model's loop (the seam the catalogue's guidance mutations edit)
        def generate_latents(transformer, connectors, requests, *a, **kw):
            requests = [dataclasses.replace(r, audio_guidance_scale=r.guidance_scale) for r in requests]
            return original(transformer, connectors, requests, *a, **kw)
        return generate_latents
    return patched(pipeline, "generate_latents", make)


C2_FAULTS = {"sde-sigma-off-by-one": sde_sigma_off_by_one, "sde-noise-level-mismatch": sde_noise_level_mismatch,
             "record-modalities-weighed-equally": record_modalities_weighed_equally,
             "c2-audio-uses-video-guidance": audio_uses_video_guidance}
FAULTS = (Fault("sde-sigma-off-by-one", "the optimized rollout's SDE steps read the sigma table one step late", "C2",
                "step 0"),
          Fault("sde-noise-level-mismatch", "the optimized rollout samples with noise_level 0.75, the record says 0.7",
                "C2", "step 0"),
          Fault("record-modalities-weighed-equally", "the optimized rollout's sample logprob is the plain mean over "
                "video and audio (not element-weighted)", "C2", "sample"),
          Fault("c2-audio-uses-video-guidance", "the optimized rollout guides the audio stream with the video scale",
                "C2", "step 0 audio"))


@contextlib.contextmanager
def planted(fault: str | None) -> Iterator[None]:
    if fault is None:
        yield
        return
    with C2_FAULTS[fault]():
        yield


@dataclasses.dataclass
class Setup:
    tcfg: object
    ccfg: object
    reference: ReferenceSide
    optimized: OptimizedSide
    stats: dict
    texts: list
    sched: Ltx2SchedulerConfig
    media: object = c1.MEDIA


def setup(tvar: str, cvar: str, seed: int) -> Setup:
    """C1's tiny pairs, weights and text states (parity/families/ltx2/c1.py)."""
    tcfg, ccfg = load_variant(tvar), load_connectors_variant(cvar)
    tstate = random_state_dict(key_shapes(tcfg), seed, gain_init(GAINS))
    cstate = random_state_dict(connector_key_shapes(ccfg), seed + 1, gain_init(connector_gains(ccfg)))
    return Setup(tcfg, ccfg, ReferenceSide(tcfg, tstate, ccfg, cstate), OptimizedSide(tcfg, tstate, ccfg, cstate),
                 c1.stats(tcfg, seed), c1.prompts(ccfg.caption_channels * c1.TEXT_LAYERS, seed + 3),
                 Ltx2SchedulerConfig())


def case(s: Setup, seed: int, guidance: float = 3.0, audio_guidance: float = 7.0, sde: SDEConfig | None = None,
         prompt: int = 0) -> SdeCase:
    req = Ltx2Request(height=64, width=64, num_frames=9, frame_rate=24.0, num_inference_steps=STEPS,
                      guidance_scale=guidance, audio_guidance_scale=audio_guidance, guidance_rescale=0.7,
                      audio_guidance_rescale=0.7, seed=seed)
    return SdeCase(req, s.texts[prompt % len(s.texts)], sde or SDEConfig(0.7))


def located(check: CheckResult, what: str, tol: float) -> CheckResult:
    """A failing logprob row names its first divergent step and what it compared (`step <i> <what>`)."""
    if not check.passed:
        ex = check.extra or {}
        bad = [i for i, d in zip(ex.get("steps", []), ex.get("abs_delta", [])) if not d <= tol]
        check.divergence = f"step {bad[0]} {what}" if bad else f"steps {what}"
    return check


def identity_rows(name: str, rollout, recomputed, tol: float, want_steps=None) -> list[CheckResult]:
    """The sample logprob, then every modality's."""
    rows = [located(logprob_check(name, rollout.sample, recomputed.sample, tol, want_steps), "sample", tol)]
    rows += [located(logprob_check(f"{name}:{m}", rollout.logprobs[m], recomputed.logprobs[m], tol, want_steps), m,
                     tol) for m in MODALITIES]
    return rows


def c2_checks(prefix: str, s: Setup, fault: str | None, progress) -> list[CheckResult]:
    args = (s.stats, s.media, s.sched)
    checks: list[CheckResult] = []
    cases = {"flow_grpo_cfg": case(s, 1), "flow_grpo_no_cfg": case(s, 2, guidance=1.0, audio_guidance=1.0),
             "dance_grpo_cfg": case(s, 3, sde=SDEConfig(0.7, "dance_grpo"), prompt=1),
             "sde_window": case(s, 4, sde=SDEConfig(0.7, sde_window=(1, 3)))}
    c1_tol = load_parity_contract("ltx2").tolerance("C1", "float32", "cpu")
    progress(f"[ltx2 C2] {prefix}: single rollouts, recomputes, the reference")
    for name, c in cases.items():
        want = [1, 2] if name == "sde_window" else None
        with exceptions_fail(checks, f"{prefix}/{name}"):
            with planted(fault):
                got, = rollouts(s.optimized, [c], *args)
            checks += identity_rows(f"{prefix}/{name}", got, recompute(s.optimized, [c], [got], *args)[0], 0.0, want)
            mine, = rollouts(s.reference, [c], *args)
            checks += identity_rows(f"{prefix}/{name}/reference_identity", mine,
                                    recompute(s.reference, [c], [mine], *args)[0], 0.0, want)[:1]
            checks += identity_rows(f"{prefix}/{name}/reference_recompute", got,
                                    recompute(s.reference, [c], [got], *args)[0], REFERENCE_TOL, want)
            checks += identity_rows(f"{prefix}/{name}/reference_rollout", got, mine, REFERENCE_TOL, want)
            for m in MODALITIES:
                checks.append(tensor_check(f"{prefix}/{name}/reference_rollout:final_{m}", getattr(got, m),
                                           getattr(mine, m), c1_tol))

    progress(f"[ltx2 C2] {prefix}: a group of 8 in one batch")
    with exceptions_fail(checks, f"{prefix}/batch8"):
        group = [case(s, 100 + k, prompt=k) for k in range(8)]
        with planted(fault):
            batched = rollouts(s.optimized, group, *args)
            alone = rollouts(s.optimized, group, *args, batched=False)
        rows = sorted({r for x in batched for r in x.rows})
        checks.append(exact_check(f"{prefix}/batch8/ran_as_one_batch", rows == [16],
                                  f"rows per forward {rows} (8 requests x [uncond | cond])"))
        again = recompute(s.optimized, group, batched, *args)
        for k in (0, 7):
            checks.append(located(logprob_check(f"{prefix}/batch8/sample{k}_vs_alone", alone[k].sample,
                                                batched[k].sample, SERVING_BATCH_TOL), "sample", SERVING_BATCH_TOL))
            checks += identity_rows(f"{prefix}/batch8/sample{k}", batched[k], again[k], 0.0)
    return checks


def run_c2(variants: list[str] | None = None, checkpoint: str | None = None, device: str = "cpu",
           dtypes: list[str] | None = None, seed: int = 0, fault: str | None = None, progress=None, **_) -> Report:
    from parity.errors import SetupError
    check_fault("ltx2", "C2", C2_FAULTS, fault)
    progress = progress or (lambda msg: None)
    if checkpoint is not None or device != "cpu":
        raise SetupError("ltx2 C2 runs the tiny variants on CPU (fp32) only")
    if dtypes and set(dtypes) != {"fp32"}:
        raise SetupError(f"ltx2 C2 runs fp32 only (got --dtype {', '.join(dtypes)})")
    pairs = [p for p in c1.PAIRS if p[0] in (variants or DEFAULT_VARIANTS)]
    if not pairs:
        raise SetupError(f"ltx2 C2 variants: {', '.join(p[0] for p in c1.PAIRS)}")
    report = Report("ltx2", "C2", {"variants": [p[0] for p in pairs], "seed": seed, "fault": fault, "steps": STEPS,
                                   "dtype": "float32", "reference_tol": REFERENCE_TOL})
    for tvar, cvar in pairs:
        with cpu_threads(device), torch.no_grad(), exceptions_fail(report.checks, f"{tvar}/float32"):
            report.checks += c2_checks(f"{tvar}/float32", setup(tvar, cvar, seed), fault, progress)
    return report
