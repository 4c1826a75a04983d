"""wan C1: whole denoising loops, `WanReferencePipeline.generate(keep_trajectory=True)` vs the engine (the wan
FamilyEntry's `denoise` loop under the WorkUnitScheduler, `record_trajectory=True`), compared after every step.

Cases per whole-model variant (4 steps each; cases.py): the anchors (the task's own request: t2v UniPC + CFG; i2v
with its image and CLIP embeddings; ti2v with an image; two experts with guidance_scale_2; FlowMatch Euler without
CFG; three concurrent requests at different start ticks, the unguided one in the middle, each against its own solo
reference run; the two-forward CFG policy; for ti2v the text-only request), then the rule-generated cases of the
`--cases` matrix (guidance < 1; an unguided request at a drawn (ci) or every (full) position of a same-tick batch
mixing Euler and UniPC rows; a one-token prompt edit through the warm text cache; two experts with a step exactly on
the boundary, whose reference timestep and expert are checked as a row of their own). Rows per
request: the schedule and the timesteps actually fed to the DiT (exact, dtype included), the expert of every step
(exact), the noise draw (bitwise), every step's latents, and the final latents with the trajectory drift. The first
divergent step is localised: both sides rebuild that step's DiT input from their own previous latents; differing
inputs are named, else both DiTs are traced on them and the first divergent layer is named.

The reference pipeline runs fp32 (it has no half-precision path); a bf16 run compares the bf16 engine with it under
the contract's C1 bf16 row. Golden probe `wan.generate` (diffusers WanPipeline / WanImageToVideoPipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from manifests import ManifestError
from manifests.wan import WanGenerateRequest, WanModelConfig
from parity.errors import SetupError
from parity.families.wan import cases as case_lib, faults
from parity.families.wan.cases import STEPS
from parity.families.wan.common import (DEFAULT_VARIANTS, IMAGE_INPUT, contract_tolerance,
                                        convert_upstream, engine_decode, engine_for, fmt_drift,
                                        golden_components, golden_image_request, reference_pipeline,
                                        resolve_models)
from parity.family import DTYPES, golden_probe
from parity.graph_checks import (InterleaveCases, capture_interleave_checks, dynamo_counts, graph_kinds_check,
                                  recording_calls)
from parity.engine_events import no_batch_failed_check
from parity.metrics import compare, exact, within
from parity.report import CheckResult, Report, exceptions_fail

import optimized
from optimized.models.wan.denoise import WanDenoiseJob
import reference.wan as ref
from parity.families.wan.trajectory import (SideRun, cond_calls, fed_to_engine, fed_to_reference, localise_step,
                                            run_engine_case, run_reference, schedule_checks, trajectory_checks)


# ------------------------------------------------------------------------------------------------
# C1 runner
# ------------------------------------------------------------------------------------------------

def boundary_check(prefix: str, cfg: WanModelConfig, ref_run: SideRun, step: int) -> CheckResult:
    """The case's own claim: the reference's timestep of `step` equals the expert boundary exactly, and (upstream
    `t >= boundary`) the high-noise expert 1 runs it. The engine's experts are compared in `experts`."""
    boundary = cfg.boundary_ratio * cfg.num_train_timesteps
    t = ref_run.timesteps[step] if step < len(ref_run.timesteps) else None
    expert = ref_run.experts[step] if step < len(ref_run.experts) else None
    ok = t is not None and t == boundary and expert == 1
    return CheckResult(f"{prefix}/boundary_step", ok,
                       detail=f"step {step}: t = {t}, boundary {boundary}, reference expert {expert} (must be 1)",
                       divergence=None if ok else f"step {step}: not on the boundary or not expert 1")


