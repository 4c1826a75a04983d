"""Seeded random canonical weights: the one generator every family uses (so every weight matters: no zeros).

`random_state_dict` draws one standard normal tensor per key, in sorted key order, from one seeded generator,
and an init rule shapes each draw into a weight. Families differ only in the rule (data next to the family);
`fan_in_init` is the default.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from manifests.layouts import DEFAULT_GAINS

# init(name, shape, r) -> the weight for `name` made from the standard normal draw r, or None to leave the key
# out (an override pass: merge its result over a base state dict)
InitRule = Callable[[str, tuple[int, ...], torch.Tensor], "torch.Tensor | None"]


def fan_in_init(name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor:
    return _fan_in(name, shape, r, DEFAULT_GAINS)


def fan_in_rule(gains: tuple[str, ...] = DEFAULT_GAINS) -> InitRule:
    """fan_in_init with a family's declared gains (manifests/<family>/layout.py `ComponentLayout.gains`: key
    suffixes drawn near 1), e.g. `random_state_dict(shapes, seed, fan_in_rule(get_layout("foo").gains))`."""
    return lambda name, shape, r: _fan_in(name, shape, r, tuple(gains))


def _fan_in(name: str, shape: tuple[int, ...], r: torch.Tensor, gains: tuple[str, ...]) -> torch.Tensor:
    if name.endswith(gains):
        return 1.0 + 0.1 * r               # norms near 1
    if len(shape) == 1:
        return 0.1 * r                     # biases, modality embeds
    if name.startswith(("embed_tokens", "lm_head")):
        return 0.5 * r
    if name.startswith(("action_in.", "action_out.")):
        return 0.1 * r                     # per-domain rows [in*out] and biases [out]
    return r / math.sqrt(math.prod(shape[1:]))  # fan-in (in x kernel for convs) keeps activations O(1)


def random_state_dict(key_shapes: dict[str, tuple[int, ...]], seed: int,
                      init: InitRule = fan_in_init) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(key_shapes):
        shape = tuple(key_shapes[name])
        x = init(name, shape, torch.randn(shape, generator=g, dtype=torch.float32))
        if x is not None:
            out[name] = x
    return out
