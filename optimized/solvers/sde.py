"""SDE steps with log-probabilities (Flow-GRPO, DanceGRPO; optional MixGRPO window) as pure functions of typed
per-request state. The sigma table is the request's ODE solver's; see manifests/solvers.py `SDEConfig` for the
equations, the window and the noise order. Everything here runs in fp32.

The noise is an input (drawn by the loop from the request's own generator), so stepping a batch of requests at
different step indices, noise levels and SDE types is a per-request map with no shared state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from manifests.solvers import SDEConfig

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
NEAR_ONE = 1e-5   # a first sigma within this of 1 is 1 (UniPC's table stores 1 - 1e-6 there, upstream)


@dataclass(frozen=True)
class SDEState:
    sigmas: torch.Tensor                  # fp32 [N + 1], last 0
    num_steps: int
    noise_level: float
    sde_type: str                         # "flow_grpo" | "dance_grpo"
    window: tuple[int, int]               # [start, end) of SDE steps
    index: int = 0

    @property
    def is_sde(self) -> bool:
        return self.window[0] <= self.index < self.window[1]


@dataclass(frozen=True)
class SDEStepOut:
    x_next: torch.Tensor                  # fp32
    logprob: torch.Tensor | None          # 0-d fp32 (None on an ODE step)
    mean: torch.Tensor | None
    std: torch.Tensor | None


def new_sde_state(cfg: SDEConfig, sigmas: torch.Tensor) -> SDEState:
    n = int(sigmas.numel()) - 1
    cfg.validate(n)
    return SDEState(sigmas=sigmas.to(torch.float32), num_steps=n, noise_level=float(cfg.noise_level),
                    sde_type=cfg.sde_type, window=cfg.window(n))


def step_sigmas(s: SDEState) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma, sigma_next) of the current step (module-level so a negative control can shift the table)."""
    return s.sigmas[s.index], s.sigmas[s.index + 1]


def noise_level(s: SDEState) -> float:
    """The noise level the step uses (module-level so a negative control can plant a mismatch)."""
    return s.noise_level


def transition(s: SDEState, velocity: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of x_next given x at the current SDE step."""
    sig, sig_next = step_sigmas(s)
    v, x = velocity.to(torch.float32), x.to(torch.float32)
    a = noise_level(s)
    h = sig - sig_next                                   # > 0: how far this step goes down in sigma
    if s.sde_type == "flow_grpo":
        # sigma_t^2 = a^2 sigma / (1 - sigma); at sigma = 1 use the table's second entry below (the paper's guard)
        one_minus = 1 - (s.sigmas[1] if bool(sig >= 1 - NEAR_ONE) else sig)
        var_t = a * a * sig / one_minus
        mean = x - h * (v + var_t / (2 * sig) * (x + (1 - sig) * v))
        std = torch.sqrt(var_t * h)
    else:  # dance_grpo: drift v - a^2/2 * score, score = -(x - (1 - sigma) x0) / sigma^2 with x0 = x - sigma v
        x0 = x - sig * v
        score = ((1 - sig) * x0 - x) / (sig * sig)
        mean = x - h * (v - 0.5 * a * a * score)
        std = a * torch.sqrt(h)
    return mean, std


def logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Gaussian log-density of x_next, averaged over every element (one request's non-batch dims), fp32."""
    z = (x_next.to(torch.float32) - mean) / std
    return (-0.5 * z * z).mean() - torch.log(std) - LOG_SQRT_2PI


def sde_step(s: SDEState, velocity: torch.Tensor, x: torch.Tensor, noise: torch.Tensor | None,
             zero_from: int | None = None) -> tuple[SDEState, SDEStepOut]:
    """One step. SDE step: x_next = mean + std * noise (noise: fp32 standard normal of x's shape); an ODE step
    (outside the window): x + (sigma_next - sigma) v. Channels >= zero_from (padded action channels) are zeroed
    before the log-probability."""
    if s.index >= s.num_steps:
        raise ValueError(f"SDE: all {s.num_steps} steps already taken")
    if not s.is_sde:
        sig, sig_next = step_sigmas(s)
        x_next = x.to(torch.float32) + (sig_next - sig) * velocity.to(torch.float32)
        out = SDEStepOut(_zeroed(x_next, zero_from), None, None, None)
    else:
        if noise is None:
            raise ValueError(f"SDE: step {s.index} is stochastic and needs its noise")
        mean, std = transition(s, velocity, x)
        x_next = _zeroed(mean + std * noise.to(mean.device, torch.float32), zero_from)
        out = SDEStepOut(x_next, logprob(x_next, mean, std), mean, std)
    return replace(s, index=s.index + 1), out


def step_logprob(s: SDEState, velocity: torch.Tensor, x: torch.Tensor, x_next: torch.Tensor) -> torch.Tensor:
    """The log-probability of a recorded transition x -> x_next at the state's step (the trainer's recompute)."""
    mean, std = transition(s, velocity, x)
    return logprob(x_next, mean, std)


def _zeroed(x: torch.Tensor, zero_from: int | None) -> torch.Tensor:
    if zero_from is None:
        return x
    x = x.clone()
    x[:, zero_from:] = 0
    return x