def run_c1(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress: Callable[[str], None], plan: str | None = None,
           cases: str = "ci", graph: str = "eager") -> Report:
    """`plan` (e.g. "ulysses2", "cfgp2,ulysses2"): every rank of the plan on gloo vs the reference (parallel.py).
    `cases`: the case matrix ("ci": every rule once, "full": every draw and batch position; cases.py)."""
    faults.check_fault(fault, "C1", faults.C1_FAULTS)
    if graph == "cuda" and plan:  # `graph`: how the engine's DiT block stack runs (eager, compile, cuda)
        raise SetupError(f"--graph cuda with --plan {plan}: plan ranks run on CPU (gloo); CUDA graph capture needs "
                         f"CUDA ranks (NCCL): use --graph compile")
    if cases not in case_lib.MATRICES:
        raise SetupError(f"unknown case matrix {cases!r}; known: {', '.join(case_lib.MATRICES)}")
    models = resolve_models(variants, checkpoint, seed, kinds=("model",))
    if plan or fault in faults.PARALLEL_FAULTS:
        from parity.families.wan import parallel
        parsed = parallel.parse_plan(plan or "", models, device, fault)
        if parsed.world_size > 1:
            report = Report("wan", "C1", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                          "dtypes": dtypes, "seed": seed, "checkpoint": checkpoint, "fault": fault,
                                          "steps": STEPS, "reference": "fp32 CPU", "graph": graph})
            return parallel.run_c1_plan(report, models, parsed, device, dtypes, seed, fault, progress, graph,
                                        cases)
    if fault == "expert-switch-late" and not any(m.cfg.two_experts for m in models):
        raise SetupError("fault expert-switch-late needs a two-expert variant (e.g. tiny-2.2-t2v-a14b)")
    report = Report("wan", "C1", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                  "dtypes": dtypes, "seed": seed, "checkpoint": checkpoint, "fault": fault,
                                  "steps": STEPS, "cases": cases, "graph": graph,
                                  "reference": "fp32 CPU (the reference pipeline's only precision)"})
    for m in models:
        pipe = reference_pipeline(m)
        for dname in dtypes:
            dtype = DTYPES[dname]
            tol = contract_tolerance("C1", "loop", dname, device)
            step_tol = contract_tolerance("C0", "dit", dname, device)
            interleave = InterleaveCases()
            for case in case_lib.c1_cases(m.cfg, cases, seed):
                prefix = f"{m.name}/{dname}/{case.name}"
                progress(f"[wan C1] {prefix}: {len(case.requests)} request(s), {case.cfg_policy} CFG")
                with exceptions_fail(report.checks, prefix):  # an exception fails this case, not the run
                    engine = engine_for(m, device, dtype, seed, case.cfg_policy)
                    engine.model.configure_graph(graph, cfg_policy=case.cfg_policy)
                    with faults.planted_engine(fault, engine):
                        # the block-stack calls of the first case and of the first with two callers, replayed interleaved
                        recorded = interleave.wants(len(case.requests))
                        with recording_calls(engine.model.experts(), enabled=recorded) as calls:
                            eng_runs = run_engine_case(engine, case)
                        report.checks += capture_interleave_checks(prefix, calls)
                        if len(case.requests) > 1 and case.batched:  # rerun solo: right latents, still a bug
                            report.checks.append(no_batch_failed_check(prefix, eng_runs[0].extra["batch_failures"]))
                        for k, (req, eng_run) in enumerate(zip(case.requests, eng_runs)):
                            ref_run = run_reference(pipe, req)
                            p = prefix + (f"/req{k}" if len(case.requests) > 1 else "")
                            report.checks += schedule_checks(p, ref_run, eng_run)
                            report.checks += trajectory_checks(
                                p, ref_run, eng_run, tol, lambda step, req=req, r=ref_run, e=eng_run, eng=engine:
                                localise_step(pipe, eng, req, r, e, step, step_tol))
                            if case.boundary_step is not None:
                                report.checks.append(boundary_check(p, m.cfg, ref_run, case.boundary_step))
                            if graph != "eager":  # the block stack really ran the asked graph, step by step
                                report.checks.append(graph_kinds_check(
                                    f"{p}/graph_{graph}", graph, eng_run.extra.get("graphs", []),
                                    dynamo_counts() if graph == "compile" else None))
                            if len(case.requests) > 1 and case.batched:
                                sizes = eng_run.extra["batch_sizes"]
                                report.checks.append(CheckResult(f"{p}/batched_with_others", max(sizes, default=0) > 1,
                                                                 detail=f"batch size per step {sizes}"))
    return report


