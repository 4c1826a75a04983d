"""Optimized SeedVR2 restoration as a LoopKernel-shaped loop: the runtime owns the (one-step) loop; the DiT call
runs window-aligned SP when given a group. Same schedule facts as the reference (lerp T=1000, v_lerp, trailing)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized.parallel.group import SPGroup

T_MAX = 1000.0


@dataclass
class RestoreState:
    x: torch.Tensor            # (T, h, w, 16) current latent
    condition: torch.Tensor    # (T, h, w, 17)
    timesteps: list[float]
    step: int = 0


@dataclass
class RestoreOutput:
    cond_latent: torch.Tensor
    dit_vid_sample: torch.Tensor
    x0_latent: torch.Tensor
    decoded: torch.Tensor
    output_uint8: torch.Tensor


class RestorationLoop:
    def __init__(self, dit, vae, group: SPGroup | None = None):
        self.dit, self.vae, self.group = dit, vae, group or SPGroup.single()
        self.last_v: torch.Tensor | None = None

    def init_state(self, lq_video, noise, posterior_noise, steps: int = 1) -> tuple[RestoreState, torch.Tensor]:
        if steps != 1:
            raise NotImplementedError("SeedVR2 restoration is one step")
        mean, std = self.vae.posterior(lq_video[None])
        cond = (mean + std * posterior_noise)[0].permute(1, 2, 3, 0) * self.vae.cfg.scaling_factor
        ones = torch.ones(*cond.shape[:3], 1, dtype=cond.dtype)
        return RestoreState(noise, torch.cat([cond, ones], -1), [T_MAX * (steps - i) / steps for i in range(steps)]), cond

    def run_step(self, state: RestoreState, txt: torch.Tensor) -> RestoreState:
        t = state.timesteps[state.step]
        T, h, w, c = state.x.shape
        vid = torch.cat([state.x, state.condition], -1).reshape(T * h * w, -1)
        v = self.dit(vid, torch.tensor([[T, h, w]]), txt, torch.tensor([[txt.shape[0]]]), torch.tensor([t]),
                     group=self.group).view(T, h, w, c)
        self.last_v = v.reshape(T * h * w, c)
        b = t / T_MAX
        x0 = (state.x - b * v) / ((1 - b) + b)
        return RestoreState(x0, state.condition, state.timesteps, state.step + 1)

    @torch.no_grad()
    def generate(self, lq_video, txt, noise, posterior_noise) -> RestoreOutput:
        state, cond = self.init_state(lq_video, noise, posterior_noise)
        while state.step < len(state.timesteps):
            state = self.run_step(state, txt)
        decoded = self.vae.decode((state.x / self.vae.cfg.scaling_factor).permute(3, 0, 1, 2)[None])[0]
        u8 = ((decoded.clamp(-1, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8).permute(1, 2, 3, 0)
        return RestoreOutput(cond, self.last_v, state.x, decoded, u8)
