"""Solvers shared by every reference family: UniPC (flow), FlowMatch Euler and classifier-free guidance."""

from reference.solvers.euler import FlowMatchEuler, euler_schedule
from reference.solvers.guidance import cfg_combine
from reference.solvers.unipc import UniPCFlow, flow_schedule

__all__ = ["FlowMatchEuler", "UniPCFlow", "cfg_combine", "euler_schedule", "flow_schedule"]