# ------------------------------------------------------------------------------------------------
# Upstream golden probe `wan.generate` (diffusers 0.42.1 WanPipeline / WanImageToVideoPipeline, output "latent")
# ------------------------------------------------------------------------------------------------

def golden_model(case) -> tuple[WanModelConfig, dict[str, dict[str, torch.Tensor]]]:
    """params.model_config, and each component of upstream/ through fvconvert's in-memory path; every component's
    config must be the model config's."""
    p = case.meta.get("params", {})
    try:
        cfg = WanModelConfig.from_dict(p["model_config"])
    except (KeyError, ManifestError) as e:
        raise SetupError(f"golden case {case.path}: params.model_config ({e})") from None
    want = golden_components(cfg)
    weights = {}
    for name, component_cfg in want.items():
        got_cfg, state = convert_upstream(case, case.path / "upstream" / name)
        if got_cfg != component_cfg:
            raise SetupError(f"golden case {case.path}: upstream/{name} is not params.model_config's {name}")
        weights[name] = state
    return cfg, weights


def golden_request(case, cfg: WanModelConfig) -> WanGenerateRequest:
    t, p = case.inputs, case.meta.get("params", {})
    try:
        req = WanGenerateRequest(
            text_ids=t["text_ids"], negative_text_ids=t.get("negative_text_ids"), num_frames=int(p["num_frames"]),
            height=int(p["height"]), width=int(p["width"]), num_steps=int(p["num_inference_steps"]),
            guidance_scale=float(p["guidance_scale"]), guidance_scale_2=p.get("guidance_scale_2"),
            seed=int(p["seed"]), solver=p["solver"], flow_shift=float(p["flow_shift"]), image=t.get("image"),
            image_embeds=t.get("image_embeds"))
        return req if IMAGE_INPUT in t else req.validate(cfg)   # from an image: each side's processor completes it
    except (KeyError, TypeError, ValueError) as e:  # ManifestError included
        raise SetupError(f"golden case {case.path}: incomplete wan.generate inputs / params ({e})") from None


GENERATE_REQUIRED = ("latents", "trajectory", "initial_latents", "timesteps", "sigmas", "model_timesteps", "experts",
                     "text_embeds")


def required_outputs(req: WanGenerateRequest) -> list[str]:
    """What golden/README.md documents for this request (video is optional: only some cases store it)."""
    need = list(GENERATE_REQUIRED)
    if req.uses_cfg:
        need.append("negative_text_embeds")
    if req.image is not None:
        need.append("model_input_0")
    return need


@dataclass
class GoldenSide:
    latents: torch.Tensor
    trajectory: list[torch.Tensor]
    initial: torch.Tensor
    timesteps: torch.Tensor
    sigmas: torch.Tensor
    fed: list[tuple[torch.Tensor, torch.Tensor]]       # (timestep, latents) of every cond call
    experts: list[int]
    text: torch.Tensor                                 # [L, d]
    negative_text: torch.Tensor | None
    video: Callable[[], torch.Tensor]


def golden_reference(cfg, weights, req) -> GoldenSide:
    pipe = ref.WanReferencePipeline(cfg, weights)
    with fed_to_reference(pipe) as calls:
        res = pipe.generate(req, keep_trajectory=True)
    solver = pipe.make_solver(req)
    text, negative = pipe.encode_text(req)
    return GoldenSide(res.latents, res.trajectory, res.initial, solver.timesteps, solver.sigmas,
                      cond_calls(calls, req, True), res.experts, text[0],
                      None if negative is None else negative[0], lambda: pipe.decode(res.latents))


def golden_engine(cfg, weights, req) -> GoldenSide:
    engine = optimized.Engine.from_weights(cfg, weights, weights_version="golden", batching="greedy")
    with fed_to_engine(engine) as calls:
        r = engine.generate(req, record_trajectory=True)
    state = engine.loop("denoise").init_state(WanDenoiseJob(req))
    L = cfg.max_sequence_length
    enc = engine.model.text_encoder
    negative = enc.encode([req.negative_text_ids], L)[0] if req.uses_cfg else None
    return GoldenSide(r["latents"]["vision"], r["trajectory"], r["initial"], state.timesteps, state.sigmas, calls,
                      r["experts"], enc.encode([req.text_ids], L)[0], negative,
                      lambda: engine_decode(engine, r["latents"]["vision"]))


