"""UniPC multistep (order 2, B(h) = e^h - 1, x0-prediction) in flow-matching form, written from the math.

Reproduces diffusers `UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction")` as
`Cosmos3OmniPipeline` and the Wan pipelines use it (shared by every family). Flow form: x_t = (1 - sigma) x0 + sigma noise, so alpha = 1 - sigma and the
model's velocity v gives x0 = x - sigma v. Each step: correct the current sample with the new model output
(UniC, from the second step on), then predict the next sample (UniP). One instance per modality and request.
"""

from __future__ import annotations

import numpy as np
import torch

from manifests.solvers import UniPCConfig


def flow_schedule(cfg: UniPCConfig, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas float32 [N + 1] ending in 0, model timesteps int64 [N])."""
    T = cfg.num_train_timesteps
    # the pipeline's native schedule is passed as explicit sigmas; flow_shift still applies on top (upstream)
    given = np.linspace(1.0 - 1.0 / T, 0.0, num_steps + 1)[:-1] if cfg.use_native_flow_schedule else None
    if cfg.use_karras_sigmas:
        if given is None:  # the VP (DDPM linear-beta) sigmas, as upstream computes them in fp32
            betas = torch.linspace(0.0001, 0.02, T, dtype=torch.float32)
            alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
            given = np.array(((1 - alphas_cumprod) / alphas_cumprod) ** 0.5)
        in_sigmas = np.flip(given).copy()
        sigma_min = cfg.sigma_min if cfg.sigma_min is not None else in_sigmas[-1].item()
        sigma_max = cfg.sigma_max if cfg.sigma_max is not None else in_sigmas[0].item()
        rho = 7.0
        ramp = np.linspace(0, 1, num_steps)
        edm = (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
        sigmas = edm / (edm + 1)  # EDM sigma -> flow sigma; flow_shift is NOT applied on this path (upstream)
    else:
        s = given if given is not None else np.linspace(1, 1 / T, num_steps + 1)[:-1]
        shift = cfg.flow_shift
        sigmas = shift * s / (1 + (shift - 1) * s)
        if np.fabs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6  # keeps log(alpha) finite on the first update (upstream)
    timesteps = torch.from_numpy((sigmas * T).copy()).to(torch.int64)  # truncated: the model sees floor(1000 sigma)
    sigmas = torch.from_numpy(np.concatenate([sigmas, [0.0]]).astype(np.float32))
    return sigmas, timesteps


class UniPCFlow:
    def __init__(self, cfg: UniPCConfig, num_steps: int):
        self.cfg = cfg.validate()
        self.sigmas, self.timesteps = flow_schedule(cfg, num_steps)
        self.num_steps = len(self.timesteps)
        self.step_index = 0
        self.x0_history: list[torch.Tensor] = []   # converted model outputs (x0 predictions), newest last
        self.last_sample: torch.Tensor | None = None  # the sample the last predictor started from
        self.last_order = 0

    def lam(self, i: int) -> torch.Tensor:
        """log-SNR lambda = log(alpha) - log(sigma) at schedule index i (inf at sigma = 0)."""
        sigma = self.sigmas[i]
        return torch.log(1 - sigma) - torch.log(sigma)

    def coefficients(self, i_to: int, i_from: int):
        """h, the e^{-h}-family terms and alpha/sigma at both ends of the interval i_from -> i_to."""
        h = self.lam(i_to) - self.lam(i_from)
        hh = -h  # x0-prediction uses -h
        h_phi_1 = torch.expm1(hh)
        B_h = torch.expm1(hh)  # bh2
        return h, hh, h_phi_1, B_h

    def b_vector(self, hh: torch.Tensor, h_phi_1: torch.Tensor, B_h: torch.Tensor, order: int) -> torch.Tensor:
        b, h_phi_k, factorial = [], h_phi_1 / hh - 1, 1
        for i in range(1, order + 1):
            b.append(h_phi_k * factorial / B_h)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        return torch.stack(b)

    def base_update(self, x: torch.Tensor, m0: torch.Tensor, i_to: int, i_from: int, h_phi_1) -> torch.Tensor:
        sigma_t, sigma_s0 = self.sigmas[i_to], self.sigmas[i_from]
        return sigma_t / sigma_s0 * x - (1 - sigma_t) * h_phi_1 * m0

    def predict(self, x: torch.Tensor, order: int) -> torch.Tensor:
        """UniP: from x at index i to index i + 1 using the last `order` x0 predictions."""
        i = self.step_index
        m0 = self.x0_history[-1]
        h, hh, h_phi_1, B_h = self.coefficients(i + 1, i)
        x_next = self.base_update(x, m0, i + 1, i, h_phi_1)
        if order == 2:
            rk = (self.lam(i - 1) - self.lam(i)) / h
            d1 = (self.x0_history[-2] - m0) / rk
            x_next = x_next - (1 - self.sigmas[i + 1]) * B_h * (0.5 * d1)  # order-2 predictor uses rho = 1/2
        return x_next

    def correct(self, x: torch.Tensor, x0_new: torch.Tensor, order: int) -> torch.Tensor:
        """UniC: refine x at index i (just predicted from index i - 1) with the new x0 prediction there."""
        i = self.step_index
        m0 = self.x0_history[-1]
        h, hh, h_phi_1, B_h = self.coefficients(i, i - 1)
        x_corr = self.base_update(self.last_sample, m0, i, i - 1, h_phi_1)
        b = self.b_vector(hh, h_phi_1, B_h, order)
        if order == 1:
            rhos = torch.tensor([0.5], dtype=x.dtype)
            residual = rhos[-1] * (x0_new - m0)
        else:
            rk = (self.lam(i - 2) - self.lam(i - 1)) / h
            one = torch.ones(())
            R = torch.stack([torch.stack([one, one]), torch.stack([rk, one])])  # rows: r_k^0, r_k^1 for r = [rk, 1]
            rhos = torch.linalg.solve(R, b).to(x.dtype)
            d1 = (self.x0_history[-2] - m0) / rk
            residual = rhos[0] * d1 + rhos[-1] * (x0_new - m0)
        return x_corr - (1 - self.sigmas[i]) * B_h * residual

    def step(self, velocity: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        i = self.step_index
        x0 = x - self.sigmas[i] * velocity
        if i > 0 and self.last_sample is not None:
            x = self.correct(x, x0, self.last_order)
        self.x0_history = (self.x0_history + [x0])[-2:]
        order = min(self.cfg.solver_order, self.num_steps - i) if self.cfg.lower_order_final else self.cfg.solver_order
        order = min(order, len(self.x0_history))  # warm-up: first step is order 1
        self.last_order = order
        self.last_sample = x
        x_next = self.predict(x, order).to(x.dtype)
        self.step_index += 1
        return x_next
