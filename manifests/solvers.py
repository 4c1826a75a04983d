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
