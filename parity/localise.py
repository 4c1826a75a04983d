"""Layer-by-layer divergence localisation: both sides record tensors under canonical names, in order;
the first name whose comparison leaves the tolerance is the divergent layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manifests.parity import Tolerance
from parity.metrics import Metrics, compare, within


class TraceRecorder:
    """Collects (name -> tensor) in call order; `sample` filters a batched side's records to one sample."""

    def __init__(self, sample: int | None = None):
        self.sample = sample
        self.records: dict[str, torch.Tensor] = {}

    def __call__(self, *args) -> None:
        if len(args) == 3:  # optimized side: (sample_index, name, tensor)
            idx, name, tensor = args
            if self.sample is not None and idx != self.sample:
                return
        else:
            name, tensor = args
        self.records[name] = tensor.detach().clone()


class ChunkTrace:
    """Collects `trace(name, tensor)` calls of a chunked loop; a name recorded once per chunk is concatenated
    along `dim`, so a chunked side's records compare with a whole-clip side's."""

    def __init__(self, dim: int = 2):
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.dim = dim

    def __call__(self, name: str, t: torch.Tensor) -> None:
        self.parts.setdefault(name, []).append(t.detach().clone())

    @property
    def records(self) -> dict[str, torch.Tensor]:
        return {k: torch.cat(v, self.dim) for k, v in self.parts.items()}


@dataclass(frozen=True)
class Divergence:
    name: str
    metrics: Metrics


def first_divergence(candidate: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                     tol: Tolerance) -> Divergence | None:
    """Walk the reference's trace order; names the candidate did not record (e.g. und layers on a cache hit)
    are skipped, a name the reference did not record is ignored."""
    for name, ref in reference.items():
        if name not in candidate:
            continue
        m = compare(candidate[name], ref)
        if not within(m, tol):
            return Divergence(name, m)
    return None
