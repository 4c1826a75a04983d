"""Comparison metrics on every check: max abs, max rel, relative L2, cosine, NaN/Inf counts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from manifests.parity import Tolerance


@dataclass(frozen=True)
class Metrics:
    max_abs: float
    max_rel: float     # max |a-b| / (|b| + 1e-12)... reported, never gated (it explodes near zeros)
    rel_l2: float      # norm(a - b) / norm(b); 0 when both are exactly zero
    cosine: float      # 1.0 when both are exactly zero
    nonfinite_candidate: int
    nonfinite_reference: int
    shape_mismatch: str = ""

    def to_dict(self) -> dict:
        return {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in asdict(self).items()}


def compare(candidate: torch.Tensor, reference: torch.Tensor) -> Metrics:
    """Compare `candidate` (usually the optimized side) against `reference`, in float64."""
    if tuple(candidate.shape) != tuple(reference.shape):
        return Metrics(math.inf, math.inf, math.inf, -1.0, 0, 0,
                       shape_mismatch=f"{list(candidate.shape)} vs {list(reference.shape)}")
    a = candidate.detach().to("cpu", torch.float64)
    b = reference.detach().to("cpu", torch.float64)
    bad_a, bad_b = int((~torch.isfinite(a)).sum()), int((~torch.isfinite(b)).sum())
    if bad_a or bad_b:
        return Metrics(math.inf, math.inf, math.inf, -1.0, bad_a, bad_b)
    if a.numel() == 0:
        return Metrics(0.0, 0.0, 0.0, 1.0, 0, 0)
    diff = a - b
    nb, na, nd = b.norm().item(), a.norm().item(), diff.norm().item()
    rel_l2 = 0.0 if nd == 0 else (nd / nb if nb > 0 else math.inf)
    cosine = 1.0 if na == 0 and nb == 0 else (float((a * b).sum() / (na * nb)) if na > 0 and nb > 0 else 0.0)
    return Metrics(
        max_abs=diff.abs().max().item(),
        max_rel=(diff.abs() / (b.abs() + 1e-12)).max().item(),
        rel_l2=rel_l2,
        cosine=cosine,
        nonfinite_candidate=0,
        nonfinite_reference=0,
    )


def within(m: Metrics, tol: Tolerance) -> bool:
    if tol.rel_l2 is None and tol.max_abs is None and tol.min_cosine is None:   # would pass any tensor
        raise ValueError(f"a tensor comparison needs a bound on rel_l2, max_abs or min_cosine; got {tol} (exact: "
                         f"Tolerance(max_abs=0.0))")
    if m.shape_mismatch or m.nonfinite_candidate or m.nonfinite_reference:
        return False
    if tol.rel_l2 is not None and not m.rel_l2 <= tol.rel_l2:
        return False
    if tol.max_abs is not None and not m.max_abs <= tol.max_abs:
        return False
    if tol.min_cosine is not None and not m.cosine >= tol.min_cosine:
        return False
    return True


def exact(candidate: torch.Tensor, reference: torch.Tensor) -> bool:
    return tuple(candidate.shape) == tuple(reference.shape) and candidate.dtype == reference.dtype and \
        bool(torch.equal(candidate.cpu(), reference.cpu()))
