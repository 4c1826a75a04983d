"""Stochastic flow-matching steps with log-probabilities (RL rollouts), written from the papers' equations.

Flow form x_t = (1 - sigma) x0 + sigma noise; the model predicts v = dx/dsigma. One step goes from sigma to
sigma_next < sigma (dt = sigma_next - sigma < 0). Each SDE step draws x_next ~ N(mean, std^2 I) and reports the
Gaussian log-density of the drawn x_next, averaged over every element of the latent (the non-batch dims), in fp32.

Flow-GRPO (Liu et al. 2025, eq. 9), with noise level a:
    sigma_t = a * sqrt(sigma / (1 - sigma))      (at sigma = 1 the denominator uses the next table entry instead)
    mean    = x + [v + sigma_t^2 / (2 sigma) * (x + (1 - sigma) v)] dt
    std     = sigma_t * sqrt(-dt)
DanceGRPO (Xue et al. 2025), with eta = noise level:
    x0      = x - sigma v ;  score = -(x - (1 - sigma) x0) / sigma^2
    mean    = x + (v - eta^2 / 2 * score) dt
    std     = eta * sqrt(-dt)
Steps outside the SDE window are Euler ODE steps x + dt v (no noise, no log-probability).

A sample with several stepped modalities (cosmos3: vision, sound, action) has one log-probability per step:
`sample_logprob`, the joint log-density of the step per element of the whole sample (manifests.solvers.SAMPLE_LOGPROB_REDUCTION).
"""

from __future__ import annotations

import math

import torch

from manifests.solvers import SDEConfig

# The UniPC flow schedule nudges a first sigma of exactly 1 down by 1e-6 (upstream); such a sigma counts as 1 here,
# otherwise sqrt(sigma / (1 - sigma)) would be ~1000 and the first step would explode.
SIGMA_ONE_TOLERANCE = 1e-5


def gaussian_logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x_next; mean, std^2) per element, averaged over all elements: a 0-d fp32 tensor."""
    x_next, mean, std = x_next.float(), mean.float(), std.float()
    per_element = -((x_next - mean) ** 2) / (2 * std ** 2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return per_element.mean()


def sample_logprob(logprobs: dict[str, torch.Tensor | None], numel: dict[str, int]) -> torch.Tensor | None:
    """One step's log-probability of a whole sample from its modalities' (None on an ODE step), fp32.

    Rule (manifests.solvers.SAMPLE_LOGPROB_REDUCTION, "element_weighted_mean"): every modality's value is its
    Gaussian log-density averaged over its n_m elements (`gaussian_logprob`), so its log-density is n_m * lp_m.
    Given the step's one velocity forward, the modalities' next latents are drawn independently, so the step's joint
    log-density is the sum of theirs, and averaged over the sample's elements (the same per-element scale as each
    modality's value) it is sum_m n_m lp_m / sum_m n_m. One modality: its own value."""
    given = [m for m, lp in logprobs.items() if lp is not None]
    if not given:
        return None
    if len(given) != len(logprobs):
        raise ValueError(f"sample_logprob: a step with logprobs for {given} only, of {list(logprobs)}")
    joint = sum(float(logprobs[m]) * numel[m] for m in given)   # Python floats: fp64
    return torch.tensor(joint / sum(numel[m] for m in given), dtype=torch.float32)


def sample_logprobs(per_modality: dict[str, list], numel: dict[str, int]) -> list[torch.Tensor | None]:
    """`sample_logprob` of every step: per_modality[m][i] is modality m's logprob at step i (None on ODE steps)."""
    steps = {len(v) for v in per_modality.values()}
    if len(steps) != 1:
        raise ValueError(f"sample_logprobs: modalities hold different step counts {sorted(steps)}")
    return [sample_logprob({m: v[i] for m, v in per_modality.items()}, numel) for i in range(steps.pop())]


def flow_grpo_mean_std(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, noise_level: float):
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    dt = sigma_next - sigma
    near_one = bool(sigma >= 1 - SIGMA_ONE_TOLERANCE)
    denominator = 1 - (sigmas[1] if near_one else sigma)  # the paper's code guards sigma == 1 with the next sigma
    sigma_t = noise_level * torch.sqrt(sigma / denominator)
    drift = v + sigma_t ** 2 / (2 * sigma) * (x + (1 - sigma) * v)
    mean = x + drift * dt
    std = sigma_t * torch.sqrt(-dt)
    return mean, std


def dance_grpo_mean_std(x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, noise_level: float):
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    dt = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma ** 2
    mean = x + (v - 0.5 * noise_level ** 2 * score) * dt
    std = noise_level * torch.sqrt(-dt)
    return mean, std


MEAN_STD = {"flow_grpo": flow_grpo_mean_std, "dance_grpo": dance_grpo_mean_std}


class FlowSDE:
    """The SDE sampler over a given sigma table (fp32 [N + 1], last 0): one instance per request."""

    def __init__(self, cfg: SDEConfig, sigmas: torch.Tensor):
        self.num_steps = len(sigmas) - 1
        self.cfg = cfg.validate(self.num_steps)
        self.sigmas = sigmas.to(torch.float32)
        self.mean_std = MEAN_STD[cfg.sde_type]

    def is_sde_step(self, i: int) -> bool:
        return self.cfg.is_sde_step(i, self.num_steps)

    def mean_and_std(self, velocity: torch.Tensor, x: torch.Tensor, i: int):
        return self.mean_std(x.float(), velocity.float(), self.sigmas, i, self.cfg.noise_level)

    def step(self, velocity: torch.Tensor, x: torch.Tensor, i: int, noise: torch.Tensor | None):
        """(x_next fp32, log-probability or None). `noise` is the standard normal draw of an SDE step."""
        if not self.is_sde_step(i):
            return x.float() + (self.sigmas[i + 1] - self.sigmas[i]) * velocity.float(), None
        mean, std = self.mean_and_std(velocity, x, i)
        x_next = mean + std * noise.float()
        return x_next, gaussian_logprob(x_next, mean, std)

    def logprob(self, velocity: torch.Tensor, x: torch.Tensor, x_next: torch.Tensor, i: int) -> torch.Tensor:
        """The log-probability of a given transition x -> x_next at SDE step i (the trainer's recompute)."""
        mean, std = self.mean_and_std(velocity, x, i)
        return gaussian_logprob(x_next, mean, std)
