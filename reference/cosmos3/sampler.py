"""The cosmos3 generation loop: a plain `for` over timesteps reproducing `Cosmos3OmniPipeline` (diffusers 0.42.1)
at the latent level: initial noise, conditioning masks, CFG in velocity space, one UniPC per modality."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs
from manifests.cosmos3.sampling import Cosmos3GenerateRequest
from reference.cosmos3.accel import BranchCache
from reference.cosmos3.model import Cosmos3Transformer
from reference.solvers.sde import FlowSDE, gaussian_logprob
from reference.solvers.unipc import UniPCFlow


@dataclass
class GenerateResult:
    vision: torch.Tensor                           # final latents [1, C, T, H, W] (fp32)
    sound: torch.Tensor | None = None              # [S, T_s]
    action: torch.Tensor | None = None             # [chunk, A], all channels
    trajectory: list[dict[str, torch.Tensor]] = field(default_factory=list)  # latents after each step
    timesteps: list[int] = field(default_factory=list)                      # what the model was fed
    logprobs: dict[str, list] = field(default_factory=dict)  # SDE: per modality, per step (None on ODE steps)
    noise: dict[str, list] = field(default_factory=dict)     # SDE: per modality, the draw of each SDE step
    accel: list = field(default_factory=list)                # request.accel: AccelDecision per step and branch


MODALITY_INDEX = {"vision": 0, "sound": 1, "action": 2}


def initial_latents(cfg: Cosmos3Config, req: Cosmos3GenerateRequest, gen: torch.Generator | None = None):
    """Noise drawn in upstream's order (vision, sound, action) from one CPU generator, mixed with the
    conditioning: latents = mask * clean + (1 - mask) * noise. Explicit noise is used as given (upstream).
    `gen`: the request's generator when the caller keeps drawing from it (SDE steps); else a fresh one."""
    if gen is None:
        gen = torch.Generator().manual_seed(req.seed) if req.seed is not None else None
    shape = (1, cfg.latent_channels, req.latent_frames, req.latent_height, req.latent_width)
    vision_mask = torch.zeros(req.latent_frames, 1, 1)
    vision_mask[list(req.vision_condition_frames)] = 1.0

    if req.noise_vision is not None:  # explicit latents skip the conditioning mix (upstream)
        vision = req.noise_vision.float().clone()
    else:
        noise = torch.randn(shape, generator=gen)
        clean = req.condition_latents.float() if req.condition_latents is not None else torch.zeros(shape)
        vision = vision_mask * clean + (1.0 - vision_mask) * noise

    sound = None
    if req.sound_frames:  # every sound frame is noisy
        sound = req.noise_sound.float().clone() if req.noise_sound is not None else \
            torch.randn(cfg.sound_dim, req.sound_frames, generator=gen)

    action, action_mask = None, None
    a = req.action
    if a is not None:
        action_mask = torch.zeros(a.chunk_size, 1)
        clean = torch.zeros(a.chunk_size, cfg.action_dim)
        if a.mode == "forward_dynamics":  # all rows given: repeat the last action to chunk_size, zero-pad channels
            raw = a.raw_actions.float()
            raw = torch.cat([raw, raw[-1:].expand(max(a.chunk_size - raw.shape[0], 0), -1)])[: a.chunk_size]
            clean[:, : raw.shape[1]] = raw
            action_mask[:] = 1.0
        if req.noise_action is not None:  # explicit action latents are not re-zeroed at the start (upstream)
            action = req.noise_action.float().clone()
        else:
            noise = torch.randn(a.chunk_size, cfg.action_dim, generator=gen)
            action = action_mask * clean + (1.0 - action_mask) * noise
            if a.raw_action_dim is not None:
                action[:, a.raw_action_dim:] = 0
    return vision, vision_mask, sound, action, action_mask


def predict_velocity(model: Cosmos3Transformer, cfg: Cosmos3Config, req: Cosmos3GenerateRequest,
                     text_ids: torch.Tensor, timestep: int, vision, vision_mask, sound, action, action_mask,
                     cache: BranchCache | None = None, step: int = 0, decisions: list | None = None):
    """One transformer call (one CFG branch), velocities masked to zero on conditioned frames/rows, in fp32.
    With `cache` (request.accel, reference/cosmos3/accel.py) the branch's cache makes the call and its decision is
    appended to `decisions`; None comes back when the branch does not run this step."""
    dtype = model.embed_tokens.weight.dtype
    a = req.action
    cond_rows = tuple(range(a.chunk_size)) if a is not None and a.mode == "forward_dynamics" else ()
    inp = Cosmos3ForwardInputs(
        text_ids=text_ids, vision_latents=vision.to(dtype), timestep=timestep, fps_vision=req.fps,
        vision_condition_frames=req.vision_condition_frames,
        sound_latents=sound.to(dtype) if sound is not None else None,
        fps_sound=float(cfg.sound_latent_fps) if sound is not None else None,
        action_latents=action.to(dtype) if action is not None else None,
        action_condition_rows=cond_rows, action_domain_id=a.domain_id if a is not None else None)
    if cache is None:
        pred = model(inp)
    else:
        pred, decision = cache.forward(model, step, inp)
        decisions.append(decision)
        if pred is None:
            return None
    v_vision = (pred.vision * (1.0 - vision_mask)).float()
    v_sound = pred.sound.float() if sound is not None else None
    v_action = None
    if action is not None:
        v_action = (pred.action * (1.0 - action_mask)).float()
        if a.raw_action_dim is not None:
            v_action[:, a.raw_action_dim:] = 0
    return v_vision, v_sound, v_action


