"""Solver settings shared by every family: data both sides' own solvers consume (each side implements its own).

UniPCConfig: diffusers `UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction")`.
FlowMatchEulerConfig: diffusers `FlowMatchEulerDiscreteScheduler` (static shift, no dynamic shifting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from manifests.errors import ManifestError


@dataclass(frozen=True)
class UniPCConfig:
    """diffusers `UniPCMultistepScheduler` settings used by `Cosmos3OmniPipeline` (flow-matching form)."""
    num_train_timesteps: int = 1000
    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    flow_shift: float = 10.0              # the docs' override for t2v / v2v / action
    use_karras_sigmas: bool = False       # the shipped default is True with sigma_min 0.147, sigma_max 200
    sigma_min: float | None = None
    sigma_max: float | None = None
    use_native_flow_schedule: bool = False  # pipeline option: sigmas = linspace(1 - 1/1000, 0, N + 1)[:-1]

    def validate(self) -> "UniPCConfig":
        if self.solver_order != 2 or self.solver_type != "bh2":
            raise ManifestError("UniPC: only solver_order=2 with solver_type='bh2' (the pipeline's setting) is supported")
        if not (math.isfinite(self.flow_shift) and self.flow_shift > 0):
            raise ManifestError(f"UniPC: flow_shift must be a positive number, got {self.flow_shift}")
        if self.use_karras_sigmas:
            for name in ("sigma_min", "sigma_max"):
                v = getattr(self, name)
                if v is not None and not (math.isfinite(v) and v > 0):
                    raise ManifestError(f"UniPC: {name} must be positive, got {v}")
        return self

    @classmethod
    def shipped(cls) -> "UniPCConfig":
        """What the converters write into the released pipelines (Karras in EDM-sigma space)."""
        return cls(use_karras_sigmas=True, sigma_min=0.147, sigma_max=200.0, flow_shift=1.0)


@dataclass(frozen=True)
class FlowMatchEulerConfig:
    """diffusers `FlowMatchEulerDiscreteScheduler` with a static `shift` (what the Wan pipelines use)."""
    num_train_timesteps: int = 1000
    shift: float = 3.0

    def validate(self) -> "FlowMatchEulerConfig":
        if not (isinstance(self.shift, (int, float)) and math.isfinite(self.shift) and self.shift > 0):
            raise ManifestError(f"FlowMatch Euler: shift must be a positive number, got {self.shift}")
        if not (isinstance(self.num_train_timesteps, int) and self.num_train_timesteps > 1):
            raise ManifestError("FlowMatch Euler: num_train_timesteps must be an int > 1")
        return self


SDE_TYPES = ("flow_grpo", "dance_grpo")

# How a sample's per-step log-probability combines its stepped modalities (each side implements it on its own):
# the joint log-density of the step's transition per element of the whole sample, sum_m n_m lp_m / sum_m n_m, where
# lp_m is modality m's per-element mean log-density and n_m its element count. Each SDE step draws every modality
# independently given one velocity forward, so the joint log-density is the sum of the modalities' (n_m lp_m);
# per element, as every per-modality value is, it is the element-weighted mean (vision-only: the vision value).
SAMPLE_LOGPROB_REDUCTION = "element_weighted_mean"


@dataclass(frozen=True)
class SDEConfig:
    """Stochastic flow-matching sampling with per-step log-probabilities (RL rollouts).

    The sigma / timestep tables are the request's ODE solver's (UniPC or FlowMatch Euler), so an SDE rollout sees
    the same model timesteps as serving; only the update rule changes. Steps in `sde_window` = [start, end) take the
    SDE step (MixGRPO); every other step is a plain Euler ODE step x + (sigma_next - sigma) v and draws no noise.

      flow_grpo   Flow-GRPO: sigma_t = noise_level * sqrt(sigma / (1 - sigma)), the paper's drift, std sigma_t sqrt(dt)
      dance_grpo  DanceGRPO: std = noise_level * sqrt(dt), drift = v - noise_level^2 / 2 * score(x0 = x - sigma v)

    Noise (one CPU generator seeded with the request's seed): first the request's initial latents as without SDE,
    then, for each SDE step in order, one fp32 `randn` of each stepped modality's latent shape (vision, sound,
    action). The log-probability of the drawn next sample is Gaussian, averaged over the non-batch dims, in fp32.
    """
    noise_level: float = 0.7
    sde_type: str = "flow_grpo"
    sde_window: tuple[int, int] | None = None    # [start, end) step indices; None = every step

    def validate(self, num_steps: int | None = None) -> "SDEConfig":
        if not (isinstance(self.noise_level, (int, float)) and not isinstance(self.noise_level, bool)
                and math.isfinite(self.noise_level) and self.noise_level > 0):
            raise ManifestError(f"SDE: noise_level must be a positive number, got {self.noise_level!r}")
        if self.sde_type not in SDE_TYPES:
            raise ManifestError(f"SDE: sde_type must be one of {SDE_TYPES}, got {self.sde_type!r}")
        w = self.sde_window
        if w is not None:
            ok = (isinstance(w, tuple) and len(w) == 2 and all(isinstance(i, int) and not isinstance(i, bool)
                                                                for i in w) and 0 <= w[0] < w[1])
            if not ok or (num_steps is not None and w[1] > num_steps):
                raise ManifestError(f"SDE: sde_window must be (start, end) with 0 <= start < end <= num_steps"
                                    f"{'' if num_steps is None else f' ({num_steps})'}, got {w!r}")
        return self

    def window(self, num_steps: int) -> tuple[int, int]:
        """The resolved [start, end) of SDE steps."""
        return self.sde_window if self.sde_window is not None else (0, num_steps)

    def is_sde_step(self, index: int, num_steps: int) -> bool:
        start, end = self.window(num_steps)
        return start <= index < end
