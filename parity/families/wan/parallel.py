"""wan C1 under a parallel plan (`fvparity run wan --level C1 --plan ulysses2`): the plan is checked against the wan
contract (optimized/models/wan PARALLELISM) before anything runs (a refused plan is a setup error, exit 2), the
ranks are spawned on CPU with gloo (optimized/parallel/launch.py `run_ranks`), and every rank runs c1's loop cases
through its own engine, parallelized by the family's `parallelize` hook (Ulysses / ring SP inside the DiT; the
cfgp axis through the CFG-parallel policy).

Rows per rank and request: c1's schedule rows, every step's latents and the final latents vs the fp32 reference
pipeline (the loop tolerance), the engine's SP=N final latents vs the engine in one process (`vs_one_process`), and
that every rank holds the same latents. Localisation: each rank also traces its (parallel) DiT on the reference's
own DiT input of every step of each case's first request; the first divergent step is named with the first
divergent layer of that trace.
"""

from __future__ import annotations

from typing import Callable

import torch

from optimized.parallel.plan import ParallelPlan, ParallelPlanError
from parity.errors import SetupError
from parity.families.wan import faults
from parity.families.wan.c1 import (LoopCase, loop_cases, run_engine_case, run_reference, schedule_checks,
                                    trajectory_checks)
from parity.families.wan.common import (DiTInputs, ModelUnderTest, contract_tolerance, engine_for, reference_pipeline,
                                        run_optimized_dit, run_reference_dit)
from parity.family import DTYPES
from parity.localise import first_divergence
from parity.metrics import compare, within
from parity.report import CheckResult, Report

RANK_TIMEOUT_S = 600.0


def parse_plan(text: str, models: list[ModelUnderTest], device: str, fault: str | None) -> ParallelPlan:
    """The plan, validated for every model (SetupError naming the broken constraint)."""
    from optimized.models.wan import PARALLELISM

    try:
        plan = ParallelPlan.parse(text)
        for m in models:
            PARALLELISM.validate(plan, m.cfg, plan.world_size)
    except ParallelPlanError as e:
        raise SetupError(f"--plan {text}: {e}") from None
    if plan.world_size > 1 and not device.startswith("cpu"):
        raise SetupError(f"--plan spawns its ranks on CPU (gloo); --device {device} does not apply")
    if fault in faults.SP_FAULTS and plan.sp_ulysses == 1:
        raise SetupError(f"fault {fault} lives in the Ulysses all-to-all: give a plan with ulysses > 1")
    return plan


def _dit_inputs(pipe, req, ref_run, step: int) -> tuple[int, DiTInputs]:
    """(expert, the reference's own cond-branch DiT input) of `step`."""
    prev = ref_run.initial if step == 0 else ref_run.trajectory[step - 1]
    condition = pipe.encode_condition(req, tuple(prev.shape)) if req.image is not None else None
    x, t = pipe.model_inputs(prev, pipe.make_solver(req).timesteps[step], condition)
    text, _ = pipe.encode_text(req)
    image = req.image_embeds.float()[None] if req.image_embeds is not None else None
    detached = (None if v is None else v.detach() for v in (x, t, text, image))   # they cross process boundaries
    return ref_run.experts[step], DiTInputs(*detached)


def _rank_worker(group, plan_text: str, m: ModelUnderTest, seed: int, dname: str, cases: list[LoopCase], fault: str | None, probes: list[list[tuple[int, DiTInputs]]]) -> list:
    """This rank's runs of every case, and its DiT traces on the probe inputs: [(runs, [trace per step])]."""
    from optimized.parallel.cfg_parallel import CFGParallel
    from optimized.parallel.mesh import build_mesh

    plan = ParallelPlan.parse(plan_text)
    mesh = build_mesh(plan)
    out = []
    for case, case_probes in zip(cases, probes):
        policy = CFGParallel(mesh.axis("cfgp")) if plan.cfgp > 1 else case.cfg_policy
        engine = engine_for(m, "cpu", DTYPES[dname], seed, policy)
        engine.family.parallelize(engine.model, mesh)
        traces = []
        with faults.planted_engine(fault, engine):
            runs = run_engine_case(engine, case)
            for expert, x in case_probes:
                trace: dict = {}
                run_optimized_dit(engine.model.expert(expert), x, trace)
                traces.append({k: v.float() for k, v in trace.items()})
        out.append((runs, traces))
    return out


