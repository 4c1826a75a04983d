"""The residual store: the tensors the step caches keep between steps, as a typed cache class in the engine's cache
store (designv2 "first-block and residual caches").

A `ResidualCache` wraps a `CacheStore`; each entry is keyed by a full `CacheKey` whose input_hashes name the
request, the CFG branch, the block range, the slot ("fn_residual": the decision residual of blocks [0, Fn);
"mid_residual": what blocks [Fn, L - Bn) added; "stack_residual": what the whole block stack added; "taylor": Taylor
factors; "cfg_delta": cond - uncond output of the last step that ran both) and the acceleration's
`cache_key_part()`. A value computed for one branch, block range or acceleration can never be read for another.
Eviction (LRU by bytes) is safe: a missing entry makes the rule compute, as an empty upstream buffer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manifests.accel import AccelSpec
from optimized.runtime.cache import CacheKey, CacheStore

RESIDUAL_CONTRACT = "accel-residual-v1"
SLOTS = ("fn_residual", "mid_residual", "stack_residual", "taylor", "cfg_delta")


@dataclass(frozen=True)
class ResidualOwner:
    """Whose residuals: one request's denoising on one component (set when the request's state is built)."""
    request: str                     # a token unique to the request (its residuals die with it)
    model_id: str
    component_id: str
    weights_version: str
    precision: str
    shape_signature: str
    spec: AccelSpec


class ResidualCache:
    def __init__(self, store: CacheStore | None = None) -> None:
        self.store = store if store is not None else CacheStore(max_bytes=1 << 31, name="residual")

    def key(self, owner: ResidualOwner, branch: str, blocks: tuple[int, int], slot: str) -> CacheKey:
        if slot not in SLOTS:
            raise ValueError(f"residual slot must be one of {SLOTS}, got {slot!r}")
        parts = {"request": owner.request, "branch": branch, "blocks": f"{blocks[0]}-{blocks[1]}",
                 "slot": slot}
        parts.update(dict(owner.spec.cache_key_part()))
        return CacheKey(model_id=owner.model_id, component_id=owner.component_id,
                        weights_version=owner.weights_version, precision=owner.precision,
                        shape_signature=owner.shape_signature, layout_signature="accel",
                        cache_contract_version=RESIDUAL_CONTRACT, input_hashes=parts)

    def load(self, owner: ResidualOwner, branch: str, blocks: tuple[int, int], slot: str):
        """The stored value or None (never stored, or evicted). Faults are planted here and in store_value."""
        return self.store.get(self.key(owner, branch, blocks, slot))

    def store_value(self, owner: ResidualOwner, branch: str, blocks: tuple[int, int], slot: str, value) -> None:
        """File a refreshed value (a planted 'never refresh' fault keeps the first one)."""
        self.store.put(self.key(owner, branch, blocks, slot), value)

    def release(self, owner: ResidualOwner) -> int:
        """Drop every residual of one request (its loop state is released)."""
        return self.store.evict_where(lambda k: ("request", owner.request) in k.input_hashes)

    def entries(self, owner: ResidualOwner) -> list[CacheKey]:
        return [k for k in self.store.keys() if ("request", owner.request) in k.input_hashes]  # noqa: SIM118


def detach(t: torch.Tensor) -> torch.Tensor:
    """A stored residual owns its memory (a view would pin the whole batch's activations)."""
    return t.detach().clone()
