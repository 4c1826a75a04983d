"""CFG-parallel: the cond and uncond branches of a guided batch run on different ranks of the cfgp axis, the
predictions are all-gathered, and every rank combines them after the step (so every rank holds the same latents).

It is a CFG policy (optimized/solvers/guidance.py), so a family's denoise loop runs it through its existing
`policy.run(forward_batch, cond, uncond)` seam with no model or loop change:

    engine = Engine(instance, entry, cfg_policy=CFGParallel(mesh.axis("cfgp")))

The rows (cond then uncond) are split into contiguous, nearly equal parts in axis-rank order: with every request
guided and cfgp = 2, rank 0 runs exactly the cond branch and rank 1 the uncond branch. When some rank would get no
row (e.g. one unguided request), every rank runs every row and nothing is exchanged. Predictions may be tensors or
dataclasses / dicts / lists of tensors (cosmos3's Cosmos3Prediction): their structure goes as a small object, their
tensors as one padded all_gather per dtype. Declared seam for negative controls: `CFGParallel.branch_rows` (which
rows this rank runs; parity/parallel_faults.py patches it to swap the branches across ranks).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from optimized.parallel.group import AxisGroup
from optimized.solvers.guidance import BatchedCFG, CFGPolicy, ForwardBatch


@dataclass(frozen=True)
class _Leaf:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """obj with every tensor replaced by a _Leaf (appended to `leaves`)."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return _Leaf(len(leaves) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(x, leaves) for x in obj)
    if isinstance(obj, dict):
        return {k: _strip(v, leaves) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _strip(getattr(obj, f.name), leaves))
        return out
    return obj


def _fill(obj: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Leaf):
        return leaves[obj.index]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(x, leaves) for x in obj)
    if isinstance(obj, dict):
        return {k: _fill(v, leaves) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _fill(getattr(obj, f.name), leaves))
        return out
    return obj


def all_gather_structures(group: AxisGroup, local: list) -> list[list]:
    """Every rank's list of predictions (any mix of tensors in lists / dicts / dataclasses), in axis order."""
    leaves: list[torch.Tensor] = []
    skeleton = _strip(local, leaves)
    metas: list = [None] * group.world_size
    group._run("all_gather_object(structure)", lambda: dist.all_gather_object(metas, skeleton, group=group.group))
    device = leaves[0].device if leaves else torch.device("cpu")
    rank_leaves: list[list[torch.Tensor | None]] = [[None] * len(_leaves_of(meta)) for meta in metas]
    dtypes = sorted({leaf.dtype for meta in metas for leaf in _leaves_of(meta)}, key=str)
    for dtype in dtypes:
        mine = [t.reshape(-1) for t in leaves if t.dtype == dtype]
        buf = torch.cat(mine) if mine else torch.empty(0, dtype=dtype, device=device)
        sizes = [sum(_numel(leaf) for leaf in _leaves_of(meta) if leaf.dtype == dtype) for meta in metas]
        padded = buf.new_zeros(max(sizes))
        padded[:buf.numel()] = buf
        for r, (got, meta) in enumerate(zip(group.all_gather(padded), metas)):
            offset = 0
            for leaf in _leaves_of(meta):
                if leaf.dtype == dtype:
                    n = _numel(leaf)
                    rank_leaves[r][leaf.index] = got[offset:offset + n].view(leaf.shape)
                    offset += n
    return [_fill(meta, rank_leaves[r]) for r, meta in enumerate(metas)]


def _leaves_of(meta: Any) -> list[_Leaf]:
    out: list[_Leaf] = []

    def walk(o):
        if isinstance(o, _Leaf):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name))
    walk(meta)
    return sorted(out, key=lambda leaf: leaf.index)


def _numel(leaf: _Leaf) -> int:
    n = 1
    for d in leaf.shape:
        n *= d
    return n


def split_rows(n_rows: int, n_ranks: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) per rank, sizes differing by at most one (earlier ranks larger)."""
    base, extra = divmod(n_rows, n_ranks)
    out, start = [], 0
    for r in range(n_ranks):
        end = start + base + (1 if r < extra else 0)
        out.append((start, end))
        start = end
    return out


class CFGParallel(CFGPolicy):
    """Branches of a guided batch spread over the cfgp axis; predictions gathered; every rank combines."""
    name = "cfg-parallel"

    def __init__(self, group: AxisGroup | None = None):
        self.group = group or AxisGroup.single("cfgp")
        self.stats = {"steps": 0, "replicated_steps": 0}

    def run(self, forward_batch: ForwardBatch, cond: Sequence, uncond: Sequence) -> tuple[list, list]:
        n = self.group.world_size
        rows = list(cond) + list(uncond)
        if n == 1 or len(rows) < n:  # a rank would idle: every rank runs every row, nothing exchanged
            self.stats["replicated_steps"] += n > 1
            return BatchedCFG().run(forward_batch, cond, uncond)
        self.stats["steps"] += 1
        a, b = self.branch_rows(len(rows))
        local = list(forward_batch(rows[a:b]))
        preds = [p for rank_preds in all_gather_structures(self.group, local) for p in rank_preds]
        return preds[: len(cond)], preds[len(cond):]

    def layout_hash(self) -> str:
        return "single" if self.group.world_size == 1 else f"cfgp{self.group.world_size}"

    def branch_rows(self, n_rows: int) -> tuple[int, int]:
        """[start, end) of the rows (cond then uncond) this rank runs."""
        return split_rows(n_rows, self.group.world_size)[self.group.rank]

