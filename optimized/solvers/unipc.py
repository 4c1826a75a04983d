"""UniPC-2 (bh2, x0-prediction, flow form) as a pure function of typed per-request state.

No scheduler object is shared between requests: each request carries its own `UniPCState` per modality, so
requests at different step indices, with different schedules, can be stepped in one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from manifests.solvers import UniPCConfig


def sigma_schedule(cfg: UniPCConfig, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas fp32 [N + 1], int64 model timesteps [N]) exactly as diffusers' UniPC builds them."""
    n_train = cfg.num_train_timesteps
    explicit = np.linspace(1.0 - 1.0 / n_train, 0.0, num_steps + 1)[:-1] if cfg.use_native_flow_schedule else None
    if cfg.use_karras_sigmas:
        if explicit is None:
            acp = torch.cumprod(1.0 - torch.linspace(0.0001, 0.02, n_train, dtype=torch.float32), dim=0)
            explicit = np.array(((1 - acp) / acp) ** 0.5)
        rev = explicit[::-1]
        lo = cfg.sigma_min if cfg.sigma_min is not None else rev[-1].item()
        hi = cfg.sigma_max if cfg.sigma_max is not None else rev[0].item()
        ramp = np.linspace(0, 1, num_steps)
        karras = (hi ** (1 / 7.0) + ramp * (lo ** (1 / 7.0) - hi ** (1 / 7.0))) ** 7.0
        sig = karras / (karras + 1)
    else:
        base = explicit if explicit is not None else np.linspace(1, 1 / n_train, num_steps + 1)[:-1]
        sig = shifted_sigmas(base, cfg.flow_shift)
        if abs(sig[0] - 1) < 1e-6:
            sig[0] -= 1e-6
    ts = torch.from_numpy(np.array(sig * n_train)).to(torch.int64)
    return torch.from_numpy(np.append(sig, 0.0).astype(np.float32)), ts


def shifted_sigmas(base: np.ndarray, shift: float) -> np.ndarray:
    """Flow shift: sigma' = shift * s / (1 + (shift - 1) * s). (Module-level so a negative control can plant
    a wrong shift here.)"""
    return shift * base / (1 + (shift - 1) * base)


@dataclass(frozen=True)
class UniPCState:
    sigmas: torch.Tensor                  # fp32 [N + 1]
    num_steps: int
    lower_order_final: bool = True
    index: int = 0
    x0_prev: tuple[torch.Tensor, ...] = ()  # up to the last two x0 predictions, oldest first
    last_sample: torch.Tensor | None = None
    last_order: int = 0


def new_state(cfg: UniPCConfig, num_steps: int) -> tuple[UniPCState, torch.Tensor]:
    sigmas, timesteps = sigma_schedule(cfg, num_steps)
    return UniPCState(sigmas=sigmas, num_steps=len(timesteps), lower_order_final=cfg.lower_order_final), timesteps


def _log_snr(s: UniPCState, i: int) -> torch.Tensor:
    return torch.log(1 - s.sigmas[i]) - torch.log(s.sigmas[i])


def _phi(s: UniPCState, i_to: int, i_from: int):
    h = _log_snr(s, i_to) - _log_snr(s, i_from)
    e = torch.expm1(-h)  # h*phi_1 and B(h) coincide for bh2 with x0-prediction
    return h, e


def _anchor(s: UniPCState, x: torch.Tensor, m0: torch.Tensor, i_to: int, i_from: int, e) -> torch.Tensor:
    return s.sigmas[i_to] / s.sigmas[i_from] * x - (1 - s.sigmas[i_to]) * e * m0


def _corrector(s: UniPCState, x0_new: torch.Tensor) -> torch.Tensor:
    i, m0 = s.index, s.x0_prev[-1]
    h, e = _phi(s, i, i - 1)
    hh = -h
    g1 = e / hh - 1                  # b_1 numerator
    b1 = g1 / e
    base = _anchor(s, s.last_sample, m0, i, i - 1, e)
    if s.last_order == 1:
        return base - (1 - s.sigmas[i]) * e * (0.5 * (x0_new - m0))
    g2 = g1 / hh - 0.5
    b2 = g2 * 2 / e
    rk = (_log_snr(s, i - 2) - _log_snr(s, i - 1)) / h
    one = torch.ones(())
    rhos = torch.linalg.solve(torch.stack([torch.stack([one, one]), torch.stack([rk, one])]),
                              torch.stack([b1, b2])).to(x0_new.dtype)
    d1 = (s.x0_prev[-2] - m0) / rk
    return base - (1 - s.sigmas[i]) * e * (rhos[0] * d1 + rhos[-1] * (x0_new - m0))


def _predictor(s: UniPCState, x: torch.Tensor, order: int) -> torch.Tensor:
    i, m0 = s.index, s.x0_prev[-1]
    h, e = _phi(s, i + 1, i)
    out = _anchor(s, x, m0, i + 1, i, e)
    if order == 2:
        rk = (_log_snr(s, i - 1) - _log_snr(s, i)) / h
        out = out - (1 - s.sigmas[i + 1]) * e * (0.5 * ((s.x0_prev[-2] - m0) / rk))
    return out


def unipc_step(s: UniPCState, velocity: torch.Tensor, x: torch.Tensor) -> tuple[UniPCState, torch.Tensor]:
    """One predictor-corrector step; returns the new state and the next sample."""
    x0 = x - s.sigmas[s.index] * velocity
    if s.index > 0 and s.last_sample is not None:
        x = _corrector(s, x0)
    history = (s.x0_prev + (x0,))[-2:]
    order = min(2, s.num_steps - s.index) if s.lower_order_final else 2
    order = min(order, len(history))
    s = replace(s, x0_prev=history, last_sample=x, last_order=order)
    x_next = _predictor(s, x, order).to(x.dtype)
    return replace(s, index=s.index + 1), x_next
