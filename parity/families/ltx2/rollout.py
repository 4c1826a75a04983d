"""ltx2 SDE rollouts for C2 / C3: each side's own LTX2Pipeline loop (reference/ltx2/pipeline.py, one request at a
time; optimized/models/ltx2/pipeline.py, requests batched) driven with stochastic steps and per-step
log-probabilities, without editing either loop. (The ltx2 runtime entry has no SDE loop kernel, so C2 / C3 drive
the loops directly; the shared Engine rollout machinery of wan / cosmos3 does not apply.)

How a loop is driven, per side and per call:
- the transformer handed to the loop is wrapped (`_Watch`): each forward records the latents entering the step
  (the first R rows of its video / audio inputs: the state itself, CFG duplicates it) and how many rows it ran;
- the loop's `trace(step.<i>.<modality>, x)` hands the hook the loop's own state after its guided Euler step; the
  guided velocity is v = (x_euler - x_in) / (sigma_next - sigma) with the side's own sigma table
  (`sigma_schedule` / `schedule`), and on an SDE step the hook replaces the state in place by the SDE sample of the
  side's own solver (reference `reference.solvers.sde.FlowSDE`, optimized `optimized.solvers.sde.sde_step`), which
  the loop then carries on from. ODE steps keep the loop's own Euler result.
- recompute (the trainer's side): the same loop, teacher-forced: every step's state is replaced by the record's
  next latents and the transition's log-probability is evaluated (`FlowSDE.logprob` / `step_logprob`). The initial
  latents are the loop's own draw from the seed; they must equal the record's (checked).

Noise (manifests/solvers.py SDEConfig): one CPU generator per request seeded with its seed, advanced past the loop's
initial draws (video [1, C, F, H, W], then audio [1, C, L, M]), then per SDE step one fp32 randn of each stepped
modality's packed state ([1, tokens, C]: video, then audio). Each modality's logprob is the Gaussian log-density per
element; the sample's is each side's own element-weighted mean (`reference.solvers.sde.sample_logprobs`,
`optimized.training.records.sample_logprob` with `records.element_counts`).

What is shared harness here (and so not checked by C2): the velocity recovery, the in-place injection and the noise
draws. Everything numeric beyond that is the side's own: connectors, DiT, schedule, guidance + rescale, the SDE
step, its log-density and the sample reduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import optimized.models.ltx2 as opt
import reference.ltx2 as ref
from manifests.ltx2.sampling import Ltx2Media, Ltx2Request, Ltx2SchedulerConfig
from manifests.solvers import SDEConfig
from optimized.models.ltx2.connectors import load_connectors as fast_connectors
from optimized.models.ltx2.pipeline import Ltx2Prompt
from reference.ltx2.connectors import load_connectors as ref_connectors

MODALITIES = ("video", "audio")


@dataclass(frozen=True)
class SdeCase:
    """One rollout request: LTX2Pipeline's request, its text-encoder states (embeds, mask, negative embeds,
    negative mask; batch 1) and the SDE settings."""
    request: Ltx2Request
    text: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    sde: SDEConfig


@dataclass
class Rollout:
    """One request's rollout (or recompute): the states entering every step (N + 1, packed [1, tokens, C]), the
    per-modality logprobs (fp32 [N], NaN on ODE steps), the sample logprob, the loop's de-normalised outputs."""
    latents: dict[str, list[torch.Tensor]]
    logprobs: dict[str, torch.Tensor]
    sample: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    rows: list[int] = field(default_factory=list)     # rows of every transformer forward the request ran in


# ------------------------------------------------------------------------------------------------ the two sides