def run_c1_plan(report: Report, models: list[ModelUnderTest], plan: ParallelPlan, device: str, dtypes: list[str],
                seed: int, fault: str | None, progress: Callable[[str], None]) -> Report:
    from optimized.parallel.launch import run_ranks

    report.settings["plan"] = plan.name()
    for m in models:
        pipe = reference_pipeline(m)
        cases = loop_cases(m.cfg)
        ref_runs = [[run_reference(pipe, req) for req in case.requests] for case in cases]
        probes = [[_dit_inputs(pipe, case.requests[0], runs[0], s) for s in range(len(runs[0].trajectory))]
                  for case, runs in zip(cases, ref_runs)]
        for dname in dtypes:
            tol = contract_tolerance("C1", "loop", dname, device)
            step_tol = contract_tolerance("C0", "dit", dname, device)
            progress(f"[wan C1] {m.name}/{dname}: plan {plan.name()} on {plan.world_size} gloo ranks, "
                     f"{len(cases)} cases")
            ranks = run_ranks(_rank_worker, plan.world_size, (plan.name(), m, seed, dname, cases, fault, probes), timeout_s=RANK_TIMEOUT_S)
            for c, case in enumerate(cases):
                one = run_engine_case(engine_for(m, device, DTYPES[dname], seed, case.cfg_policy), case)
                prefix = f"{m.name}/{dname}/{plan.name()}/{case.name}"
                for k, req in enumerate(case.requests):
                    ref_run = ref_runs[c][k]
                    for r, rank in enumerate(ranks):
                        eng_run, traces = rank[c][0][k], rank[c][1]
                        p = f"{prefix}/rank{r}" + (f"/req{k}" if len(case.requests) > 1 else "")
                        report.checks += schedule_checks(p, ref_run, eng_run)
                        report.checks += trajectory_checks(
                            p, ref_run, eng_run, tol, lambda step, k=k, traces=traces, r=r, req=req, ref_run=ref_run:
                            _localise(pipe, probes[c], traces, step, step_tol, r) if k == 0 else
                            f"step {step} (rank {r}; layers are traced for the case's first request only)")
                        if eng_run.latents is not None and one[k].latents is not None:
                            mt = compare(eng_run.latents, one[k].latents)
                            report.checks.append(CheckResult(
                                f"{p}/vs_one_process", within(mt, tol), mt, tol,
                                detail=f"engine final latents, plan {plan.name()} vs one process"))
                    lat = [rank[c][0][k].latents for rank in ranks]
                    agree = all(x is not None and torch.equal(x, lat[0]) for x in lat)
                    report.checks.append(CheckResult(
                        f"{prefix}" + (f"/req{k}" if len(case.requests) > 1 else "") + "/ranks_agree", agree,
                        detail=f"final latents bitwise equal on all {len(ranks)} ranks" if agree else
                        "the ranks hold different final latents"))
    return report


def _localise(pipe, probes: list[tuple[int, DiTInputs]], traces: list[dict], step: int, tol, rank: int) -> str:
    """The first layer of this rank's parallel DiT that leaves tolerance on the reference's own input of `step`."""
    if step >= len(traces):
        return f"step {step} (rank {rank})"
    expert, x = probes[step]
    want: dict = {}
    run_reference_dit(pipe.transformer if expert == 1 else pipe.transformer_2, x, want)
    div = first_divergence(traces[step], want, tol)
    if div is None:
        return f"step {step}, no layer (rank {rank}): the DiT agrees on the reference's input (CFG combine / solver)"
    return f"step {step}, cond branch, layer {div.name} (rank {rank}, rel_l2 {div.metrics.rel_l2:.2e})"
