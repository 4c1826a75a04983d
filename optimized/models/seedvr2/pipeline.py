"""Optimized SeedVR2 restoration as a LoopKernel the runtime owns: VAE posterior of the low-quality clip ->
`steps` NaDiT steps (one for the released model) -> VAE decode, one WorkPlan per phase, all state in the state.
The DiT call runs window-aligned SP when the kernel is given a group (every rank drives its own scheduler with the
same plans, so the collectives line up). Same schedule facts as the reference (lerp T=1000, v_lerp, trailing)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from optimized.parallel.group import SPGroup
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan
from optimized.runtime.scheduler import run_request

T_MAX = 1000.0
LOOP_ID = "seedvr2.restore"


@dataclass(frozen=True)
class RestoreRequest:
    lq_video: torch.Tensor          # (3, F, H, W) in [-1, 1]
    txt: torch.Tensor               # (L, txt_in_dim) text embeddings
    noise: torch.Tensor             # (T, h, w, 16) initial latent noise
    posterior_noise: torch.Tensor   # (1, 16, T, h, w) noise of the VAE posterior sample
    steps: int = 1


@dataclass(frozen=True)
class RestoreState:
    request: RestoreRequest
    timesteps: tuple[float, ...]
    stage: int = 0                           # 0: encode, 1..steps: DiT steps, steps + 1: decode, then done
    x: torch.Tensor | None = None            # (T, h, w, 16) current latent
    condition: torch.Tensor | None = None    # (T, h, w, 17)
    cond: torch.Tensor | None = None         # (T, h, w, 16) scaled posterior sample
    last_v: torch.Tensor | None = None       # (T*h*w, 16) the last DiT output
    decoded: torch.Tensor | None = None      # (3, F, H, W)

    @property
    def steps(self) -> int:
        return len(self.timesteps)


@dataclass
class RestoreOutput:
    cond_latent: torch.Tensor
    dit_vid_sample: torch.Tensor
    x0_latent: torch.Tensor
    decoded: torch.Tensor
    output_uint8: torch.Tensor


class RestorationLoop(LoopKernel[RestoreState]):
    loop_id = LOOP_ID

    def __init__(self, dit, vae, group: SPGroup | None = None):
        self.dit, self.vae, self.group = dit, vae, group or SPGroup.single()

    def init_state(self, request: RestoreRequest) -> RestoreState:
        if request.steps != 1:
            raise ValueError("SeedVR2 restoration is one step")
        v, n = request.lq_video, request.noise
        if not isinstance(v, torch.Tensor) or v.ndim != 4 or v.shape[0] != 3:
            raise ValueError(f"seedvr2: lq_video must be (3, F, H, W), got "
                             f"{list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
        if not isinstance(n, torch.Tensor) or n.ndim != 4 or n.shape[-1] != 16:
            raise ValueError(f"seedvr2: noise must be (T, h, w, 16), got "
                             f"{list(n.shape) if isinstance(n, torch.Tensor) else type(n).__name__}")
        s = request.steps
        return RestoreState(request, tuple(T_MAX * (s - i) / s for i in range(s)))

    def plan_step(self, state: RestoreState) -> WorkPlan:
        if state.stage == 0:
            phase = "vae_encode"
        elif state.stage <= state.steps:
            phase = "dit_step"
        else:
            phase = "vae_decode"
        T, h, w, _ = state.request.noise.shape
        sig = f"{phase}:{T}x{h}x{w}:sp={self.group.world_size}"
        return WorkPlan(request_id="", loop_id=self.loop_id, phase=phase, step_index=state.stage,
                        batch_key=(id(self), sig), resources=ResourceRequest(), shape_signature=sig,
                        parallel_plan_hash="single" if self.group.world_size == 1 else f"sp{self.group.world_size}",
                        info={"timestep": state.timesteps[state.stage - 1]} if phase == "dit_step" else {})

    def run_step(self, states: Sequence[RestoreState], plans: Sequence[WorkPlan]) -> list[RestoreState]:
        with torch.no_grad():  # requests run one by one: clips rarely share a shape
            return [getattr(self, f"_{p.phase}")(s) for s, p in zip(states, plans)]

    def _vae_encode(self, s: RestoreState) -> RestoreState:
        r = s.request
        mean, std = self.vae.posterior(r.lq_video[None])
        cond = (mean + std * r.posterior_noise)[0].permute(1, 2, 3, 0) * self.vae.cfg.scaling_factor
        ones = torch.ones(*cond.shape[:3], 1, dtype=cond.dtype)
        return replace(s, stage=1, x=r.noise, condition=torch.cat([cond, ones], -1), cond=cond)

    def _dit_step(self, s: RestoreState) -> RestoreState:
        t = s.timesteps[s.stage - 1]
        txt = s.request.txt
        T, h, w, c = s.x.shape
        vid = torch.cat([s.x, s.condition], -1).reshape(T * h * w, -1)
        v = self.dit(vid, torch.tensor([[T, h, w]]), txt, torch.tensor([[txt.shape[0]]]), torch.tensor([t]),
                     group=self.group).view(T, h, w, c)
        b = t / T_MAX
        x0 = (s.x - b * v) / ((1 - b) + b)
        return replace(s, stage=s.stage + 1, x=x0, last_v=v.reshape(T * h * w, c))

    def _vae_decode(self, s: RestoreState) -> RestoreState:
        decoded = self.vae.decode((s.x / self.vae.cfg.scaling_factor).permute(3, 0, 1, 2)[None])[0]
        return replace(s, stage=s.stage + 1, decoded=decoded)

    def is_done(self, state: RestoreState) -> bool:
        return state.stage > state.steps + 1

    def finalize(self, state: RestoreState) -> RestoreOutput:
        u8 = ((state.decoded.clamp(-1, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8).permute(1, 2, 3, 0)
        return RestoreOutput(state.cond, state.last_v, state.x, state.decoded, u8)

    def generate(self, lq_video, txt, noise, posterior_noise) -> RestoreOutput:
        """One request through a private scheduler (the engine serves the same kernel with others)."""
        return run_request(self, RestoreRequest(lq_video, txt, noise, posterior_noise))


@dataclass
class SeedVR2Instance:
    """One resident restoration model: the NaDiT and the VAE."""
    cfg: object
    dit: object
    vae: object
