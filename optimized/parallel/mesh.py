"""The device mesh of a ParallelPlan: a torch.distributed DeviceMesh over the axes of degree > 1 (named, in the plan's
mesh order), and one `AxisGroup` per axis, trivial (no process group, no collectives) for degree-1 axes.

    mesh = build_mesh(ParallelPlan.parse("cfgp2,ulysses2"))   # after init_process_group, 4 ranks
    mesh.axis("cfgp").rank, mesh.axis("sp_ulysses").world_size

At world size 1 nothing touches torch.distributed. Axis order follows optimized/parallel/plan.py: the global rank is
row-major over (dp, cfgp, sp_ring, sp_ulysses, tp), so tp and ulysses peers are adjacent ranks (same host first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from optimized.parallel.group import AxisGroup
from optimized.parallel.plan import AXES, ParallelPlan, ParallelPlanError


@dataclass
class ParallelMesh:
    plan: ParallelPlan
    rank: int = 0
    world_size: int = 1
    device_mesh: Any = None                  # torch DeviceMesh over the active axes (None at world size 1)
    groups: dict[str, AxisGroup] = field(default_factory=dict)
    watchdog: Any = None

    def axis(self, name: str) -> AxisGroup:
        name = {"ulysses": "sp_ulysses", "ring": "sp_ring", "window": "sp_window"}.get(name, name)
        if name not in AXES:
            raise KeyError(f"no mesh axis {name!r}; axes: {', '.join(AXES)}")
        return self.groups.get(name) or AxisGroup.single(name)

    @classmethod
    def single(cls, plan: ParallelPlan | None = None) -> "ParallelMesh":
        plan = plan or ParallelPlan()
        if plan.world_size != 1:
            raise ParallelPlanError(f"plan {plan.name()} needs {plan.world_size} ranks; this is one process")
        return cls(plan)

    def set_log(self, log: list | None) -> None:
        """Log every collective of every axis into `log` (None stops logging)."""
        for g in self.groups.values():
            g.log = log

    def bytes_sent(self) -> int:
        return sum(g.stats["bytes_sent"] for g in self.groups.values())


def build_mesh(plan: ParallelPlan, device_type: str | None = None, watchdog: Any = None) -> ParallelMesh:
    """The mesh of this rank (torch.distributed already initialised when plan.world_size > 1)."""
    if plan.world_size == 1:
        return ParallelMesh.single(plan)
    if not dist.is_initialized():
        raise ParallelPlanError(f"plan {plan.name()} needs {plan.world_size} ranks: launch it with torchrun "
                                f"(python -m torch.distributed.run --nproc-per-node {plan.world_size} ...)")
    world = dist.get_world_size()
    if world != plan.world_size:
        raise ParallelPlanError(f"plan {plan.name()} needs world size {plan.world_size} (the product of its "
                                f"degrees); the launch has {world} ranks")
    from torch.distributed.device_mesh import init_device_mesh

    device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    active = plan.active_axes
    dm = init_device_mesh(device_type, tuple(d for _, d in active), mesh_dim_names=tuple(a for a, _ in active))
    coord = dm.get_coordinate()
    groups = {}
    for dim, (axis, _) in enumerate(active):
        index = list(coord)
        index[dim] = slice(None)
        ranks = tuple(int(r) for r in dm.mesh[tuple(index)].flatten().tolist())
        groups[axis] = AxisGroup(dm.get_local_rank(axis), len(ranks), dm.get_group(axis), dist.get_backend(), axis,
                                 ranks, watchdog=watchdog)
    return ParallelMesh(plan, dist.get_rank(), world, dm, groups, watchdog)
