"""Solvers and classifier-free guidance shared by every family: pure functions of typed per-request state.

    unipc     UniPC-2 (bh2, flow form): diffusers UniPCMultistepScheduler(use_flow_sigmas, flow_prediction)
    euler     FlowMatch Euler: diffusers FlowMatchEulerDiscreteScheduler with a static shift
    guidance  cfg_combine and the CFG policies (how the cond / uncond branches of a batch are run)
    policies  every CFG policy by name (CFG-parallel included) and make_policy
"""

from optimized.solvers.euler import EulerState, euler_step, new_euler_state
from optimized.solvers.guidance import BatchedCFG, CFGPolicy, IdentityCFG, TwoForwardCFG, cfg_combine
from optimized.solvers.unipc import UniPCState, new_state, unipc_step

__all__ = ["BatchedCFG", "CFGPolicy", "EulerState", "IdentityCFG", "TwoForwardCFG", "UniPCState",
           "cfg_combine", "euler_step", "new_euler_state", "new_state", "unipc_step"]
