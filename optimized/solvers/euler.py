"""FlowMatch Euler (diffusers `FlowMatchEulerDiscreteScheduler`, static shift) as a pure function of typed state.

No scheduler object is shared between requests: each request carries its own `EulerState`, so requests at
different step indices (and with different shifts or step counts) can be stepped in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from manifests.solvers import FlowMatchEulerConfig


def shifted(sigmas, shift: float):
    """Static flow shift: shift * s / (1 + (shift - 1) * s), in the dtype of `sigmas` (numpy or torch)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def euler_schedule(cfg: FlowMatchEulerConfig, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas fp32 [N + 1] ending in 0, fp32 model timesteps [N]) exactly as diffusers builds them."""
    n_train = cfg.num_train_timesteps
    # __init__: the training sigmas, float32 and already shifted; only their ends are used below (upstream)
    train_t = torch.from_numpy(np.linspace(1, n_train, n_train, dtype=np.float32)[::-1].copy()).to(torch.float32)
    train_sigmas = shifted(train_t / n_train, cfg.shift)
    sigma_max, sigma_min = train_sigmas[0].item(), train_sigmas[-1].item()
    # set_timesteps: float64 linspace between the shifted ends, then shifted a second time (upstream)
    t = np.linspace(sigma_max * n_train, sigma_min * n_train, num_steps)
    sigmas = torch.from_numpy(shifted(t / n_train, cfg.shift)).to(torch.float32)
    timesteps = sigmas * n_train
    return torch.cat([sigmas, torch.zeros(1)]), timesteps


@dataclass(frozen=True)
class EulerState:
    sigmas: torch.Tensor                  # fp32 [N + 1], last 0
    num_steps: int
    index: int = 0


def new_euler_state(cfg: FlowMatchEulerConfig, num_steps: int) -> tuple[EulerState, torch.Tensor]:
    cfg.validate()
    if not (isinstance(num_steps, int) and num_steps > 0):
        raise ValueError(f"FlowMatch Euler: num_steps must be a positive int, got {num_steps!r}")
    sigmas, timesteps = euler_schedule(cfg, num_steps)
    return EulerState(sigmas=sigmas, num_steps=num_steps), timesteps


def euler_step(s: EulerState, velocity: torch.Tensor, x: torch.Tensor) -> tuple[EulerState, torch.Tensor]:
    """x_next = x + (sigma_next - sigma) * v, the sample upcast to fp32 and the result cast to the velocity's
    dtype (upstream: with a bf16 model the latents are rounded to bf16 every step)."""
    if s.index >= s.num_steps:
        raise ValueError(f"FlowMatch Euler: all {s.num_steps} steps already taken")
    dt = s.sigmas[s.index + 1] - s.sigmas[s.index]
    x_next = (x.to(torch.float32) + dt * velocity).to(velocity.dtype)
    return replace(s, index=s.index + 1), x_next
