"""cosmos3 C1 under a parallel plan (`fvparity run cosmos3 --level C1 --plan cfgp2,ulysses2`): the plan is checked
against the cosmos3 contract (optimized/models/cosmos3 PARALLELISM) before anything runs (a refused plan is a setup
error, exit 2), the ranks are spawned on CPU with gloo (optimized/parallel/launch.py `run_ranks`), and every rank
runs the plan's cases (`plan_cases`: c1's loop cases of the `--cases` matrix, and under cfgp the
`cfgp_mixed_rows` batches: guided and unguided requests whose rows the cfgp split cuts inside a branch) through its
own engine, parallelized by the family's `parallelize` hook (Ulysses / ring SP of
the gen stream with head-sharded und K/V, optimized/models/cosmos3/parallelize.py; tensor parallel,
optimized/models/cosmos3/tp.py, each tp rank reading only its slices of the variant written as a canonical checkpoint;
the cfgp axis through the CFG-parallel policy). Parallel faults (PARALLEL_FAULT_DECLS) are planted by every rank
itself.

Rows per rank and request: c1's rows (timesteps, initial noise, every step's latents vs the fp32 reference loop, the
loop tolerance), the engine's final latents under the plan vs the engine in one process (`vs_one_process`), and that
every rank holds the same latents (`ranks_agree`); a case whose requests overlap in time must have batched them on
every rank (`batched_with_others`), and no batched step may raise on any rank (`no_batch_failed`, per case and
rank): the scheduler reruns a batch whose step raised request by request, so a batched step that cannot run shows
only in these two. Localisation: each rank also traces its (parallel) model on the
reference's own inputs of every step of each case's first request, both CFG branches; the first divergent step is
named with the first divergent layer of that trace (or "after the transformer" when every layer agrees).
C0 per plan: the cond-branch outputs of those traces vs the reference transformer on the same inputs, per output,
at the C0 tolerance (`.../<case>/rankR/forward_stepS:vision|sound|action`, `_forward_checks`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

import torch

from manifests.parity import load_parity_contract
from optimized.parallel.plan import ParallelPlan, ParallelPlanError
from parity.cases import cfgp_mixes, draws, rule_rng
from parity.errors import SetupError
from parity.families.cosmos3 import cases as case_lib
from parity.families.cosmos3 import faults as fault_lib
from parity.families.cosmos3 import c1 as one_process
from parity.families.cosmos3.c1 import (compare_runs, forward_inputs, loop_cases, requests_overlap, run_engine_case,
                                        run_reference_loop)
from parity.families.cosmos3.cases import STEPS
from parity.families.cosmos3.common import DEFAULT_VARIANTS, load_reference, resolve_models
from parity.engine_events import no_batch_failed_check
from parity.family import DTYPE_NAMES, DTYPES
from parity.graph_checks import dynamo_counts, graph_kinds_check
from parity.localise import TraceRecorder, first_divergence
from parity.metrics import compare, within
from parity.report import CheckResult, Report

RANK_TIMEOUT_S = 900.0
Probe = tuple[str, object]   # (branch, Cosmos3ForwardInputs) of one step


def run_c1(variants, checkpoint, device, dtypes, seed, fault, progress, graph: str = "eager", cases: str = "ci",
           only: tuple[str, ...] | None = None, plan: str | None = None) -> Report:
    """The family's C1 entry. `plan` (e.g. "cfgp2,ulysses2", or a parallel fault planted): the loop cases on every
    rank of the plan (gloo) vs the reference and vs one process; otherwise (or a world size of 1) c1.run_c1."""
    if plan or fault in fault_lib.PARALLEL_FAULT_AXES:
        models = resolve_models(variants, checkpoint, seed)
        parsed = parse_plan(plan or "", models, device, fault)
        if parsed.world_size > 1:
            if graph == "cuda":
                raise SetupError("--graph cuda under a plan needs CUDA ranks (NCCL); plan ranks run on CPU (gloo): "
                                 "use --graph compile")
            report = Report("cosmos3", "C1", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                              "dtypes": dtypes, "seed": seed, "checkpoint": checkpoint,
                                              "fault": fault, "steps": STEPS, "cases": cases, "graph": graph})
            return run_c1_plan(report, models, parsed, device, dtypes, seed, fault, progress, cases,
                               lambda name: only is None or any(name.startswith(o) for o in only), graph)
    return one_process.run_c1(variants, checkpoint, device, dtypes, seed, fault, progress, graph, cases, only)


def parse_plan(text: str, models: list, device: str, fault: str | None) -> ParallelPlan:
    """The plan, validated for every model (SetupError naming the broken constraint)."""
    from optimized.models.cosmos3 import PARALLELISM

    try:
        plan = ParallelPlan.parse(text)
        for _, cfg, _ in models:
            PARALLELISM.validate(plan, cfg, plan.world_size)
    except ParallelPlanError as e:
        raise SetupError(f"--plan {text}: {e}") from None
    if plan.world_size > 1 and not device.startswith("cpu"):
        raise SetupError(f"--plan spawns its ranks on CPU (gloo); --device {device} does not apply")
    need = fault_lib.PARALLEL_FAULT_AXES.get(fault)
    if need is not None and plan.degree(need) == 1:
        raise SetupError(f"fault {fault} lives on the {need} axis: give a plan with {need} > 1")
    return plan


def cfgp_mixed_rows_cases(cfg, cfgp: int, matrix: str = "ci", seed: int = 0) -> list:
    """Rule `cfgp_mixed_rows` (wan's, parity/families/wan/cases.py): guided and unguided requests (guidance exactly 1:
    cosmos3 runs CFG at any other scale) submitted on one tick, in counts whose rows the `cfgp` split cuts inside a
    branch, each with its own drawn prompt length and frame count."""
    out = []
    for d in draws(matrix):
        r = rule_rng("cosmos3", "cfgp_mixed_rows", seed, d)
        guided, unguided = r.choice(cfgp_mixes(cfgp))
        seed0 = r.randint(100, 10 ** 6)
        scales = [round(r.uniform(1.5, 8.0), 2) for _ in range(guided)] + [1.0] * unguided
        r.shuffle(scales)
        reqs = tuple(case_lib.request(cfg, seed0 + k, g, r.randint(3, 9), latent_frames=r.randint(1, 3))
                     for k, g in enumerate(scales))
        out.append(case_lib.LoopCase(f"cfgp_mixed_rows.{d}.g{guided}u{unguided}", reqs,
                                     start_ticks=(0,) * len(reqs),
                                     rules=("cfgp_mixed_rows", "batch_position", "guidance_1", "guidance_gt1")))
    return out


def plan_cases(cfg, plan: ParallelPlan, matrix: str = "ci", seed: int = 0) -> list:
    """c1's loop cases of `matrix`, then the cfgp mixed-rows batches when the plan has cfgp > 1."""
    return loop_cases(cfg, matrix, seed) + (cfgp_mixed_rows_cases(cfg, plan.cfgp, matrix, seed) if plan.cfgp > 1
                                            else [])


