"""Seeded random canonical weights for a family's key/shape set (so every weight matters: no zeros)."""

from __future__ import annotations

import math

import torch


def random_state_dict(key_shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(key_shapes):
        shape = key_shapes[name]
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x              # norms near 1
        elif len(shape) == 1:
            x = 0.1 * x                    # biases, modality embeds
        elif name.startswith(("embed_tokens", "lm_head")):
            x = 0.5 * x
        elif name.startswith(("action_in.", "action_out.")):
            x = 0.1 * x                    # per-domain rows [in*out] and biases [out]
        else:
            x = x / math.sqrt(math.prod(shape[1:]))  # fan-in (in x kernel for convs) keeps activations O(1)
        out[name] = x
    return out
