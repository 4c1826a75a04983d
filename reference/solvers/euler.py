"""FlowMatch Euler: diffusers `FlowMatchEulerDiscreteScheduler` with a static `shift`, as the Wan pipelines use it.

Flow form x_t = (1 - sigma) x0 + sigma noise; the model predicts the velocity v = dx/dsigma, and one step is
x <- x + (sigma_next - sigma) v. The schedule reproduces upstream's arithmetic exactly, including that the
static shift is applied twice: once to the training table in `__init__` (whose ends bound the inference
schedule) and once more to the inference sigmas in `set_timesteps`.
"""

from __future__ import annotations

import numpy as np
import torch

from manifests.solvers import FlowMatchEulerConfig


def shift_sigmas(sigmas, shift: float):
    """The static time shift sigma' = shift sigma / (1 + (shift - 1) sigma) (works on numpy and torch alike)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def euler_schedule(cfg: FlowMatchEulerConfig, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas float32 [N + 1] ending in 0, model timesteps float32 [N] = sigmas * num_train_timesteps)."""
    T = cfg.num_train_timesteps
    # the training table: float32 linspace(1, T, T) reversed, / T, shifted in float32 (upstream __init__)
    train = torch.from_numpy(np.linspace(1, T, T, dtype=np.float32)[::-1].copy()) / T
    train = shift_sigmas(train, cfg.shift)
    sigma_max, sigma_min = train[0].item(), train[-1].item()
    # inference: float64 linspace between the (already shifted) ends, shifted a second time (upstream)
    sigmas = shift_sigmas(np.linspace(sigma_max * T, sigma_min * T, num_steps) / T, cfg.shift)
    sigmas = torch.from_numpy(sigmas).to(torch.float32)
    timesteps = sigmas * T  # float timesteps, not truncated (upstream)
    return torch.cat([sigmas, torch.zeros(1)]), timesteps


class FlowMatchEuler:
    def __init__(self, cfg: FlowMatchEulerConfig, num_steps: int):
        self.cfg = cfg.validate()
        if not (isinstance(num_steps, int) and num_steps > 0):
            raise ValueError(f"FlowMatch Euler: num_steps must be a positive int, got {num_steps!r}")
        self.sigmas, self.timesteps = euler_schedule(cfg, num_steps)
        self.num_steps = num_steps
        self.step_index = 0

    def step(self, velocity: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        i = self.step_index
        dt = self.sigmas[i + 1] - self.sigmas[i]  # float32 scalar difference (upstream)
        x_next = x.to(torch.float32) + dt * velocity  # sample upcast to fp32 before the update (upstream)
        self.step_index += 1
        return x_next.to(velocity.dtype)  # cast back to the model output's dtype (upstream)
