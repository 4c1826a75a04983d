"""Tensor parallel cosmos3: which slice of each canonical key a tp rank holds, how a rank gets it, and the attach
step the family's `parallelize` hook runs under tp > 1.

The plan (Megatron, heads split), the same for the und (text) and gen pathways of every layer:
    column-parallel (dim 0)   q_proj (weight, bias): heads [r H / n, (r + 1) H / n); k_proj / v_proj: this rank's KV
                              heads (`kv_head_span`: split when n divides the KV heads, else the one KV head the rank's
                              query heads read, the declared GQA replication rule); mlp gate_proj / up_proj
    row-parallel    (dim 1)   o_proj.weight, mlp.down_proj.weight (o_proj.bias replicated, added once after the SUM)
    replicated                everything else: embeddings, attn_norm / mlp_norm / und_norm / gen_norm (they act on
                              the whole hidden state, which every rank holds), the per-head q_norm / k_norm /
                              k_norm_for_gen scales ([head_dim]: normalise within one head, so no reduction), the
                              modality in / out projections, the time embedding
No cosmos3 norm spans heads (checked at attach: every q / k norm scale is [head_dim]), so unlike wan nothing
all-reduces a sum of squares; each layer has exactly two SUM all-reduces per pathway (o_proj, down_proj).

The model's hooks (model.py): `fast.tp` (this AxisGroup; None on one rank), `fast.num_heads` / `fast.num_kv_heads`
(this rank's), `_out_proj` / `_mlp` (row-parallel under tp). Loaded fused weights (qkv, gate_up) are split back into
their canonical sources, each sliced by `tp_slice`, and fused again, so a rank keeps only its slices.

    shard_params(component, params, cfg, tp)     loaded (transformed) params -> this rank's (in memory)
    attach_tp(fast, mesh)                        shard an instance in place (the parallelize hook, tp > 1)
    read_sharded_state(comp, cfg, tp)            this rank's slices read from the canonical safetensors files
(model.py `load_sharded` builds a Cosmos3Fast from the third, so a rank never holds the full sharded weights.)

`tp_slice` is the declared seam for negative controls (parity/families/cosmos3/faults.py: tp-wrong-slice).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from manifests.cosmos3.config import Cosmos3Config
from manifests.cosmos3.keys import canonical_key_shapes
from optimized.parallel.group import AxisGroup
from optimized.parallel.tp import read_sharded_state as read_sharded, shard_bounds
from optimized.runtime.spec import ComponentSpec

COLUMN_SUFFIXES = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
                   "mlp.gate_proj.weight", "mlp.up_proj.weight")
KV_SUFFIXES = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
ROW_SUFFIXES = ("o_proj.weight", "mlp.down_proj.weight")
PER_HEAD_NORMS = ("q_norm.weight", "k_norm.weight", "k_norm_for_gen.weight")


def tp_dim(key: str) -> int | None:
    """0 (column-parallel), 1 (row-parallel) or None (replicated) for a canonical transformer key."""
    parts = key.split(".", 3)   # layers.{i}.{und|gen}.{rest}
    if len(parts) < 4 or parts[0] != "layers":
        return None
    rest = parts[3]
    if rest in ROW_SUFFIXES:
        return 1
    return 0 if rest in COLUMN_SUFFIXES else None


def kv_head_span(kv_heads: int, tp: AxisGroup) -> tuple[int, int]:
    """(first, count) of the KV heads this tp rank holds: kv / n of them when n divides kv, else (GQA replication:
    n a multiple of kv) the one KV head its query heads read, shared with n / kv - 1 other ranks."""
    n, r = tp.world_size, tp.rank
    if kv_heads % n == 0:
        return r * (kv_heads // n), kv_heads // n
    if n % kv_heads:
        raise ValueError(f"{kv_heads} KV heads can be neither split nor replicated over tp = {n}")
    return r * kv_heads // n, 1


def tp_slice(key: str, shape: tuple[int, ...], tp: AxisGroup, cfg: Cosmos3Config) -> tuple[int, int, int] | None:
    """(dim, start, length) of canonical `key` (of the full `shape`) on this tp rank; None: the whole tensor."""
    dim = tp_dim(key)
    if dim is None or tp.world_size == 1:
        return None
    if key.endswith(KV_SUFFIXES):
        first, count = kv_head_span(cfg.num_kv_heads, tp)
        return 0, first * cfg.head_dim, count * cfg.head_dim
    return (dim, *shard_bounds(shape[dim], tp, key))


def _take(key: str, x: torch.Tensor, tp: AxisGroup, cfg: Cosmos3Config) -> torch.Tensor:
    sl = tp_slice(key, tuple(x.shape), tp, cfg)
    return x if sl is None else x.narrow(*sl).clone()    # a copy: the full tensor can be freed


def shard_params(component: ComponentSpec, params: dict[str, torch.Tensor], cfg: Cosmos3Config,
                 tp: AxisGroup) -> dict[str, torch.Tensor]:
    """Loaded (transformed) params -> this rank's: fused rows (qkv, gate_up) are split back into their canonical
    sources, each source sliced by `tp_slice`, and fused again (so `chunk` / `split` of the fused output still
    finds q | k | v and gate | up)."""
    shapes = component.canonical_shapes
    out = dict(params)
    for t in component.transforms:
        x = params[t.target]
        if t.op == "cast":
            out[t.target] = _take(t.target, x, tp, cfg)
        else:   # fuse_rows
            parts = x.split([shapes[s][0] for s in t.sources], 0)
            out[t.target] = torch.cat([_take(s, p, tp, cfg) for s, p in zip(t.sources, parts)], 0)
    return out


def sharded_key_shapes(cfg: Cosmos3Config, tp: AxisGroup) -> dict[str, tuple[int, ...]]:
    out = {}
    for key, shape in canonical_key_shapes(cfg).items():
        sl = tp_slice(key, shape, tp, cfg)
        out[key] = shape if sl is None else tuple(sl[2] if d == sl[0] else s for d, s in enumerate(shape))
    return out


def sharded_component(component: ComponentSpec, cfg: Cosmos3Config, tp: AxisGroup) -> ComponentSpec:
    """The transformer ComponentSpec at this rank's shard shapes (same keys, same load transforms)."""
    shapes = sharded_key_shapes(cfg, tp)
    return replace(component, key_shapes=tuple((k, shapes[k]) for k, _ in component.key_shapes)).validate()


