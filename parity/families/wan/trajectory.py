"""wan C1's trajectory machinery, shared by the one-process run (c1.py) and the plan runs (parallel.py): the loop
cases of a model, one request run through the reference pipeline and through the engine, the step-by-step schedule /
trajectory rows, and the localisation of the first divergent step. c1.py dispatches to parallel.py for plan runs, so
both build on this module instead of on each other."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from manifests.parity import Tolerance
from manifests.wan import WanGenerateRequest, WanModelConfig
from parity.families.wan import cases as case_lib, umt5
from parity.families.wan.cases import LoopCase
from parity.families.wan.common import (DiTInputs, fmt_drift,
                                        optimized_step_input, run_optimized_dit, run_reference_dit)
from parity.engine_events import batch_failures
from parity.localise import first_divergence
from parity.metrics import compare, exact, within
from parity.report import CheckResult

import reference.wan as ref


def loop_cases(cfg: WanModelConfig) -> list[LoopCase]:
    """The anchor loops only (cases.anchor_cases); run_c1 runs them plus the rule-generated cases."""
    return case_lib.anchor_cases(cfg)


@dataclass
class SideRun:
    trajectory: list[torch.Tensor]
    initial: torch.Tensor | None
    timesteps: list
    experts: list[int]
    latents: torch.Tensor | None
    fed: list[torch.Tensor] = field(default_factory=list)     # the cond call's DiT timestep of every step
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# Each side's run, with the timesteps its DiT was fed
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def fed_to_reference(pipe: ref.WanReferencePipeline) -> Iterator[list]:
    """(timestep, latents) of every DiT call of the reference pipeline, in call order."""
    calls: list = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: calls.append((args[1].clone(), args[0].clone())))
             for m in (pipe.transformer, pipe.transformer_2) if m is not None]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def fed_to_engine(engine) -> Iterator[list]:
    """(row-0 timestep, row-0 latents) of every optimized DiT call, in call order."""
    calls: list = []
    dits = [d for d in (engine.model.dit, engine.model.dit_2) if d is not None]
    for d in dits:
        original = d.forward_batch

        def wrapped(latents, timesteps, *a, _original=original, **kw):
            calls.append((timesteps[:1].clone(), latents[:1].clone()))
            return _original(latents, timesteps, *a, **kw)
        d.forward_batch = wrapped
    try:
        yield calls
    finally:
        for d in dits:
            del d.forward_batch


def cond_calls(calls: list, req: WanGenerateRequest, two_forward: bool) -> list:
    """The cond call of every step: the reference and the two-forward policy make 2 calls per guided step."""
    return calls[::2] if req.uses_cfg and two_forward else calls


def run_reference(pipe: ref.WanReferencePipeline, req: WanGenerateRequest) -> SideRun:
    with fed_to_reference(pipe) as calls:
        res = pipe.generate(req, keep_trajectory=True)
    fed = [t for t, _ in cond_calls(calls, req, True)]
    return SideRun(res.trajectory, res.initial, res.timesteps, res.experts, res.latents, fed)


def run_engine_case(engine, case: LoopCase) -> list[SideRun]:
    """Each request's run; a failed request keeps the steps it completed and its error (a failed check, not a crash
    of the harness). Fed timesteps are recorded for single-request cases (a batch's rows are not per request);
    every run's extra["batch_failures"]: the case's batched steps that raised (engine_events.py)."""
    handles = []
    with fed_to_engine(engine) as calls, batch_failures(engine) as failed:
        for req, start in zip(case.requests, case.start_ticks):
            while engine.scheduler.tick_count < start and not engine.scheduler.idle:
                engine.step()
            handles.append(engine.submit(req, record_trajectory=True))
        engine.run_until_idle()
    runs = []
    for h in handles:
        batches = [len(e.data["batch"]) for e in h.events if e.kind == "trace.step"]
        graphs = [(e.data.get("graph"), e.data.get("bucket"), e.data.get("graph_cache"))
                  for e in h.events if e.kind == "trace.step" and e.data.get("loop") == "wan.denoise"]
        if h.status == "completed":
            r = h.result()
            run = SideRun(r["trajectory"], r["initial"], r["timesteps"], r["experts"], r["latents"]["vision"])
        else:
            st = h.record.state
            run = SideRun(list(getattr(st, "trajectory", [])), getattr(st, "initial", None), [], [], None,
                          extra={"error": f"engine request {h.status}: {h.record.error}"})
        run.extra["batch_sizes"] = batches
        run.extra["graphs"] = graphs
        run.extra["batch_failures"] = failed
        runs.append(run)
    if len(handles) == 1:
        two_forward = engine.options.cfg_policy == "two-forward"
        runs[0].fed = [t for t, _ in cond_calls(calls, case.requests[0], two_forward)]
    return runs


# ------------------------------------------------------------------------------------------------
# Comparison and localisation
# ------------------------------------------------------------------------------------------------

def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def schedule_checks(prefix: str, ref_run: SideRun, eng_run: SideRun) -> list[CheckResult]:
    checks = []
    ok = len(ref_run.timesteps) == len(eng_run.timesteps) and all(map(_same, eng_run.timesteps, ref_run.timesteps))
    checks.append(CheckResult(f"{prefix}/timesteps", ok,
                              detail=f"schedule {ref_run.timesteps}" if ok else
                              f"{eng_run.timesteps} vs reference {ref_run.timesteps}"))
    if eng_run.fed:
        bad = next((k for k, (a, b) in enumerate(zip(eng_run.fed, ref_run.fed)) if not exact(a, b)), None)
        ok = bad is None and len(eng_run.fed) == len(ref_run.fed)
        shape = list(ref_run.fed[0].shape) if ref_run.fed else []
        checks.append(CheckResult(
            f"{prefix}/timesteps_fed", ok,
            detail=f"the cond call's DiT timestep {shape} {ref_run.fed[0].dtype if ref_run.fed else ''} of every "
                   f"step, bitwise" if ok else f"{len(eng_run.fed)} vs {len(ref_run.fed)} calls",
            divergence=None if ok else f"step {bad}: timestep fed to the DiT" if bad is not None else "call count"))
    bad = next((k for k, (a, b) in enumerate(zip(eng_run.experts, ref_run.experts)) if a != b), None)
    ok = bad is None and len(eng_run.experts) == len(ref_run.experts)
    checks.append(CheckResult(
        f"{prefix}/experts", ok, detail=f"expert per step {ref_run.experts}" if ok else
        f"{eng_run.experts} vs reference {ref_run.experts}",
        divergence=None if ok else f"step {bad}: expert {eng_run.experts[bad]}, reference expert "
                                   f"{ref_run.experts[bad]}" if bad is not None else "step count"))
    ok = eng_run.initial is not None and exact(eng_run.initial, ref_run.initial)
    checks.append(CheckResult(f"{prefix}/noise", ok, detail="initial latents, bitwise" if ok else
                              "initial latents differ (noise draw)"))
    return checks


def trajectory_checks(prefix: str, ref_run: SideRun, eng_run: SideRun, tol: Tolerance,
                      localise: Callable[[int], str]) -> list[CheckResult]:
    checks = []
    if len(eng_run.trajectory) != len(ref_run.trajectory) or "error" in eng_run.extra:
        checks.append(CheckResult(f"{prefix}/completed", False,
                                  detail=f"{len(eng_run.trajectory)} engine steps vs {len(ref_run.trajectory)} "
                                         f"reference steps; {eng_run.extra.get('error', '')}"))
    drift, first_bad = [], None
    for step, (got, want) in enumerate(zip(eng_run.trajectory, ref_run.trajectory)):
        m = compare(got, want)
        drift.append(m.rel_l2)
        ok = within(m, tol)
        c = CheckResult(f"{prefix}/step{step}", ok, m, tol, detail=f"t = {ref_run.timesteps[step]}, expert "
                                                                   f"{ref_run.experts[step]}")
        if not ok and first_bad is None:
            first_bad = step
            c.divergence = localise(step)
        checks.append(c)
    if eng_run.latents is not None:
        m = compare(eng_run.latents, ref_run.latents)
        c = CheckResult(f"{prefix}/latents", within(m, tol), m, tol,
                        detail=f"final latents; trajectory drift: {fmt_drift(drift)}")
        c.extra = {"drift_rel_l2": drift}
        if not c.passed and first_bad is None:
            c.divergence = "after the loop (final blend)"
        checks.append(c)
    return checks


def localise_step(pipe: ref.WanReferencePipeline, engine, req: WanGenerateRequest, ref_run: SideRun,
                  eng_run: SideRun, step: int, tol: Tolerance) -> str:
    """Each side rebuilds the DiT input of `step` from its own previous latents; the first differing input, else
    the first divergent traced layer of the cond (then uncond) branch, else the combine / solver."""
    where = f"step {step}"
    if step < len(eng_run.experts) and eng_run.experts[step] != ref_run.experts[step]:
        return f"step {step}: expert {eng_run.experts[step]}, reference expert {ref_run.experts[step]} (the step ran " \
               f"another expert's weights: no layer comparison)"
    if step < len(eng_run.timesteps) and not _same(eng_run.timesteps[step], ref_run.timesteps[step]):
        where += f" (timestep {eng_run.timesteps[step]} vs reference {ref_run.timesteps[step]})"
    ref_prev = ref_run.initial if step == 0 else ref_run.trajectory[step - 1]
    eng_prev = eng_run.initial if step == 0 else eng_run.trajectory[step - 1]
    condition = pipe.encode_condition(req, tuple(ref_prev.shape)) if req.image is not None else None
    x, t = pipe.model_inputs(ref_prev, pipe.make_solver(req).timesteps[step], condition)
    text, negative = pipe.encode_text(req)
    image = req.image_embeds.float()[None] if req.image_embeds is not None else None
    ref_model = pipe.transformer if ref_run.experts[step] == 1 else pipe.transformer_2
    state, branch = optimized_step_input(engine.loop("denoise"), req, eng_prev, step)
    fast = engine.model.expert(state.experts[step])
    if not exact(branch.timestep.cpu(), t):
        return f"{where}, DiT input timestep {branch.timestep.flatten()[:4].tolist()} vs reference " \
               f"{t.flatten()[:4].tolist()}"
    mx = compare(branch.latents.float(), x)
    if not within(mx, tol):
        return f"{where}, DiT input latents / conditioning (rel_l2 {mx.rel_l2:.2e})"
    branches = [("cond", text, branch.text, req.text_ids)]
    if req.uses_cfg:
        branches.append(("uncond", negative, state.negative_text, req.negative_text_ids))
    for name, want_text, got_text, ids in branches:
        if not within(compare(got_text, want_text), tol):
            mask = (torch.arange(want_text.shape[1]) < ids.numel()).long()[None]
            return f"{where}, {name} branch, DiT input text: " + \
                umt5.padding_divergence(got_text.float().cpu(), want_text, mask, tol)
        want, got = {}, {}
        run_reference_dit(ref_model, DiTInputs(x, t, want_text, image), want)
        run_optimized_dit(fast, DiTInputs(branch.latents, branch.timestep, got_text, branch.image_embeds), got)
        div = first_divergence(got, want, tol)
        if div is not None:
            return f"{where}, {name} branch, layer {div.name} (rel_l2 {div.metrics.rel_l2:.2e})"
    return f"{where}, no layer: after the transformer (CFG combine / solver)"
