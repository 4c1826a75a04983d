"""The trainer's side of a Wan SDE rollout, readable: from a request and the rollout's per-step latents, recompute
every SDE step's log-probability with the reference pipeline. Plain data in, plain data out (the record format
belongs to the runtime). One stepped modality: the sample's logprob (`reference.solvers.sde.sample_logprob`, the
element-weighted mean over modalities) is the vision logprob itself."""

from __future__ import annotations

import torch

from manifests.wan.sampling import WanGenerateRequest
from reference.solvers.sde import FlowSDE, sample_logprobs
from reference.wan.pipeline import WanReferencePipeline


@torch.no_grad()
def recompute_logprobs(pipe: WanReferencePipeline, request: WanGenerateRequest,
                       latents: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """latents[i] = the latents entering step i (i = 0..N). One fp32 log-probability per step (None on ODE steps)."""
    cfg = pipe.cfg
    request.validate(cfg)
    if request.sde is None:
        raise ValueError("recompute_logprobs: the request has no SDE settings (an ODE rollout has no logprobs)")
    solver = pipe.make_solver(request)
    if len(latents) != len(solver.timesteps) + 1:
        raise ValueError(f"recompute_logprobs: need {len(solver.timesteps) + 1} latents, got {len(latents)}")
    sde = FlowSDE(request.sde, solver.sigmas)
    text, negative_text = pipe.encode_text(request)
    image_embeds = request.image_embeds.to(torch.float32)[None] if cfg.dit.has_image_branch else None
    condition = pipe.encode_condition(request, tuple(latents[0].shape)) if request.image is not None else None
    out: list[torch.Tensor | None] = []
    for i, t in enumerate(solver.timesteps):
        if not sde.is_sde_step(i):
            out.append(None)
            continue
        v = pipe.guided_velocity(request, latents[i], t, pipe.expert_at(t), text, negative_text, image_embeds,
                                 condition)
        out.append(sde.logprob(v, latents[i], latents[i + 1], i))
    return sample_logprobs({"vision": out}, {"vision": latents[0].numel()})
