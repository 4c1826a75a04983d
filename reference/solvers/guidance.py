"""Classifier-free guidance, as every pipeline here writes it."""

from __future__ import annotations

import torch


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond), in the dtype of the model outputs (upstream: no upcast)."""
    return uncond + scale * (cond - uncond)
