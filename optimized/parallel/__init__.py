"""Model-agnostic parallel helpers: ParallelPlan, SP process group, LPT planner, Plan A redistribution, launcher."""

from optimized.parallel.group import CollectiveError, ParallelPlan, ParallelPlanError, SPGroup, init_sp_from_env
from optimized.parallel.planner import PLANNER_VERSION, Assignment, lpt_assign
from optimized.parallel.redistribute import RowLayout, Transition, apply_transition, build_transition

__all__ = ["PLANNER_VERSION", "Assignment", "CollectiveError", "ParallelPlan", "ParallelPlanError", "RowLayout",
           "SPGroup", "Transition", "apply_transition", "build_transition", "init_sp_from_env", "lpt_assign"]