def _batched_check(name: str, case, eng_run) -> list[CheckResult]:
    """For a case whose requests overlap in time (all submitted before the first finishes): some step ran this
    request together with another."""
    if not requests_overlap(case):
        return []
    sizes = eng_run.extra.get("batch_sizes", [])
    return [CheckResult(f"{name}/batched_with_others", max(sizes, default=0) > 1, detail=f"batch size per step {sizes}")]


def _probes(cfg, case, ref_run, dtype) -> list[list[Probe]]:
    """Per step of the case's first request: the reference's own forward inputs of each CFG branch."""
    req = case.requests[0]
    out = []
    for step in range(len(ref_run.trajectory)):
        before = ref_run.initial if step == 0 else ref_run.trajectory[step - 1]
        branches = [("cond", req.text_ids)] + ([("uncond", req.negative_text_ids)] if req.uses_cfg else [])
        out.append([(b, forward_inputs(cfg, req, before, ref_run.timesteps[step], dtype, ids)) for b, ids in branches])
    return out


def write_canonical_transformer(cfg, state: dict, root: Path) -> Path:
    """The variant's canonical transformer state as a canonical checkpoint directory (config.json, manifest.json,
    model.safetensors: the canonical keys as they are), for tp ranks that read only their slices of it."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg.to_dict()))
    (root / "manifest.json").write_text(json.dumps({"family": "cosmos3", "component": "transformer"}))
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / "model.safetensors"))
    return root


def _rank_engine(cfg, state, dname: str, policy, mesh, checkpoint: str | None):
    """This rank's engine: under tp > 1 with a checkpoint, the transformer read as this rank's slices only."""
    import optimized

    if checkpoint and mesh.plan.tp > 1:
        from optimized.models.cosmos3 import FAMILY, PARALLELISM
        return optimized.Engine(PARALLELISM.load_sharded(checkpoint, mesh, "cpu", DTYPES[dname]), FAMILY,
                                cfg_policy=policy, batching="greedy")
    return optimized.Engine.from_state_dict(cfg, state, "cpu", DTYPES[dname], cfg_policy=policy, batching="greedy")


def _rank_worker(group, plan_text: str, cfg, state, dname: str, cases: list, fault: str | None,
                 probes: list[list[list[Probe]]], checkpoint: str | None = None, graph: str = "eager",
                 ar_reqs: list | None = None) -> tuple[list, dict | None]:
    """This rank's runs of every case and its traces on the probe inputs ([(runs, [[(branch, trace)] per step],
    bytes per axis)]) and its reasoning results for `ar_reqs` (one engine, every request submitted at once: tokens,
    logits and the decode steps' graph kinds), or None.
    `checkpoint` (tp > 1): the canonical transformer directory this rank reads its tp slices from (`state` None);
    `graph`: how the step bodies run under the plan (eager / compile; traces always run eager)."""
    from optimized.parallel.cfg_parallel import CFGParallel
    from optimized.parallel.mesh import build_mesh

    plan = ParallelPlan.parse(plan_text)
    mesh = build_mesh(plan)
    out = []
    with fault_lib.planted_parallel(fault):
        for case, case_probes in zip(cases, probes):
            policy = CFGParallel(mesh.axis("cfgp")) if plan.cfgp > 1 else case.cfg_policy
            sent = {a: mesh.axis(a).stats["bytes_sent"] for a, _ in plan.active_axes}
            engine = _rank_engine(cfg, state, dname, policy, mesh, checkpoint)
            engine.family.parallelize(engine.model, mesh)
            engine.model.configure_graph(graph, cfg_policy=getattr(policy, "name", policy))
            runs = run_engine_case(engine, case)
            traces = []
            for step_probes in case_probes:
                per_branch = []
                for branch, inp in step_probes:
                    rec = TraceRecorder(sample=0)
                    with torch.no_grad():
                        engine.model.forward_batch([inp], trace=rec)
                    per_branch.append((branch, rec.records))
                traces.append(per_branch)
            used = {a: mesh.axis(a).stats["bytes_sent"] - sent[a] for a in sent}   # bytes each axis sent
            if graph == "compile":  # what dynamo really compiled on this rank (a silent eager run would show 0)
                runs[0].extra["dynamo"] = dynamo_counts()
            out.append((runs, traces, used))
        reasoning = _rank_reasoning(cfg, state, dname, mesh, checkpoint, graph, ar_reqs) if ar_reqs else None
    return out, reasoning


def _rank_reasoning(cfg, state, dname: str, mesh, checkpoint: str | None, graph: str, reqs: list) -> dict:
    """The AR decode loop under the plan (whole on every rank under SP / cfgp; head-sharded under tp)."""
    engine = _rank_engine(cfg, state, dname, "batched", mesh, checkpoint)
    engine.family.parallelize(engine.model, mesh)
    engine.model.configure_graph(graph)
    steps: list[dict] = []
    engine.subscribe(lambda ev: steps.append(dict(ev.data)), prefix="trace.step")
    handles = [engine.submit_reasoning(r, record_logits=True) for r in reqs]
    engine.run_until_idle()
    results = [{"tokens": list(h.result()["tokens"]), "logits": h.result()["logits"]} if h.status == "completed"
               else {"error": f"engine request {h.status}: {h.record.error}"} for h in handles]
    return {"results": results, "steps": steps}


def run_c1_plan(report: Report, models: list, plan: ParallelPlan, device: str, dtypes: list[str], seed: int,
                fault: str | None, progress: Callable[[str], None], cases: str = "ci",
                wanted: Callable[[str], bool] = lambda name: True, graph: str = "eager") -> Report:
    import optimized
    from optimized.parallel.launch import run_ranks

    report.settings["plan"] = plan.name()
    contract = load_parity_contract("cosmos3")
    for vname, cfg, state in models:
        for dname in dtypes:
            dtype, dev = DTYPES[dname], device.split(":")[0]
            tol = contract.tolerance("C1", DTYPE_NAMES[dname], dev)
            c0_tol = contract.tolerance("C0", DTYPE_NAMES[dname], dev)
            reference = load_reference(cfg, state, device, dtype)
            todo = [c for c in plan_cases(cfg, plan, cases, seed) if wanted(c.name)]
            ref_runs = [[run_reference_loop(reference, req) for req in case.requests] for case in todo]
            probes = [_probes(cfg, case, runs[0], dtype) for case, runs in zip(todo, ref_runs)]
            progress(f"[cosmos3 C1] {vname} {dname}: plan {plan.name()} on {plan.world_size} gloo ranks, "
                     f"{len(todo)} cases")
            with tempfile.TemporaryDirectory(prefix="fvparity-cosmos3-tp-") as tmp:
                # under tp the ranks read their slices of a canonical checkpoint, never the whole state
                ckpt = str(write_canonical_transformer(cfg, state, Path(tmp) / "transformer")) if plan.tp > 1 \
                    else None
                ar_reqs = case_lib.ar_requests(cfg, cases, seed) if wanted("ar") else []
                outs = run_ranks(_rank_worker, plan.world_size, (plan.name(), cfg, None if ckpt else state, dname,
                                                                 todo, fault, probes, ckpt, graph, ar_reqs),
                                 timeout_s=RANK_TIMEOUT_S)
            ranks = [cases_out for cases_out, _ in outs]
            if ar_reqs:
                report.checks += _reasoning_checks(f"{vname}/{dname}/{plan.name()}/ar", reference, dtype, c0_tol,
                                                   ar_reqs, [reasoning for _, reasoning in outs], graph)
            for c, case in enumerate(todo):
                engine = optimized.Engine.from_state_dict(cfg, state, device, dtype, cfg_policy=case.cfg_policy,
                                                          batching="greedy")
                one = run_engine_case(engine, case)
                prefix = f"{vname}/{dname}/{plan.name()}/{case.name}"
                idle = [f"rank {r} axis {a}" for r, rank in enumerate(ranks) for a, n in rank[c][2].items() if not n]
                report.checks.append(CheckResult(
                    f"{prefix}/axes_exchanged", not idle, detail="every axis of the plan moved data on every rank: "
                    + ", ".join(f"{a} {n} B" for a, n in ranks[0][c][2].items()) if not idle else
                    f"no exchange (the plan ran replicated): {', '.join(idle)}"))
                report.checks += _forward_checks(prefix, reference, probes[c], [rank[c][1] for rank in ranks], c0_tol)
                if requests_overlap(case):  # on every rank, no batched step raised (its solo reruns hide it otherwise)
                    report.checks += [no_batch_failed_check(f"{prefix}/rank{r}", rank[c][0][0].extra["batch_failures"])
                                      for r, rank in enumerate(ranks)]
                for k, req in enumerate(case.requests):
                    sub = f"/req{k}" if len(case.requests) > 1 else ""
                    for r, rank in enumerate(ranks):
                        eng_run, traces = rank[c][0][k], rank[c][1]
                        report.checks += compare_runs(
                            f"{prefix}/rank{r}{sub}", ref_runs[c][k], eng_run, tol,
                            lambda step, k=k, traces=traces, r=r: _localise(reference, probes[c], traces, step,
                                                                           c0_tol, r) if k == 0 else
                            f"step {step} (rank {r}; layers are traced for the case's first request only)")
                        report.checks += _vs_one_process(f"{prefix}/rank{r}{sub}", eng_run, one[k], tol, plan)
                        report.checks += _batched_check(f"{prefix}/rank{r}{sub}", case, eng_run)
                        if graph != "eager":  # every step of this rank ran the asked graph, with the plan in its key
                            report.checks.append(graph_kinds_check(f"{prefix}/rank{r}{sub}/graph_{graph}", graph,
                                                                   eng_run.extra.get("graphs", []),
                                                                   rank[c][0][0].extra.get("dynamo")))
                    finals = [rank[c][0][k].trajectory[-1] if rank[c][0][k].trajectory else None for rank in ranks]
                    agree = all(f is not None and f.keys() == finals[0].keys() and
                                all(torch.equal(f[m], finals[0][m]) for m in f) for f in finals)
                    report.checks.append(CheckResult(
                        f"{prefix}{sub}/ranks_agree", agree,
                        detail=f"final latents bitwise equal on all {len(ranks)} ranks" if agree else
                        "the ranks hold different final latents"))
    return report


def _reasoning_checks(prefix: str, reference, dtype, c0_tol, reqs: list, per_rank: list[dict],
                      graph: str) -> list[CheckResult]:
    """Every rank's reasoning vs the reference, by the one-process AR rule (parity/families/cosmos3/ar.py: logits
    within the measured noise, the sampler on the engine's logits, tokens identical or a near tie), and every
    decode step of every rank ran `graph`."""
    from parity.families.cosmos3.ar import ReferenceOracle, ar_tolerance, compare_reasoning, decode_graph_check

    tol, noise = ar_tolerance(c0_tol, dtype)
    oracle = ReferenceOracle(reference)
    wants = [oracle.free_run(r) for r in reqs]
    checks: list[CheckResult] = []
    for r, rank in enumerate(per_rank):
        for i, (req, got) in enumerate(zip(reqs, rank["results"])):
            name = f"{prefix}/rank{r}/req{i}"
            if "error" in got:  # a failed engine request is a failed check, not a crash of the run
                checks.append(CheckResult(f"{name}:tokens", False, detail=got["error"]))
                continue
            checks += compare_reasoning(name, got, req, oracle, wants[i], tol, noise)
        checks.append(decode_graph_check(f"{prefix}/rank{r}/graph_{graph}", graph, rank["steps"]))
    return checks


def _vs_one_process(name: str, eng_run, one_run, tol, plan: ParallelPlan) -> list[CheckResult]:
    """The engine's final latents under the plan vs the engine in one process, per modality."""
    if not eng_run.trajectory or not one_run.trajectory:
        return [CheckResult(f"{name}/vs_one_process", False, detail="a run produced no step")]
    got, want = eng_run.trajectory[-1], one_run.trajectory[-1]
    out = []
    for m in want:
        if m not in got:
            out.append(CheckResult(f"{name}/vs_one_process:{m}", False, detail=f"no {m} latents under the plan"))
            continue
        mt = compare(got[m], want[m])
        out.append(CheckResult(f"{name}/vs_one_process:{m}", within(mt, tol), mt, tol,
                               detail=f"engine final {m} latents, plan {plan.name()} vs one process"))
    return out


def _localise(reference, probes: list[list[Probe]], traces: list, step: int, tol, rank: int) -> str:
    """The first layer of this rank's (parallel) model that leaves tolerance on the reference's own inputs of
    `step`, cond branch first."""
    if step >= len(traces):
        return f"step {step} (rank {rank})"
    for (branch, inp), (_, got) in zip(probes[step], traces[step]):
        want = TraceRecorder()
        with torch.no_grad():
            reference(inp, trace=want)
        div = first_divergence(got, want.records, tol)
        if div is not None:
            return f"step {step}, {branch} branch, layer {div.name} (rank {rank}, rel_l2 {div.metrics.rel_l2:.2e})"
    return (f"step {step}, no layer (rank {rank}): the model agrees on the reference's inputs of both branches "
            f"(after the transformer: CFG combine / solver)")


def _forward_checks(prefix: str, reference, probes: list[list[Probe]], rank_traces: list[list], tol,
                    ) -> list[CheckResult]:
    """C0 under the plan: every rank's parallel transformer output (its traced `pred.*` records) on the reference's
    own cond-branch inputs of every step vs the reference transformer on those inputs, per output, at the C0
    tolerance; a failing row names the first divergent layer (`_localise`)."""
    from manifests.cosmos3.io import Cosmos3Prediction
    from parity.families.cosmos3.cases import zero_by_construction
    from parity.families.cosmos3.common import compare_predictions, run_reference

    out = []
    for step, step_probes in enumerate(probes):
        _, inp = step_probes[0]                                        # the cond branch: one reference forward
        want = run_reference(reference, inp)
        for r, traces in enumerate(rank_traces):
            got = traces[step][0][1] if step < len(traces) else {}
            if "pred.vision" not in got:
                out.append(CheckResult(f"{prefix}/rank{r}/forward_step{step}", False,
                                       detail="no traced prediction from this rank"))
                continue
            pred = Cosmos3Prediction(vision=got["pred.vision"], sound=got.get("pred.sound"),
                                     action=got.get("pred.action"))
            out += compare_predictions(f"{prefix}/rank{r}/forward_step{step}", pred, want, tol,
                                       lambda r=r, traces=traces, step=step: _localise(reference, probes, traces,
                                                                                        step, tol, r),
                                       zero=zero_by_construction(inp))
    return out
