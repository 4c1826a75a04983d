"""A canonical adapter laid out for one fast component: its LoRA pairs mapped onto the component's fused layers.

The mapping is read from the component's declared load transforms (`ComponentSpec.transforms`): a canonical weight
that a `fuse_rows` transform stacks into a fused weight lands at its row offset there; a weight kept under its own
name stays itself. Nothing here names a family. Prepared pairs are cached (CacheStore) under a CacheKey whose
`adapter_versions` names the adapter's content, so a different adapter (or one reloaded under the same name) never
reads another's tensors.
"""

from __future__ import annotations

import torch

from manifests.lora import LoraAdapter
from optimized.adapters.rows import PreparedLora
from optimized.runtime.cache import CacheKey
from optimized.runtime.spec import ComponentSpec

PREPARED_CONTRACT_VERSION = "lora.prepared.v1"


class AdapterError(ValueError):
    """An adapter that cannot be used as asked (the message names it and why)."""


def fused_layout(spec: ComponentSpec) -> tuple[dict[str, tuple[str, int, int]], dict[str, int]]:
    """(canonical module -> (fused layer, row offset, rows), fused layer -> its rows) for the 2-D weights."""
    shapes = dict(spec.key_shapes)
    out: dict[str, tuple[str, int, int]] = {}
    totals: dict[str, int] = {}
    for t in spec.transforms:
        if not t.target.endswith(".weight") or any(len(shapes.get(src, ())) != 2 for src in t.sources):
            continue
        fused, offset = t.target[: -len(".weight")], 0
        for src in t.sources:
            out[src[: -len(".weight")]] = (fused, offset, shapes[src][0])
            offset += shapes[src][0]
        totals[fused] = offset
    return out, totals


def prepared_key(model_id: str, component_id: str, weights_version: str, dtype: torch.dtype, device: torch.device,
                 adapter: LoraAdapter) -> CacheKey:
    """The cache key of one adapter prepared for one component (module-level: a negative control drops the
    adapter's version from it here)."""
    return CacheKey(model_id=model_id, component_id=f"{component_id}/lora", weights_version=weights_version,
                    precision=str(dtype).removeprefix("torch."), shape_signature=f"device={device}",
                    layout_signature="fused_rows", cache_contract_version=PREPARED_CONTRACT_VERSION,
                    adapter_versions=((adapter.name, adapter.version),))


def prepare(adapter: LoraAdapter, component_id: str, spec: ComponentSpec, dtype: torch.dtype,
            device: torch.device, reachable: set[str]) -> PreparedLora:
    """The adapter's pairs for `component_id` as fused-layer pairs (A stacked, B block-diagonal with alpha / r folded
    in), in `dtype` on `device`. AdapterError when a target lies outside `reachable` (the layers the fast model
    applies unmerged deltas to)."""
    layout, total_rows = fused_layout(spec)
    groups: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for module, pair in sorted(adapter.targets.get(component_id, {}).items()):
        if module not in layout:
            raise AdapterError(f"LoRA {adapter.name!r}: {component_id}.{module} is no linear layer of this model")
        fused, offset, rows = layout[module]
        if fused not in reachable:
            raise AdapterError(f"LoRA {adapter.name!r}: {component_id}.{module} is not applied per request by the "
                               f"fast model (merge this adapter instead)")
        groups.setdefault(fused, []).append((offset, rows, pair.down, pair.up * pair.factor))
    pairs = {}
    for fused, parts in groups.items():
        a = torch.cat([down for _, _, down, _ in parts], 0)
        b = torch.zeros(total_rows[fused], a.shape[0], dtype=torch.float32)
        r0 = 0
        for offset, rows, down, up in parts:
            b[offset: offset + rows, r0: r0 + down.shape[0]] = up
            r0 += down.shape[0]
        pairs[fused] = (a.to(device, dtype), b.to(device, dtype))
    return PreparedLora(adapter.name, adapter.version, pairs)
