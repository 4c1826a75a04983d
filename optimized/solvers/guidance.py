"""Classifier-free guidance, family-agnostic.

`cfg_combine` is the velocity-space combine every pipeline here uses. A `CFGPolicy` says how the cond and uncond
branches of a batch of requests are executed, given `forward_batch`: a callable on a list of one family's forward
inputs that returns one prediction per input (one batched forward). The policy never looks inside the inputs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

ForwardBatch = Callable[[list], list]


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond), in the predictions' own dtype, in upstream's order of operations."""
    return uncond + scale * (cond - uncond)


class CFGPolicy:
    name = "abstract"

    def check(self, uses_cfg: bool, scale: Any) -> None:
        """Raise ValueError when this policy cannot run a request with this guidance."""

    def run(self, forward_batch: ForwardBatch, cond: Sequence, uncond: Sequence) -> tuple[list, list]:
        """(cond predictions, uncond predictions), in the order of the inputs."""
        raise NotImplementedError

    def layout_hash(self) -> str:
        """The layout this policy spreads a step over when the model itself has no plan: "single" in one process."""
        return "single"


class TwoForwardCFG(CFGPolicy):
    """Cond batch and uncond batch as two forwards (lower peak memory)."""
    name = "two-forward"

    def run(self, forward_batch, cond, uncond):
        return list(forward_batch(list(cond))), (list(forward_batch(list(uncond))) if uncond else [])


class BatchedCFG(CFGPolicy):
    """Both branches of every request in one forward (fewer launches, one weight pass)."""
    name = "batched"

    def run(self, forward_batch, cond, uncond):
        preds = list(forward_batch(list(cond) + list(uncond)))
        return preds[: len(cond)], preds[len(cond):]


class IdentityCFG(CFGPolicy):
    """Cond only: for guidance that does not run CFG (or guidance-distilled checkpoints); refuses any other."""
    name = "identity"

    def check(self, uses_cfg, scale):
        if uses_cfg:
            raise ValueError(f"the identity CFG policy runs guidance_scale 1 only, got {scale}")

    def run(self, forward_batch, cond, uncond):
        if uncond:
            raise ValueError("the identity CFG policy runs no uncond branch")
        return list(forward_batch(list(cond))), []


SINGLE_PROCESS_POLICIES: dict[str, type[CFGPolicy]] = {p.name: p for p in (TwoForwardCFG, BatchedCFG, IdentityCFG)}
# the name -> policy table with CFG-parallel is optimized/solvers/policies.py (it needs optimized/parallel, which
# builds on this module)
