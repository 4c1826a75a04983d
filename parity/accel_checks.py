"""C1 under an acceleration: the engine and the reference loop run the same request with the same AccelSpec.

Both sides make their decisions independently (optimized/accel/ vs reference/wan/accel.py), so the check compares
decisions first (step, CFG branch, action, block ranges) and the latents after every step second, against the
contract's C1 loop tolerance: a lossy cache is lossy against the exact run, but reference and engine under the same
cache must agree. The first failing row localises a fault (which step, which branch).

Negative controls (`FAULTS`, planted in the engine only): "never_refresh" (the residual store keeps the first value
of every slot), "wrong_branch" (a branch reads the other branch's residuals). Each must fail and be localised.
"""

from __future__ import annotations

import torch

from manifests.accel import AccelSpec, parse_accel
from parity.accel_rows import FAULTS, AccelC1Row, compare, planted


def default_request(cfg, spec: AccelSpec, num_steps: int = 6, seed: int = 0, guidance_scale: float = 5.0):
    from manifests.wan.sampling import WanGenerateRequest
    g = torch.Generator().manual_seed(seed)
    s = cfg.vae.spatial_compression * cfg.dit.patch_size[1] * 2
    return WanGenerateRequest(text_ids=torch.randint(1, 128, (7,), generator=g),
                              negative_text_ids=torch.randint(1, 128, (4,), generator=g), num_frames=5, height=s,
                              width=s, num_steps=num_steps, guidance_scale=guidance_scale, seed=seed, accel=spec)


def run_accel_c1(family: str, spec: AccelSpec | str, *, variant: str = "tiny-2.1-t2v", weights=None, request=None,
                 num_steps: int = 8, seed: int = 0, fault: str | None = None, extra_requests: int = 1,
                 tol: float | None = None) -> list[AccelC1Row]:
    """C1 rows of one accelerated request: the engine (batched with `extra_requests` other requests under the same
    acceleration but other seeds, so rows with different decisions share its steps) vs the reference loop."""
    if family == "cosmos3":
        from parity.accel_checks_cosmos3 import c1_rows
        return c1_rows(spec, variant=None if variant == "tiny-2.1-t2v" else variant, seed=seed, fault=fault,
                       num_steps=num_steps, extra_requests=extra_requests, tol=tol)
    if family != "wan":
        raise ValueError(f"accel C1: family {family!r} is not wired yet (wan, cosmos3)")
    from manifests.wan import load_model_variant
    from optimized.models.wan.denoise import WanDenoiseJob, WanDenoiseLoop
    from optimized.models.wan.instance import WanModelInstance
    from optimized.runtime.scheduler import RequestRejected, WorkUnitScheduler
    from parity.families.wan.common import contract_tolerance
    from reference.wan.pipeline import WanReferencePipeline

    spec = parse_accel(spec) if isinstance(spec, str) else spec
    cfg = load_model_variant(variant)
    weights = weights if weights is not None else WanModelInstance.random_weights(cfg, seed)
    request = request if request is not None else default_request(cfg, spec, num_steps, seed)
    others = [default_request(cfg, spec, request.num_steps, seed + 1 + i) for i in range(extra_requests)]
    tol = tol if tol is not None else contract_tolerance("C1", "loop", "float32", "cpu").rel_l2

    loop = WanDenoiseLoop(WanModelInstance(cfg, weights, weights_version=f"accel-c1:{variant}:{seed}"))
    sched = WorkUnitScheduler()
    with planted(fault):
        try:
            handles = [sched.submit(loop, WanDenoiseJob(r, record_trajectory=True)) for r in [request, *others]]
        except RequestRejected as e:   # the request / spec cannot run here (one clear message)
            raise ValueError(str(e)) from None
        while not sched.idle:
            sched.tick()
    if handles[0].status != "completed":
        raise RuntimeError(f"accel C1: the engine request failed: {handles[0].error}")
    engine = handles[0].result
    ref = WanReferencePipeline(cfg, weights).generate(request, keep_trajectory=True)
    return compare(engine["accel"]["decisions"], engine["trajectory"], ref.accel, ref.trajectory, tol)


def accel_report(family: str, accel: str, *, seed: int = 0, fault: str | None = None, variant: str | None = None,
                 num_steps: int = 8):
    """`fvparity run FAMILY --level C1 --accel NAME[:knobs]`: the C1 rows as a Report, one check per step (that
    step's decisions of every branch, then its latents); the first failing check names the step and the branch.
    A malformed spec or an unknown fault is a SetupError (exit 2)."""
    from manifests.accel import AccelSpecError
    from parity.errors import SetupError
    from parity.report import CheckResult, Report
    try:
        spec = parse_accel(accel)
    except AccelSpecError as e:
        raise SetupError(str(e)) from None
    if fault is not None and fault not in FAULTS:
        raise SetupError(f"unknown accel fault {fault!r} (known: {', '.join(FAULTS)})")
    if family not in ("wan", "cosmos3"):
        raise SetupError(f"--accel: family {family!r} is not wired yet (wan, cosmos3)")
    try:
        rows = run_accel_c1(family, spec, seed=seed, fault=fault, num_steps=num_steps,
                            **({"variant": variant} if variant else {}))
    except ValueError as e:   # a spec the model cannot run (e.g. dbcache fn + bn > the DiT's blocks)
        raise SetupError(str(e)) from None
    report = Report(family=family, level="C1", settings={"accel": spec.label(), "seed": seed, "fault": fault,
                                                          "steps": num_steps})
    for step in sorted({r.step for r in rows}):
        mine = [r for r in rows if r.step == step]
        bad = [r for r in mine if not r.ok]
        detail = "; ".join(f"{r.check}{'/' + r.branch if r.branch else ''}: {r.detail}" for r in (bad or mine[-1:]))
        report.checks.append(CheckResult(name=f"accel {spec.name} step {step}", passed=not bad, detail=detail,
                                         divergence=None if not bad else f"step {step}" + (
                                             f" branch {bad[0].branch}" if bad[0].branch else "")))
    return report
