"""LoRA on the reference side, read as the definition: an adapter changes a linear layer's weight to

    W' = W + scale * (alpha / r) * lora_B @ lora_A

(PEFT `LoraLayer` scaling = lora_alpha / r, times diffusers' adapter weight). A request with adapters is the base
model with them merged in, so the reference runs a LoRA request as `merge_lora` then the ordinary pipeline.
"""

from __future__ import annotations

import torch

from manifests.lora import LoraAdapter


def merge_lora(weights: dict[str, dict[str, torch.Tensor]], uses: list[tuple[LoraAdapter, float]]
               ) -> dict[str, dict[str, torch.Tensor]]:
    """Canonical weights by component -> a copy with every (adapter, scale) merged into its target layers."""
    merged = {component: dict(state) for component, state in weights.items()}
    for adapter, scale in uses:
        for component, layers in adapter.targets.items():
            for module, pair in layers.items():
                weight = merged[component][f"{module}.weight"]
                rank = pair.down.shape[0]
                update = pair.up.float() @ pair.down.float()            # [out, in]
                merged[component][f"{module}.weight"] = (
                    weight.float() + scale * (pair.alpha / rank) * update).to(weight.dtype)
    return merged