class ReferenceSide:
    name = "reference"

    def __init__(self, tcfg, tstate, ccfg, cstate):
        self.transformer, self.connectors = ref.load_model(tcfg, tstate), ref_connectors(ccfg, cstate)

    @staticmethod
    def sigmas(steps: int, tokens: int, sched: Ltx2SchedulerConfig) -> torch.Tensor:
        from reference.ltx2.pipeline import sigma_schedule
        return sigma_schedule(steps, tokens, sched)

    @staticmethod
    def sde_step(cfg: SDEConfig, sigmas, i, v, x, noise):
        from reference.solvers.sde import FlowSDE
        return FlowSDE(cfg, sigmas).step(v, x, i, noise)

    @staticmethod
    def step_logprob(cfg: SDEConfig, sigmas, i, v, x, x_next):
        from reference.solvers.sde import FlowSDE
        return FlowSDE(cfg, sigmas).logprob(v, x, x_next, i)

    @staticmethod
    def sample_logprob(logprobs: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> torch.Tensor:
        from reference.solvers.sde import sample_logprobs
        per = {m: [None if math.isnan(float(x)) else x for x in lp] for m, lp in logprobs.items()}
        out = sample_logprobs(per, {m: t.numel() for m, t in initial.items()})
        return torch.tensor([float("nan") if x is None else float(x) for x in out])

    def generate(self, cases: list[SdeCase], stats, media, sched, trace, watch):
        from reference.ltx2.pipeline import generate_latents
        if len(cases) != 1:
            raise ValueError("the reference loop runs one request at a time")
        c = cases[0]
        return generate_latents(watch(self.transformer), self.connectors, c.request, *c.text, stats, media, sched,
                                trace=trace)


class OptimizedSide:
    name = "optimized"

    def __init__(self, tcfg, tstate, ccfg, cstate):
        self.transformer, self.connectors = opt.load_model(tcfg, tstate), fast_connectors(ccfg, cstate)

    @staticmethod
    def sigmas(steps: int, tokens: int, sched: Ltx2SchedulerConfig) -> torch.Tensor:
        from optimized.models.ltx2.pipeline import schedule
        return schedule(steps, tokens, sched)

    @staticmethod
    def sde_step(cfg: SDEConfig, sigmas, i, v, x, noise):
        from dataclasses import replace

        from optimized.solvers import sde
        state = replace(sde.new_sde_state(cfg, sigmas), index=i)
        _, out = sde.sde_step(state, v, x, noise)
        return out.x_next, out.logprob

    @staticmethod
    def step_logprob(cfg: SDEConfig, sigmas, i, v, x, x_next):
        from dataclasses import replace

        from optimized.solvers import sde
        return sde.step_logprob(replace(sde.new_sde_state(cfg, sigmas), index=i), v, x, x_next)

    @staticmethod
    def sample_logprob(logprobs: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> torch.Tensor:
        from optimized.training import records
        return records.sample_logprob(logprobs, records.element_counts(initial))

    def generate(self, cases: list[SdeCase], stats, media, sched, trace, watch):
        from optimized.models.ltx2.pipeline import generate_latents
        return generate_latents(watch(self.transformer), self.connectors, [c.request for c in cases],
                                [Ltx2Prompt(*c.text) for c in cases], stats, media, sched, trace=trace)


# ------------------------------------------------------------------------------------------------ the driver

class _Watch:
    """The transformer as the loop sees it, recording each forward's input state (the first `n` rows)."""

    def __init__(self, inner, n: int):
        self.inner, self.n, self.cfg = inner, n, inner.cfg
        self.state: dict[str, torch.Tensor] = {}
        self.rows: list[int] = []

    def __call__(self, *args, **kw):
        x = kw["hidden_states"] if "hidden_states" in kw else args[0]
        y = kw["audio_hidden_states"] if "audio_hidden_states" in kw else args[1]
        # contiguous copies: a reduction's order follows the memory layout (the reference's video state is a
        # channels-last view), and a rollout and its recompute must reduce in the same order
        self.state = {m: t[: self.n].detach().clone(memory_format=torch.contiguous_format)
                      for m, t in (("video", x), ("audio", y))}
        self.rows.append(int(x.shape[0]))
        return self.inner(*args, **kw)


def _generators(cases: list[SdeCase], media: Ltx2Media) -> list[torch.Generator]:
    """Per request: its seed's generator, advanced past the loop's initial draws (video, then audio)."""
    gens = []
    for c in cases:
        r = c.request
        g = torch.Generator().manual_seed(r.seed)
        torch.randn((1, media.latent_channels, *r.latent_grid(media)), generator=g)
        torch.randn((1, media.audio_latent_channels, r.audio_frames(media), media.mel_bins // media.mel_compression),
                    generator=g)
        gens.append(g)
    return gens


def drive(side, cases: list[SdeCase], stats, media: Ltx2Media, sched: Ltx2SchedulerConfig,
          records: list[Rollout] | None = None) -> list[Rollout]:
    """One call of `side`'s loop on `cases` (several only on the optimized side: one batch). records=None: a
    rollout (SDE samples drawn); else the recompute of those records (teacher-forced)."""
    n = len(cases)
    steps = cases[0].request.num_inference_steps
    tokens = math.prod(cases[0].request.latent_grid(media))
    sigmas = side.sigmas(steps, tokens, sched)
    gens = _generators(cases, media) if records is None else None
    watch_box: list[_Watch] = []

    def watch(transformer):
        w = _Watch(transformer, n)
        watch_box.append(w)
        return w

    lat: list[dict[str, list[torch.Tensor]]] = [{m: [] for m in MODALITIES} for _ in cases]
    lps: list[dict[str, list[float]]] = [{m: [] for m in MODALITIES} for _ in cases]
    seen: list[str] = []

    def hook(name: str, x: torch.Tensor) -> None:
        kind, i, m = name.split(".") if name.count(".") == 2 else (None, None, None)
        if kind != "step" or m not in MODALITIES:
            return
        i = int(i)
        seen.append(name)
        x_in = watch_box[0].state[m]
        ds = sigmas[i + 1] - sigmas[i]
        v = ((x.float() - x_in.float()) / ds).contiguous()
        for r, c in enumerate(cases):
            if i > 0 and not torch.equal(x_in[r:r + 1], lat[r][m][i]):
                raise ValueError(f"{side.name} loop: step {i} did not start from the state the driver set after step "
                                 f"{i - 1} ({m}): its trace no longer hands over the loop's own state")
            if i == 0:
                if records is not None and not torch.equal(x_in[r:r + 1], records[r].latents[m][0]):
                    raise ValueError(f"recompute: the loop's initial {m} latents differ from the record's")
                lat[r][m].append(x_in[r:r + 1].clone())
            sde_step = c.sde.is_sde_step(i, steps)
            if records is None:
                if sde_step:
                    noise = torch.randn(x_in[r:r + 1].shape, generator=gens[r], dtype=torch.float32)
                    x_next, lp = side.sde_step(c.sde, sigmas, i, v[r:r + 1], x_in[r:r + 1], noise)
                    x[r:r + 1].copy_(x_next)
                else:
                    lp = None
            else:
                x_next = records[r].latents[m][i + 1]
                lp = side.step_logprob(c.sde, sigmas, i, v[r:r + 1], x_in[r:r + 1], x_next) if sde_step else None
                x[r:r + 1].copy_(x_next)
            lat[r][m].append(x[r:r + 1].detach().clone(memory_format=torch.contiguous_format))
            lps[r][m].append(float("nan") if lp is None else float(lp))

    with torch.no_grad():
        video, audio = side.generate(cases, stats, media, sched, hook, watch)
    want = [f"step.{i}.{m}" for i in range(steps) for m in MODALITIES]
    if seen != want or len(watch_box) != 1 or len(watch_box[0].rows) != steps:
        raise ValueError(f"{side.name} loop: expected one forward and a video + audio trace per step ({steps} "
                         f"steps); saw {len(watch_box[0].rows) if watch_box else 0} forwards, traces {seen}")
    out = []
    for r in range(n):
        logprobs = {m: torch.tensor(lps[r][m], dtype=torch.float32) for m in MODALITIES}
        initial = {m: lat[r][m][0] for m in MODALITIES}
        out.append(Rollout(lat[r], logprobs, side.sample_logprob(logprobs, initial), video[r:r + 1], audio[r:r + 1],
                           list(watch_box[0].rows)))
    return out


def rollouts(side, cases: list[SdeCase], stats, media, sched, batched: bool = True) -> list[Rollout]:
    """Rollouts of `cases`: the optimized side in one batch (batched=True) or one call per request; the reference
    always one call per request."""
    if batched and isinstance(side, OptimizedSide):
        return drive(side, cases, stats, media, sched)
    return [drive(side, [c], stats, media, sched)[0] for c in cases]


def recompute(side, cases: list[SdeCase], records: list[Rollout], stats, media, sched,
              batched: bool = True) -> list[Rollout]:
    if batched and isinstance(side, OptimizedSide):
        return drive(side, cases, stats, media, sched, records)
    return [drive(side, [c], stats, media, sched, [rec])[0] for c, rec in zip(cases, records)]
