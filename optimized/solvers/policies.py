"""Every CFG policy by name, and `make_policy`. The single-process policies live in guidance.py; CFG-parallel lives with
its process groups in optimized/parallel/cfg_parallel.py and builds on guidance.py, so the table that names both is
here, above the two (neither imports the other's module back)."""

from __future__ import annotations

from optimized.parallel.cfg_parallel import CFGParallel
from optimized.solvers.guidance import SINGLE_PROCESS_POLICIES, CFGPolicy

CFG_POLICIES: dict[str, type[CFGPolicy]] = {**SINGLE_PROCESS_POLICIES, CFGParallel.name: CFGParallel}


def make_policy(policy: CFGPolicy | str) -> CFGPolicy:
    """A policy instance from itself or its name (ValueError naming the known ones); "cfg-parallel" starts as a
    degree-1 group until given one."""
    if isinstance(policy, CFGPolicy):
        return policy
    if policy not in CFG_POLICIES:
        raise ValueError(f"unknown CFG policy {policy!r}; known: {', '.join(sorted(CFG_POLICIES))}")
    return CFG_POLICIES[policy]()