@golden_probe(required=GENERATE_REQUIRED, optional=("negative_text_embeds", "video", "image_embeds"),
              required_with={"image": ("model_input_0",), IMAGE_INPUT: ("model_input_0", "image_embeds")})
def golden_generate_probe(case, sides) -> list[CheckResult]:
    cfg, weights = golden_model(case)
    req = golden_request(case, cfg)
    tol, out = case.tolerance, case.outputs
    missing = [k for k in required_outputs(req) if k not in out]
    if missing:
        return [CheckResult(f"{case.name}/{side}", False, detail=f"case lacks documented outputs {missing}")
                for side in sides]
    results: list[CheckResult] = []

    def close(name, got, want, detail=""):
        m = compare(got, want)
        results.append(CheckResult(name, within(m, tol), m, tol, detail=detail))

    def same(name, ok, detail):
        results.append(CheckResult(name, ok, detail=detail))

    for side in sides:
        name = f"{case.name}/{side}"
        side_req, image_rows = golden_image_request(case, cfg, weights, req, side)
        results += image_rows
        s = golden_reference(cfg, weights, side_req) if side == "reference" else golden_engine(cfg, weights, side_req)
        fed_t = torch.cat([t for t, _ in s.fed]) if s.fed else torch.zeros(0)
        for key, got in (("timesteps", s.timesteps), ("model_timesteps", fed_t), ("experts",
                         torch.tensor(s.experts, dtype=torch.int64)), ("initial_latents", s.initial)):
            ok = exact(got, out[key])
            same(f"{name}:{key}", ok, "bitwise, dtype included" if ok else
                 f"{got.dtype} {list(got.shape)} {got.flatten()[:6].tolist()} vs upstream {out[key].dtype} "
                 f"{list(out[key].shape)} {out[key].flatten()[:6].tolist()}")
        close(f"{name}:sigmas", s.sigmas, out["sigmas"])
        n = req.text_ids.numel()
        close(f"{name}:text_embeds", s.text[:n], out["text_embeds"], f"first {n} rows")
        same(f"{name}:text_padding", bool((s.text[n:] == 0).all()),
             f"rows {n}..{s.text.shape[0] - 1} zero by construction (WanPipeline): checked exactly 0")
        if "negative_text_embeds" in out:
            if s.negative_text is None:
                same(f"{name}:negative_text_embeds", False, "the case stores negative embeddings for a request "
                                                            "that runs no CFG")
            else:
                close(f"{name}:negative_text_embeds", s.negative_text[:req.negative_text_ids.numel()],
                      out["negative_text_embeds"])
        if "model_input_0" in out:
            close(f"{name}:model_input_0", s.fed[0][1] if s.fed else torch.zeros(0), out["model_input_0"],
                  "the first DiT input (cond call)" + ("; its 4 mask channels are 0 off frame 0 by construction"
                                                       if cfg.task == "i2v" else ""))
        steps = [compare(x, out["trajectory"][k]) for k, x in enumerate(s.trajectory)]
        bad = [k for k, m in enumerate(steps) if not within(m, tol)]
        worst = max(steps, key=lambda m: m.rel_l2) if steps else None
        drift = fmt_drift([m.rel_l2 for m in steps])
        results.append(CheckResult(f"{name}:trajectory", not bad and len(steps) == len(out["trajectory"]), worst,
                                   tol, detail=f"first divergent step {bad[0]}" if bad else
                                   f"{len(steps)} of {len(out['trajectory'])} steps; {drift}"))
        close(f"{name}:latents", s.latents, out["latents"])
        if "video" in out:
            close(f"{name}:video", s.video(), out["video"], "decoded (clamped), before postprocess")
    return results


PROBES = {"wan.generate": golden_generate_probe}
