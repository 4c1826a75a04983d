"""SeedVR2 one-step restoration, readable reference: LQ clip -> VAE posterior sample -> DiT at t = 1000 -> x0 -> VAE.

Schedule `lerp` (T = 1000): x_t = (1 - t/T) x0 + (t/T) eps. Prediction `v_lerp`: x0 = (x_t - B(t) v) / (A(t) + B(t)).
Released sampler: euler, uniform trailing timesteps, 1 step, cfg scale 1 (the negative branch never runs), so the
timesteps are [1000.0], there is one DiT call and x0 = x_T - v.
DiT input = [x_T noise (16) | LQ latent * 0.9152 (16) | ones (1)]; the LQ latent goes through the schedule at t = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEDULE_T = 1000.0


def lerp_coefficients(t: float) -> tuple[float, float]:
    return 1.0 - t / SCHEDULE_T, t / SCHEDULE_T


def uniform_trailing_timesteps(steps: int) -> list[float]:
    return [SCHEDULE_T * (steps - i) / steps for i in range(steps)]


def v_lerp_to_x0(x_t: torch.Tensor, v: torch.Tensor, t: float) -> torch.Tensor:
    a, b = lerp_coefficients(t)
    return (x_t - b * v) / (a + b)


@dataclass
class Restoration:
    cond_latent: torch.Tensor     # (T, h, w, 16) scaled LQ latent
    dit_vid: torch.Tensor         # (T*h*w, 33) the DiT input
    dit_vid_sample: torch.Tensor  # (T*h*w, 16) the v prediction
    x0_latent: torch.Tensor       # (T, h, w, 16)
    decoded: torch.Tensor         # (3, F, H, W) unclamped
    output_uint8: torch.Tensor    # (F, H, W, 3)


def to_uint8(decoded: torch.Tensor) -> torch.Tensor:
    return ((decoded.clamp(-1, 1) * 0.5 + 0.5) * 255).round().to(torch.uint8).permute(1, 2, 3, 0)


@torch.no_grad()
def restore(dit, vae, lq_video: torch.Tensor, txt: torch.Tensor, noise: torch.Tensor,
            posterior_noise: torch.Tensor, steps: int = 1) -> Restoration:
    """lq_video (3, F, H, W) in [-1, 1], F = 4k+1; txt (L, txt_in_dim); noise (T, h, w, 16); posterior_noise
    (1, 16, T, h, w) the standard-normal draw of the VAE posterior sample."""
    if steps != 1:
        raise NotImplementedError("the released SeedVR2 restoration is one step (timesteps [1000.0])")
    scale = vae.cfg.scaling_factor
    mean, std = vae.posterior(lq_video[None])
    cond_latent = (mean + std * posterior_noise)[0].permute(1, 2, 3, 0) * scale
    T, h, w, c = cond_latent.shape
    condition = torch.cat([cond_latent, torch.ones(T, h, w, 1, dtype=cond_latent.dtype)], -1)
    x = noise
    for t in uniform_trailing_timesteps(steps):
        vid = torch.cat([x, condition], -1).reshape(T * h * w, -1)
        v = dit(vid, torch.tensor([[T, h, w]]), txt, torch.tensor([[txt.shape[0]]]), torch.tensor([t]))
        x0 = v_lerp_to_x0(x, v.view(T, h, w, c), t)
        x = x0  # euler to the endpoint (t = 0)
    decoded = vae.decode((x / scale).permute(3, 0, 1, 2)[None])[0]
    return Restoration(cond_latent, vid, v, x, decoded, to_uint8(decoded))