def read_sharded_state(comp, cfg: Cosmos3Config, tp: AxisGroup) -> dict[str, torch.Tensor]:
    """This rank's slice of every canonical transformer key (`tp_slice`, looked up at call time: the fault seam)."""
    return read_sharded(comp, canonical_key_shapes(cfg), lambda key, shape: tp_slice(key, shape, tp, cfg),
                        "transformer")


def set_tp_layout(fast: Any, tp: AxisGroup) -> None:
    """The model's tp hooks for weights that are already this rank's slices: its group and its head counts."""
    fast.num_heads = fast.cfg.num_heads // tp.world_size
    fast.num_kv_heads = kv_head_span(fast.cfg.num_kv_heads, tp)[1]
    fast.tp = tp
    if getattr(fast, "sequence_parallel", None) is not None:   # Ulysses splits (or replicates) this rank's KV heads
        fast.sequence_parallel.kv_heads = fast.num_kv_heads


def _check_no_norm_spans_heads(fast: Any) -> None:
    """Every q / k norm scale is per head ([head_dim]): a norm over all heads' channels would need its sum of squares
    all-reduced (optimized/parallel/tp.py sharded_rms_norm), which this plan does not do."""
    d = fast.cfg.head_dim
    for key, w in fast.params.items():
        if key.endswith(PER_HEAD_NORMS) and tuple(w.shape) != (d,):
            raise ValueError(f"{key} has shape {list(w.shape)}: a norm spanning heads is not tensor-parallel here")


def attach_tp(fast: Any, mesh: Any) -> Any:
    """Under a mesh whose tp axis has degree n > 1: keep only this rank's slices of `fast`'s weights and set its head
    counts (the model's `tp` hook). An instance already sharded for this rank is left as it is; one sharded for
    another layout is refused (its other slices are gone)."""
    tp = mesh.axis("tp") if hasattr(mesh, "axis") else None
    degree = 1 if tp is None else tp.world_size
    current = fast.tp
    if current is not None:
        if degree == current.world_size and tp.rank == current.rank:   # loaded sharded (load_sharded), or again
            set_tp_layout(fast, tp)
            return fast
        raise RuntimeError(f"cosmos3 weights are sharded for tp = {current.world_size} (rank {current.rank}): "
                           f"load the model again to run tp = {degree}")
    if degree == 1:
        return fast
    cfg = fast.cfg
    _check_no_norm_spans_heads(fast)
    component = fast.spec.component("transformer")
    fast.params = shard_params(component, fast.params, cfg, tp)
    fast.layers = [{path: fast._path(i, path) for path in ("und", "gen")} for i in range(cfg.num_layers)]
    fast._text_kv_memo.clear()
    set_tp_layout(fast, tp)
    return fast
