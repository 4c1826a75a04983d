"""Tensor parallel wan DiT: which slice of each canonical key a tp rank holds, and the two ways a rank gets it.

The plan (Megatron, heads split):
    column-parallel (dim 0)   attn1 / attn2 to_q, to_k, to_v (weight, bias) and their RMS-norm scales norm_q,
                              norm_k; attn2 add_k_proj / add_v_proj and norm_added_k (image branch); ffn.net.0.proj
    row-parallel    (dim 1)   attn1 / attn2 to_out.0.weight, ffn.net.2.weight (their biases replicated, added once
                              after the all-reduce)
    replicated                everything else: embeddings, modulation tables, the cross-attn LayerNorm, proj_out
A rank holds heads [r H / n, (r + 1) H / n) of self- and cross-attention and 1 / n of the FFN width; the q / k RMS
norm (wan normalises across all heads) all-reduces its sum of squares (optimized/parallel/tp.py sharded_rms_norm).

    shard_params(component, params, tp)              an already loaded DiT's params -> this rank's (in memory)
    read_sharded_state(ckpt, component, cfg, tp)     this rank's slices read from the canonical safetensors files
(instance.py `load_sharded_instance` builds a whole WanModelInstance from the second, so the DiT never holds full
weights.)

`tp_slice` is the declared seam for negative controls (parity/families/wan/faults.py: tp-wrong-slice).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from manifests.wan.dit import WanDiTConfig, dit_key_shapes
from optimized.parallel.group import AxisGroup
from optimized.parallel.tp import read_sharded_state as read_sharded, shard_bounds
from optimized.runtime.spec import ComponentSpec

COLUMN_PREFIXES = tuple(f"{a}.{p}." for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "norm_q", "norm_k")) \
    + ("attn2.add_k_proj.", "attn2.add_v_proj.", "attn2.norm_added_k.", "ffn.net.0.proj.")
ROW_KEYS = ("attn1.to_out.0.weight", "attn2.to_out.0.weight", "ffn.net.2.weight")


def tp_dim(key: str) -> int | None:
    """0 (column-parallel), 1 (row-parallel) or None (replicated) for a canonical DiT key."""
    if not key.startswith("blocks."):
        return None
    rest = key.split(".", 2)[2]
    if rest in ROW_KEYS:
        return 1
    return 0 if rest.startswith(COLUMN_PREFIXES) else None


def tp_slice(key: str, shape: tuple[int, ...], tp: AxisGroup) -> tuple[int, int, int] | None:
    """(dim, start, length) of canonical `key` (of the full `shape`) on this tp rank; None: the whole tensor."""
    dim = tp_dim(key)
    if dim is None or tp.world_size == 1:
        return None
    return (dim, *shard_bounds(shape[dim], tp, key))


def sharded_key_shapes(cfg: WanDiTConfig, tp: AxisGroup) -> dict[str, tuple[int, ...]]:
    out = {}
    for key, shape in dit_key_shapes(cfg).items():
        sl = tp_slice(key, shape, tp)
        out[key] = shape if sl is None else tuple(sl[2] if d == sl[0] else s for d, s in enumerate(shape))
    return out


def sharded_component(component: ComponentSpec, cfg: WanDiTConfig, tp: AxisGroup) -> ComponentSpec:
    """The DiT ComponentSpec at this rank's shard shapes (same keys, same load transforms)."""
    shapes = sharded_key_shapes(cfg, tp)
    return replace(component, key_shapes=tuple((k, shapes[k]) for k, _ in component.key_shapes)).validate()


def _take(key: str, x: torch.Tensor, tp: AxisGroup) -> torch.Tensor:
    sl = tp_slice(key, tuple(x.shape), tp)
    return x if sl is None else x.narrow(*sl).clone()    # a copy: the full tensor can be freed


def shard_params(component: ComponentSpec, params: dict[str, torch.Tensor], tp: AxisGroup) -> dict[str, torch.Tensor]:
    """Loaded (transformed) params -> this rank's: fused rows are split back into their canonical sources, each
    source sliced by `tp_slice`, and fused again."""
    shapes = component.canonical_shapes
    out = {}
    for t in component.transforms:
        x = params[t.target]
        if t.op == "cast":
            out[t.target] = _take(t.target, x, tp)
        else:   # fuse_rows
            parts = x.split([shapes[s][0] for s in t.sources], 0)
            out[t.target] = torch.cat([_take(s, p, tp) for s, p in zip(t.sources, parts)], 0)
    return out


def read_sharded_state(ckpt, component: str | None, cfg: WanDiTConfig, tp: AxisGroup) -> dict[str, torch.Tensor]:
    """This rank's slice of every canonical DiT key (`tp_slice`, looked up at call time: the fault seam)."""
    return read_sharded(ckpt.component(component), dit_key_shapes(cfg), lambda key, shape: tp_slice(key, shape, tp),
                        "DiT")
