"""Model-agnostic parallel runtime: the named ParallelPlan and family contracts (plan.py), the device mesh with one
AxisGroup per axis (mesh.py, group.py), SP attention primitives (sp.py: Ulysses, ring), tensor-parallel
layers and sliced checkpoint reads (tp.py), CFG-parallel (cfg_parallel.py),
the split VAE decode (vae_split.py), seedvr2's LPT planner and Plan A redistribution, the watchdog and launchers."""

from optimized.parallel.group import AxisGroup, CollectiveError, SPGroup, init_sp_from_env
from optimized.parallel.mesh import ParallelMesh, build_mesh
from optimized.parallel.plan import (AttentionShape, ModelShapes, ParallelismContract, ParallelPlan, ParallelPlanError,
                                     keyed)
from optimized.parallel.planner import PLANNER_VERSION, Assignment, lpt_assign
from optimized.parallel.redistribute import RowLayout, Transition, apply_transition, build_transition

__all__ = ["PLANNER_VERSION", "Assignment", "AttentionShape", "AxisGroup", "CollectiveError", "ModelShapes",
           "ParallelMesh", "ParallelPlan", "ParallelPlanError", "ParallelismContract", "RowLayout", "SPGroup",
           "Transition", "apply_transition", "build_mesh", "build_transition", "init_sp_from_env", "keyed",
           "lpt_assign"]
