"""The trainer's side of an SDE rollout, readable: from a request and the rollout's per-step latents, recompute every
SDE step's log-probability with this (reference) model. Plain data in, plain data out: the record format belongs to
the runtime, so the caller hands over the request and the latents it holds.

The sample's logprob over its stepped modalities is `reference.solvers.sde.sample_logprob` (the element-weighted
mean, manifests.solvers.SAMPLE_LOGPROB_REDUCTION), weighted by the element counts of the latents handed over."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manifests.cosmos3.sampling import Cosmos3GenerateRequest
from reference.cosmos3.model import Cosmos3Transformer
from reference.cosmos3.sampler import MODALITY_INDEX, guided_velocity, initial_latents
from reference.solvers.sde import FlowSDE, sample_logprobs
from reference.solvers.unipc import UniPCFlow


@dataclass
class RecomputedLogprobs:
    by_modality: dict[str, list[torch.Tensor | None]]   # modality -> one fp32 logprob per step (None: ODE step)
    sample: list[torch.Tensor | None]                   # the whole sample's, per step (`sample_logprob`)


def recompute_logprobs(model: Cosmos3Transformer, req: Cosmos3GenerateRequest,
                       latents: list[dict[str, torch.Tensor]]) -> RecomputedLogprobs:
    """latents[i] = every modality's latents entering step i (i = 0..N; latents[N] = the final ones).
    Returns per modality and for the whole sample one log-probability per step (None on ODE steps), fp32."""
    cfg = model.cfg
    req.validate(cfg)
    if req.sde is None:
        raise ValueError("recompute_logprobs: the request has no SDE settings (an ODE rollout has no logprobs)")
    schedule = UniPCFlow(req.scheduler, req.num_steps)
    if len(latents) != schedule.num_steps + 1:
        raise ValueError(f"recompute_logprobs: need {schedule.num_steps + 1} latents (in and out of every step), "
                         f"got {len(latents)}")
    sde = FlowSDE(req.sde, schedule.sigmas)
    _, vision_mask, _, _, action_mask = initial_latents(cfg, req)  # only the conditioning masks are used
    out: dict[str, list[torch.Tensor | None]] = {m: [] for m in latents[0]}
    with torch.no_grad():
        for i, t in enumerate(schedule.timesteps.tolist()):
            if not sde.is_sde_step(i):
                for m in out:
                    out[m].append(None)
                continue
            x = latents[i]
            state = (x["vision"], vision_mask, x.get("sound"), x.get("action"), action_mask)
            v = guided_velocity(model, cfg, req, t, state)
            for m in out:
                out[m].append(sde.logprob(v[MODALITY_INDEX[m]], x[m], latents[i + 1][m], i))
    return RecomputedLogprobs(out, sample_logprobs(out, {m: latents[0][m].numel() for m in out}))
