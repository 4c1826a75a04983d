"""Shared reference solvers (reference/solvers/): FlowMatch Euler and UniPC against diffusers' schedulers on synthetic
velocities, the pinned Euler schedule quirks, CFG, and the UniPC move out of reference/cosmos3."""

from __future__ import annotations

import importlib

import pytest
import torch

from manifests.errors import ManifestError
from manifests.solvers import FlowMatchEulerConfig, UniPCConfig
from reference.solvers import FlowMatchEuler, UniPCFlow, cfg_combine, euler_schedule
from reference.solvers.euler import shift_sigmas


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def synthetic_velocity(x: torch.Tensor, i: int) -> torch.Tensor:
    """A deterministic, state-dependent 'model': enough to make each solver's history matter."""
    g = torch.Generator().manual_seed(100 + i)
    return 0.7 * torch.tanh(x) + torch.randn(x.shape, generator=g)


def run_ours(solver, x: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for i in range(len(solver.timesteps)):
        x = solver.step(synthetic_velocity(x, i), x)
        out.append(x)
    return out


def run_diffusers(sched, x: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(sched.timesteps):
        x = sched.step(synthetic_velocity(x, i), t, x, return_dict=False)[0]
        out.append(x)
    return out


# ------------------------------------------------------------------------------------------ always run

def test_euler_schedule_pinned_values():
    """The values diffusers 0.42.1 gives for shift 5, 4 steps (golden/wan/pipe_euler): the shift is applied twice."""
    s = FlowMatchEuler(FlowMatchEulerConfig(shift=5.0), 4)
    assert s.timesteps.dtype == torch.float32 and s.sigmas.dtype == torch.float32
    assert s.timesteps.tolist() == [1000.0, 909.7071533203125, 717.3174438476562, 24.414066314697266]
    assert s.sigmas[-1].item() == 0.0 and len(s.sigmas) == 5
    # applying the shift once (the "obvious" schedule) gives a clearly different table
    once = shift_sigmas(torch.linspace(1.0, 1.0 / 1000, 4, dtype=torch.float64), 5.0).float() * 1000
    assert (once - s.timesteps).abs().max() > 1.0


def test_euler_step_is_fp32_update_cast_back():
    s = FlowMatchEuler(FlowMatchEulerConfig(shift=3.0), 3)
    x = torch.randn(1, 4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    out = s.step(v, x)
    assert torch.equal(out, x + (s.sigmas[1] - s.sigmas[0]) * v)
    assert s.step(v.to(torch.bfloat16), out).dtype == torch.bfloat16  # cast to the model output dtype (upstream)


def test_euler_rejects_bad_settings():
    with pytest.raises(ManifestError):
        FlowMatchEuler(FlowMatchEulerConfig(shift=0.0), 3)
    with pytest.raises(ValueError):
        FlowMatchEuler(FlowMatchEulerConfig(shift=3.0), 0)


def test_cfg_combine():
    cond, uncond = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    assert torch.equal(cfg_combine(cond, uncond, 1.0), cond)
    assert torch.equal(cfg_combine(cond, uncond, 5.0), uncond + 5.0 * (cond - uncond))
    assert not torch.equal(cfg_combine(cond, uncond, 5.0), cond + 5.0 * (uncond - cond))


def test_unipc_moved_out_of_cosmos3():
    import reference.cosmos3 as cosmos3
    import reference.solvers.unipc as unipc
    assert cosmos3.UniPCFlow is unipc.UniPCFlow and cosmos3.flow_schedule is unipc.flow_schedule
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("reference.cosmos3.unipc")


def test_unipc_wan_schedule_is_int_truncated():
    s = UniPCFlow(UniPCConfig(flow_shift=3.0), 4)
    assert s.timesteps.dtype == torch.int64 and s.timesteps.tolist() == [999, 900, 750, 500]


# ------------------------------------------------------------------------------------------ vs diffusers

@pytest.mark.upstream
@pytest.mark.parametrize("shift,steps", [(1.0, 1), (3.0, 4), (5.0, 7), (12.0, 50)])
def test_euler_matches_diffusers(shift, steps):
    pytest.importorskip("diffusers")
    from diffusers import FlowMatchEulerDiscreteScheduler
    ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(steps)
    ours = FlowMatchEuler(FlowMatchEulerConfig(shift=shift), steps)
    assert torch.equal(ours.sigmas, ref.sigmas) and torch.equal(ours.timesteps, ref.timesteps)
    sigmas, timesteps = euler_schedule(FlowMatchEulerConfig(shift=shift), steps)
    assert torch.equal(sigmas, ref.sigmas) and torch.equal(timesteps, ref.timesteps)
    x = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(7))
    for a, b in zip(run_ours(ours, x), run_diffusers(ref, x)):
        assert torch.equal(a, b)


@pytest.mark.upstream
def test_euler_wrong_shift_fails_against_diffusers():
    pytest.importorskip("diffusers")
    from diffusers import FlowMatchEulerDiscreteScheduler
    ref = FlowMatchEulerDiscreteScheduler(shift=5.0)
    ref.set_timesteps(4)
    x = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(7))
    wrong = run_ours(FlowMatchEuler(FlowMatchEulerConfig(shift=3.0), 4), x)[-1]
    assert rel_l2(wrong, run_diffusers(ref, x)[-1]) > 1e-3


@pytest.mark.upstream
@pytest.mark.parametrize("shift,steps", [(3.0, 3), (5.0, 4), (3.0, 10)])
def test_unipc_matches_diffusers_wan_config(shift, steps):
    """The Wan release scheduler: UniPC flow (bh2, order 2, lower_order_final) with flow_shift."""
    pytest.importorskip("diffusers")
    from diffusers import UniPCMultistepScheduler
    ref = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=shift)
    ref.set_timesteps(steps)
    ours = UniPCFlow(UniPCConfig(flow_shift=shift), steps)
    assert torch.equal(ours.timesteps, ref.timesteps) and torch.equal(ours.sigmas, ref.sigmas)
    x = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(8))
    for a, b in zip(run_ours(ours, x), run_diffusers(ref, x)):
        assert rel_l2(a, b) < 1e-6