def guided_velocity(model: Cosmos3Transformer, cfg: Cosmos3Config, req: Cosmos3GenerateRequest, t: int, state,
                    caches: dict[str, BranchCache] | None = None, step: int = 0, decisions: list | None = None):
    """[vision, sound, action] velocities (None where absent) of one step: cond, and with CFG the uncond branch
    combined in velocity space, fp32, one scale for every modality. `caches`: request.accel's cache per branch."""
    def on(branch: str) -> dict:
        return {} if caches is None else {"cache": caches[branch], "step": step, "decisions": decisions}

    v_c = predict_velocity(model, cfg, req, req.text_ids, t, *state, **on("cond"))
    if not req.uses_cfg:
        return list(v_c)
    v_u = predict_velocity(model, cfg, req, req.negative_text_ids, t, *state, **on("uncond"))
    if v_u is None:   # guidance interval: the uncond branch did not run, the cond velocity alone
        return list(v_c)
    return [None if c is None else u + req.guidance_scale * (c - u) for c, u in zip(v_c, v_u)]


def sde_advance(sde: FlowSDE, i: int, v: torch.Tensor, x: torch.Tensor, gen: torch.Generator,
                zero_from: int | None = None):
    """(x_next, logprob or None, noise or None) of one modality at step i. An SDE step draws one fp32 randn of
    x's shape from the request's generator; channels >= zero_from are re-zeroed before the log-probability."""
    if not sde.is_sde_step(i):  # outside the SDE window: an Euler ODE step, nothing drawn
        x_next = sde.step(v, x, i, None)[0]
        if zero_from is not None:
            x_next[:, zero_from:] = 0
        return x_next, None, None
    noise = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    mean, std = sde.mean_and_std(v, x, i)
    x_next = mean + std * noise
    if zero_from is not None:  # padded action channels re-zeroed every step, before the log-probability
        x_next[:, zero_from:] = 0
    return x_next, gaussian_logprob(x_next, mean, std), noise


def generate(model: Cosmos3Transformer, req: Cosmos3GenerateRequest, keep_trajectory: bool = False) -> GenerateResult:
    cfg = model.cfg
    req.validate(cfg)
    gen = torch.Generator().manual_seed(req.seed) if req.seed is not None else None
    vision, vision_mask, sound, action, action_mask = initial_latents(cfg, req, gen)
    # one scheduler per modality: UniPC keeps per-step history, so sound and action get their own (upstream)
    vision_sched = UniPCFlow(req.scheduler, req.num_steps)
    sound_sched = UniPCFlow(req.scheduler, req.num_steps) if sound is not None else None
    action_sched = UniPCFlow(req.scheduler, req.num_steps) if action is not None else None
    has_noisy_action = action_mask is not None and bool((action_mask == 0).any())
    result = GenerateResult(vision=vision)
    sde = FlowSDE(req.sde, vision_sched.sigmas) if req.sde is not None else None  # the UniPC tables, SDE steps
    caches = None
    if req.accel is not None:   # one cache per CFG branch for the whole run
        caches = {b: BranchCache(req.accel, b, req.num_steps, cfg.num_layers)
                  for b in (("cond", "uncond") if req.uses_cfg else ("cond",))}

    with torch.no_grad():
        for i, t in enumerate(vision_sched.timesteps.tolist()):
            state = (vision, vision_mask, sound, action, action_mask)
            v = guided_velocity(model, cfg, req, t, state, caches, i, result.accel)
            if sde is not None:  # noise drawn per modality in order vision, sound, action
                stepped = {"vision": vision, **({"sound": sound} if sound is not None else {}),
                           **({"action": action} if action is not None and has_noisy_action else {})}
                for m, x in stepped.items():
                    zero_from = req.action.raw_action_dim if m == "action" else None
                    x, lp, noise = sde_advance(sde, i, v[MODALITY_INDEX[m]], x, gen, zero_from)
                    result.logprobs.setdefault(m, []).append(lp)
                    result.noise.setdefault(m, []).append(noise)
                    stepped[m] = x
                vision, sound, action = stepped["vision"], stepped.get("sound", sound), stepped.get("action", action)
            else:
                vision = vision_sched.step(v[0], vision)
            if sound is not None and sde is None:
                sound = sound_sched.step(v[1], sound)
            if action is not None and has_noisy_action and sde is None:
                action = action_sched.step(v[2], action)
                if req.action.raw_action_dim is not None:
                    action[:, req.action.raw_action_dim:] = 0  # padded action channels re-zeroed every step
            result.timesteps.append(t)
            if keep_trajectory:
                result.trajectory.append({"vision": vision.clone(),
                                          **({"sound": sound.clone()} if sound is not None else {}),
                                          **({"action": action.clone()} if action is not None else {})})
    result.vision, result.sound, result.action = vision, sound, action
    return result
