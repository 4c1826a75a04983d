"""cosmos3 C1: whole denoising loops, reference `generate` vs the engine, compared after every step.

Cases (parity/families/cosmos3/cases.py): the anchor loops (one request; three concurrent requests at different
start times; both CFG policies; i2v; sound; each action mode; the shipped Karras schedule) and the loops generated
by rule with a fixed seed (guidance 1 / < 1 / > 1, an unguided request at every batch position, one-row actions,
images, conditioned frames, one-token prompt edits, native / Karras schedules, the same shapes at another fps on a
warm engine), `--cases ci` (every rule once) or `full`. Each request is compared with its own solo reference run:
the timesteps fed to the model and the initial noise exactly, then the latents after every step. The first
divergent step is localised to a layer by replaying the REAL batched call of that step (the batch mates the
scheduler ran it with, from the trace.step events, through the same CFG policy) against the reference's forward.
Upstream anchors: the seeded `cosmos3.generate` goldens in UPSTREAM_ANCHORS run in C1 too, so logic both sides
share (manifests) is held to diffusers.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from manifests import ManifestError
from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs
from manifests.cosmos3.sampling import ActionSpec, Cosmos3GenerateRequest, UniPCConfig
from manifests.parity import Tolerance, load_parity_contract
from parity.errors import SetupError, UpstreamConversionFailed
from parity.families.cosmos3 import faults as fault_lib
from parity.families.cosmos3.ar import ar_checks
from parity.families.cosmos3 import cases as case_lib
from parity.families.cosmos3.cases import STEPS, LoopCase
from parity.families.cosmos3.common import DEFAULT_VARIANTS, load_reference, replay_batched_forward, resolve_models
from parity.engine_events import batch_failures, no_batch_failed_check
from parity.family import DTYPE_NAMES, DTYPES
from parity.localise import TraceRecorder, first_divergence
from parity.metrics import compare, within
from parity.graph_checks import (InterleaveCases, capture_interleave_checks, dynamo_counts, graph_kinds_check,
                                  recording_calls)
from parity.report import CheckResult, Report, exceptions_fail

import optimized
import reference.cosmos3 as ref

_request, _condition = case_lib.request, case_lib.condition

# seeded upstream goldens run inside C1 (cheap: tiny, 3 steps): they hold shared manifest logic (uses_cfg, the
# seeded draw order) to diffusers, which no reference-vs-optimized comparison can
UPSTREAM_ANCHORS = {"ci": ("gen_sound_seeded_g05",), "full": ("gen_sound_seeded_g05", "gen_policy_chunk1")}
GOLDEN_DIR = Path(__file__).resolve().parents[3] / "golden" / "cosmos3"


def loop_cases(cfg: Cosmos3Config, matrix: str = "ci", seed: int = 0) -> list[LoopCase]:
    return case_lib.c1_cases(cfg, matrix, seed)


@dataclass
class SideRun:
    trajectory: list[dict[str, torch.Tensor]]
    initial: dict[str, torch.Tensor]
    timesteps: list[int]
    extra: dict = field(default_factory=dict)


def run_reference_loop(model, req: Cosmos3GenerateRequest) -> SideRun:
    cfg = model.cfg
    vision, _, sound, action, _ = ref.sampler.initial_latents(cfg, req)
    initial = {"vision": vision, **({"sound": sound} if sound is not None else {}),
               **({"action": action} if action is not None else {})}
    res = ref.generate(model, req, keep_trajectory=True)
    return SideRun(res.trajectory, initial, res.timesteps)


def requests_overlap(case: LoopCase) -> bool:
    """More than one request, all submitted before the first finishes: some step can run them batched."""
    return len(case.requests) > 1 and max(case.start_ticks) < STEPS


def run_engine_case(engine, case: LoopCase) -> list[SideRun]:
    """Each request's run; a failed request keeps the steps it completed and its error (a failed check, not a
    crash of the harness); every run's extra["batch_failures"]: the case's batched steps that raised
    (engine_events.py)."""
    handles = []
    with batch_failures(engine) as failed:
        for req, start in zip(case.requests, case.start_ticks):
            while engine.scheduler.tick_count < start and not engine.scheduler.idle:
                engine.step()
            handles.append(engine.submit(req, record_trajectory=True))
        engine.run_until_idle()
    runs = []
    # the batch each step ran in: (request id, its step index) of every batch mate, in the scheduler's order
    step_of = {(h.request_id, e.tick): e.data.get("step") for h in handles for e in h.events
               if e.kind == "trace.step"}
    for h in handles:
        calls = {e.data.get("step"): [(rid, step_of.get((rid, e.tick))) for rid in e.data["batch"]]
                 for e in h.events if e.kind == "trace.step" and e.data.get("loop") == "cosmos3.denoise"}
        batches = [len(e.data["batch"]) for e in h.events if e.kind == "trace.step"]
        graphs = [(e.data.get("graph"), e.data.get("bucket"), e.data.get("graph_cache"))
                  for e in h.events if e.kind == "trace.step" and e.data.get("loop") == "cosmos3.denoise"]
        if h.status == "completed":
            r = h.result()
            runs.append(SideRun(r["trajectory"], r["initial"], r["timesteps"],
                                {"batch_sizes": batches, "graphs": graphs, "rid": h.request_id, "calls": calls,
                                 "batch_failures": failed}))
        else:
            st = h.record.state
            runs.append(SideRun(st.trajectory, st.initial, st.timesteps,
                                {"batch_sizes": batches, "graphs": graphs, "rid": h.request_id, "calls": calls,
                                 "batch_failures": failed, "error": f"engine request {h.status}: {h.record.error}"}))
    return runs


def forward_inputs(cfg: Cosmos3Config, req: Cosmos3GenerateRequest, latents: dict, timestep: int,
                   dtype: torch.dtype, text_ids: torch.Tensor) -> Cosmos3ForwardInputs:
    """One branch's forward of one loop step (for localisation only)."""
    a = req.action
    return Cosmos3ForwardInputs(
        text_ids=text_ids, vision_latents=latents["vision"].to(dtype), timestep=timestep, fps_vision=req.fps,
        vision_condition_frames=req.vision_condition_frames,
        sound_latents=latents["sound"].to(dtype) if "sound" in latents else None,
        fps_sound=float(cfg.sound_latent_fps) if "sound" in latents else None,
        action_latents=latents["action"].to(dtype) if "action" in latents else None,
        action_condition_rows=tuple(range(a.chunk_size)) if a is not None and a.mode == "forward_dynamics" else (),
        action_domain_id=a.domain_id if a is not None else None)


def _latents_before(run: SideRun, step: int) -> dict:
    return run.initial if step == 0 else run.trajectory[step - 1]


def localise_step(reference, engine, req, ref_run: SideRun, eng_run: SideRun, step: int, tol, dtype,
                  peers: dict[str, tuple[Cosmos3GenerateRequest, SideRun]] | None = None,
                  cfg_policy: str = "batched") -> str:
    """Replay the engine's REAL batched call of `step` (every batch mate at its own step, from the trace.step
    events, cond inputs then the guided mates' uncond inputs, through the case's CFG policy) and compare this
    request's sample, layer by layer, with the reference's forward of the same step from its own inputs."""
    cfg = reference.cfg
    if ref_run.timesteps[step] != eng_run.timesteps[step]:
        where = f"timestep fed to the model: {eng_run.timesteps[step]} vs reference {ref_run.timesteps[step]}; "
    else:
        where = ""
    differs = [m for m, x in ref_run.initial.items() if m not in (eng_run.initial or {}) or
               eng_run.initial[m].shape != x.shape or not torch.equal(eng_run.initial[m], x)]
    if step == 0 and differs:  # the loops part before any forward: the draw or the conditioning mix
        where += f"initial latents differ ({', '.join(differs)}: seeded draw / conditioning mix); "
    peers, me_rid = peers or {}, eng_run.extra.get("rid")
    batch = []   # (request, SideRun, step) per batch mate, in the engine's order
    for rid, k in eng_run.extra.get("calls", {}).get(step) or [(me_rid, step)]:
        if rid == me_rid:
            batch.append((req, eng_run, step))
        elif rid in peers and k is not None and k < len(peers[rid][1].timesteps) and k <= len(peers[rid][1].trajectory):
            batch.append((*peers[rid], k))
        else:  # a mate whose inputs this case did not keep: replay this request alone
            batch = [(req, eng_run, step)]
            break
    me = next(i for i, (q, r, k) in enumerate(batch) if r is eng_run)
    label = "alone" if len(batch) == 1 else "batched call [" + ", ".join(
        f"{'this request' if i == me else f'mate {i}'}@step{k}{'' if q.uses_cfg else ' (unguided)'}"
        for i, (q, r, k) in enumerate(batch)) + f"] ({cfg_policy} CFG)"
    branches = [("cond", "text_ids")] + ([("uncond", "negative_text_ids")] if req.uses_cfg else [])
    for branch, ids in branches:
        inputs = {("cond", i): forward_inputs(cfg, q, _latents_before(r, k), r.timesteps[k], dtype, q.text_ids)
                  for i, (q, r, k) in enumerate(batch)}
        inputs.update({("uncond", i): forward_inputs(cfg, q, _latents_before(r, k), r.timesteps[k], dtype,
                                                     q.negative_text_ids)
                       for i, (q, r, k) in enumerate(batch) if q.uses_cfg})
        cond = [v for (b, _), v in inputs.items() if b == "cond"]
        uncond = [v for (b, _), v in inputs.items() if b == "uncond"]
        ot = replay_batched_forward(engine.model, cfg_policy, cond, uncond, inputs[(branch, me)])
        rt = TraceRecorder()
        with torch.no_grad():
            reference(forward_inputs(cfg, req, _latents_before(ref_run, step), ref_run.timesteps[step], dtype,
                                     getattr(req, ids)), trace=rt)
        div = first_divergence(ot, rt.records, tol)
        if div is not None:
            return f"step {step}, {where}{branch} branch, layer {div.name} (replayed {label})"
    return f"step {step}, {where}no layer: after the transformer (CFG combine / solver; replayed {label})"


def compare_runs(prefix: str, ref_run: SideRun, eng_run: SideRun, tol: Tolerance,
                 localise: Callable[[int], str]) -> list[CheckResult]:
    checks = []
    same_ts = list(eng_run.timesteps) == list(ref_run.timesteps)
    checks.append(CheckResult(f"{prefix}/timesteps", same_ts, detail=f"{len(ref_run.timesteps)} timesteps fed to "
                              f"the model identical" if same_ts else f"engine {list(eng_run.timesteps)} vs "
                              f"reference {list(ref_run.timesteps)}"))
    for m, want in ref_run.initial.items():  # the initial noise (seeded draw, conditioning mix) bit for bit
        got = (eng_run.initial or {}).get(m)
        ok = got is not None and got.shape == want.shape and torch.equal(got, want)
        if ok:
            detail = "identical"
        elif got is None or got.shape != want.shape:
            detail = f"engine {None if got is None else list(got.shape)} vs reference {list(want.shape)}"
        else:
            rows = (got != want).reshape(got.shape[0] if got.ndim == 2 else got.shape[2], -1) if got.ndim == 2 \
                else (got != want).transpose(0, 2).reshape(got.shape[2], -1)
            bad = rows.any(dim=1).nonzero().flatten().tolist()
            detail = f"differs in {'rows' if got.ndim == 2 else 'latent frames'} {bad}"
        checks.append(CheckResult(f"{prefix}/initial:{m}", ok, detail=detail))
    if len(eng_run.trajectory) != len(ref_run.trajectory) or "error" in eng_run.extra:
        checks.append(CheckResult(f"{prefix}/completed", False,
                                  detail=f"{len(eng_run.trajectory)} engine steps vs {len(ref_run.trajectory)} "
                                         f"reference steps; {eng_run.extra.get('error', '')}"))
    first_bad = None
    for step, (got, want) in enumerate(zip(eng_run.trajectory, ref_run.trajectory)):
        per_mod = {m: compare(got[m], want[m]) if m in got else None for m in want}
        missing = [m for m, v in per_mod.items() if v is None]
        worst_mod = max((m for m in per_mod if per_mod[m] is not None), key=lambda m: per_mod[m].rel_l2)
        worst = per_mod[worst_mod]
        ok = not missing and all(within(v, tol) for v in per_mod.values())
        detail = ", ".join(f"{m} {v.rel_l2:.1e}" for m, v in per_mod.items() if v is not None)
        c = CheckResult(f"{prefix}/step{step}", ok, worst, tol, detail=detail)
        c.extra = {m: v.to_dict() for m, v in per_mod.items() if v is not None}
        if not ok and first_bad is None:
            first_bad = step
            c.divergence = localise(step)
        checks.append(c)
    return checks


def run_c1(variants, checkpoint, device, dtypes, seed, fault, progress, graph: str = "eager", cases: str = "ci",
           only: tuple[str, ...] | None = None) -> Report:
    """C1 in one process (under a parallel plan: parallel.run_c1, the family's C1 entry, which calls this without).
    `cases`: the case matrix ("ci": every rule once, "full"); `only`: run just the loop cases (and upstream
    anchors) whose names start with one of these, and skip the AR checks unless "ar" is among them (negative
    controls and the mutation runner use it to stay small)."""
    if fault is not None and fault not in fault_lib.COSMOS3_C1_FAULTS:
        raise SetupError(f"unknown C1 fault {fault!r}; known: {', '.join(fault_lib.COSMOS3_C1_FAULTS)}")
    if cases not in case_lib.MATRICES:
        raise SetupError(f"unknown case matrix {cases!r}; known: {', '.join(case_lib.MATRICES)}")
    wanted = lambda name: only is None or any(name.startswith(o) for o in only)
    contract = load_parity_contract("cosmos3")
    report = Report("cosmos3", "C1", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                      "dtypes": dtypes, "seed": seed, "checkpoint": checkpoint, "fault": fault,
                                      "steps": STEPS, "graph": graph, "cases": cases})
    for vname, cfg, state in resolve_models(variants, checkpoint, seed):
        for dname in dtypes:
            dtype = DTYPES[dname]
            tol = contract.tolerance("C1", DTYPE_NAMES[dname], device.split(":")[0])
            c0_tol = contract.tolerance("C0", DTYPE_NAMES[dname], device.split(":")[0])
            reference = load_reference(cfg, state, device, dtype)
            interleave = InterleaveCases()
            for case in [c for c in loop_cases(cfg, cases, seed) if wanted(c.name)]:
                progress(f"[cosmos3 C1] {vname} {dname}: {case.name} ({len(case.requests)} request(s), "
                         f"{case.cfg_policy} CFG)")
                with exceptions_fail(report.checks, f"{vname}/{dname}/{case.name}"):  # fails this case, not the run
                    engine = optimized.Engine.from_state_dict(cfg, state, device, dtype, cfg_policy=case.cfg_policy,
                                                              batching="greedy")
                    engine.model.configure_graph(graph, cfg_policy=case.cfg_policy, variant=vname)
                    with fault_lib.planted_c1(fault, engine):
                        # the gen-step calls of the first case and of the first with two callers, replayed interleaved
                        with recording_calls([engine.model], enabled=interleave.wants(len(case.requests))) as calls:
                            eng_runs = run_engine_case(engine, case)
                        report.checks += capture_interleave_checks(f"{vname}/{dname}/{case.name}", calls)
                        if requests_overlap(case):  # a batch that raised is rerun solo: right latents, still a bug
                            report.checks.append(no_batch_failed_check(f"{vname}/{dname}/{case.name}",
                                                                       eng_runs[0].extra["batch_failures"]))
                        peers = {e.extra["rid"]: (q, e) for q, e in zip(case.requests, eng_runs)}
                        for k, (req, eng_run) in enumerate(zip(case.requests, eng_runs)):
                            ref_run = run_reference_loop(reference, req)
                            prefix = f"{vname}/{dname}/{case.name}" + (f"/req{k}" if len(case.requests) > 1 else "")
                            checks = compare_runs(prefix, ref_run, eng_run, tol, lambda step, req=req, r=ref_run,
                                                  e=eng_run, c=case: localise_step(reference, engine, req, r, e, step,
                                                                                   c0_tol, dtype, peers, c.cfg_policy))
                            if graph != "eager":  # the step body really ran the asked graph, bucket by bucket
                                checks.append(graph_kinds_check(f"{prefix}/graph_{graph}", graph,
                                                                eng_run.extra.get("graphs", []),
                                                                dynamo_counts() if graph == "compile" else None))
                            if len(case.requests) > 1 and (case.name == "concurrent3" or "batch_position" in case.rules):
                                batched = max(eng_run.extra["batch_sizes"], default=0) > 1   # a failed run: no step
                                checks.append(CheckResult(f"{prefix}/batched_with_others", batched,
                                                          detail=f"batch sizes per step {eng_run.extra['batch_sizes']}"))
                            report.checks += checks
            if wanted("ar"):
                with exceptions_fail(report.checks, f"{vname}/{dname}/ar"), fault_lib.planted_c1(fault, None):
                    report.checks += ar_checks(f"{vname}/{dname}", cfg, state, reference, dtype, device, c0_tol,
                                               tol, progress, case_lib.ar_requests(cfg, cases, seed), graph=graph,
                                               plant=fault_lib.ar_engine_planter(fault))
    if checkpoint is None:  # the anchors are tiny upstream models of their own, whatever the variants
        with fault_lib.planted_c1(fault, None):
            report.checks += upstream_anchor_checks([a for a in UPSTREAM_ANCHORS[cases] if wanted(a)], progress)
    return report


def upstream_anchor_checks(names, progress) -> list[CheckResult]:
    """The seeded `cosmos3.generate` goldens named in UPSTREAM_ANCHORS, both sides, as C1 checks `upstream/...`."""
    from parity.golden import load_case, run_probe

    checks = []
    for name in names:
        progress(f"[cosmos3 C1] upstream anchor {name} (diffusers Cosmos3OmniPipeline, seeded)")
        path = GOLDEN_DIR / name
        if not (path / "case.json").is_file():
            checks.append(CheckResult(f"upstream/{name}", False, detail=f"golden case {path} missing"))
            continue
        results = run_probe(golden_generate_probe, load_case(path), ("reference", "optimized"))
        for c in results:
            c.name = f"upstream/{c.name}"
            if not c.passed and not c.divergence:  # both sides may agree with each other: upstream tells
                c.divergence = f"upstream anchor {name}: {c.detail or 'differs from diffusers'}"
        checks += results
    return checks


# ------------------------------------------------------------------------------------------------
# Upstream golden probe `cosmos3.generate` (diffusers Cosmos3OmniPipeline, output_type="latent")
# ------------------------------------------------------------------------------------------------

def golden_request(case) -> Cosmos3GenerateRequest:
    t, p = case.inputs, case.meta.get("params", {})
    try:
        a = p.get("action")
        action = None if a is None else ActionSpec(a["mode"], int(a["chunk_size"]), int(a["domain_id"]),
                                                   a.get("raw_action_dim"), t.get("raw_actions"))
        return Cosmos3GenerateRequest(
            text_ids=t["input_ids"], negative_text_ids=t["negative_input_ids"],
            latent_frames=int(p["latent_frames"]), latent_height=int(p["latent_height"]),
            latent_width=int(p["latent_width"]), num_steps=int(p["num_inference_steps"]),
            guidance_scale=float(p["guidance_scale"]), fps=float(p["fps"]),
            seed=None if p.get("noise_seed") is None else int(p["noise_seed"]),  # seeded: the pipeline's own draw
            scheduler=UniPCConfig(**p["scheduler"]),
            vision_condition_frames=tuple(int(f) for f in p.get("vision_condition_frames", [])),
            condition_latents=t.get("condition_latents"), sound_frames=int(p.get("sound_frames", 0)),
            action=action, noise_vision=t.get("noise_vision"), noise_sound=t.get("noise_sound"),
            noise_action=t.get("noise_action"))
    except (KeyError, TypeError) as e:
        raise SetupError(f"golden case {case.path}: incomplete cosmos3.generate inputs/params ({e})") from None


def golden_schedule_checks(name: str, side: str, req: Cosmos3GenerateRequest, out: dict) -> list[CheckResult]:
    """The side's own UniPC schedule against the stored `pipe.scheduler` tables: `timesteps` (int64, exact) and
    `sigmas` (fp32 [N + 1], exact), each where the case stores it (the model-fed timesteps are checked apart)."""
    if side == "reference":
        from reference.solvers.unipc import UniPCFlow
        sched = UniPCFlow(req.scheduler, req.num_steps)
        sigmas, timesteps = sched.sigmas, sched.timesteps
    else:
        from optimized.solvers.unipc import sigma_schedule
        sigmas, timesteps = sigma_schedule(req.scheduler, req.num_steps)
    checks = []
    for key, got in (("timesteps", timesteps), ("sigmas", sigmas)):
        if key in out:
            want = out[key]
            ok = got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
            checks.append(CheckResult(f"{name}:scheduler_{key}", ok, detail=f"{want.numel()} values identical" if ok
                                      else f"{got.tolist()} ({got.dtype}) vs upstream {want.tolist()} ({want.dtype})"))
    return checks


def golden_generate_probe(case, sides) -> list[CheckResult]:
    from converters import ConversionError, convert_diffusers_dir_to_canonical_state_dict

    try:
        cfg, state = convert_diffusers_dir_to_canonical_state_dict(case.path / "upstream")
        req = golden_request(case).validate(cfg)
    except ConversionError as e:
        raise UpstreamConversionFailed(f"golden case {case.path}: {e}") from None
    except ManifestError as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    tol, out = case.tolerance, case.outputs
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case.meta.get("dtype", "float32")]
    results: list[CheckResult] = []
    for side in sides:
        name = f"{case.name}/{side}"
        if side == "reference":
            model = load_reference(cfg, state, "cpu", dtype)
            res = ref.generate(model, req, keep_trajectory=True)
            final = {"vision": res.vision, "sound": res.sound, "action": res.action}
            trajectory, timesteps = res.trajectory, res.timesteps
            v0, _, s0, a0, _ = ref.sampler.initial_latents(cfg, req)
            initial = {"vision": v0, "sound": s0, "action": a0}
        else:
            engine = optimized.Engine.from_state_dict(cfg, state, "cpu", dtype, batching="greedy")
            r = engine.generate(req, record_trajectory=True)
            final, trajectory, timesteps, initial = r["latents"], r["trajectory"], r["timesteps"], r["initial"]
        for m in ("vision", "sound", "action"):  # seeded cases: the pipeline's own draw, bit for bit
            if f"initial_{m}" in out:
                got = initial.get(m)
                ok = got is not None and got.shape == out[f"initial_{m}"].shape and torch.equal(
                    got.float(), out[f"initial_{m}"])
                results.append(CheckResult(f"{name}:initial_{m}", ok, detail="seeded draw identical to upstream's"
                                           if ok else f"initial {m} latents differ from upstream's seeded draw"))
        want_ts = out["model_timesteps"] if "model_timesteps" in out else out.get("timesteps")
        ok = want_ts is not None and list(timesteps) == want_ts.tolist()
        results.append(CheckResult(f"{name}:model_timesteps", ok,
                                   detail="" if ok else f"{timesteps} vs upstream "
                                                        f"{None if want_ts is None else want_ts.tolist()}"))
        results += golden_schedule_checks(name, side, req, out)
        for m in ("vision", "sound", "action"):
            if f"latents_{m}" not in out:
                continue
            got = final.get(m)
            if got is None:
                results.append(CheckResult(f"{name}:{m}", False, detail=f"no {m} latents produced"))
                continue
            mt = compare(got, out[f"latents_{m}"])
            results.append(CheckResult(f"{name}:{m}", within(mt, tol), mt, tol))
            if f"trajectory_{m}" in out:  # every step, so a failure says where the loops part
                steps = [compare(s[m], out[f"trajectory_{m}"][k]) for k, s in enumerate(trajectory)]
                bad = [k for k, s in enumerate(steps) if not within(s, tol)]
                worst = max(steps, key=lambda s: s.rel_l2)
                results.append(CheckResult(f"{name}:{m}_trajectory", not bad and len(steps) ==
                                           len(out[f"trajectory_{m}"]), worst, tol,
                                           detail=f"first divergent step {bad[0]}" if bad else f"{len(steps)} steps"))
    return results


# ------------------------------------------------------------------------------------------------
# Upstream golden probe `cosmos3.sampling` (transformers' generate sampling filters, do_sample=True)
# ------------------------------------------------------------------------------------------------

@contextmanager
def recorded_multinomial(seen: list[torch.Tensor]):
    """`torch.multinomial` replaced by a recorder of the distribution it is handed (returns index 0, draws
    nothing): what a side's `choose_token` would sample from, after its own filters."""
    real = torch.multinomial

    def record(probs, num_samples, *args, **kwargs):
        seen.append(probs.detach().float().clone())
        return torch.zeros(num_samples, dtype=torch.long)

    torch.multinomial = record
    try:
        yield
    finally:
        torch.multinomial = real


def golden_sampling_probe(case, sides) -> list[CheckResult]:
    """Each setting's logits row through each side's `choose_token`: the distribution it samples from must keep
    exactly upstream's tokens (the support, exact) with upstream's probabilities (rel_l2)."""
    from manifests.cosmos3.reasoning import ReasonRequest
    from optimized.models.cosmos3.reasoner import choose_token as optimized_choose
    from reference.cosmos3.reasoner import choose_token as reference_choose

    try:
        logits, want_all = case.inputs["logits"], case.outputs["probs"]
        settings = case.meta["params"]["settings"]
    except KeyError as e:
        raise SetupError(f"golden case {case.path}: incomplete cosmos3.sampling case ({e})") from None
    tol, results = case.tolerance, []
    for side in sides:
        choose = reference_choose if side == "reference" else optimized_choose
        for i, s in enumerate(settings):
            req = ReasonRequest(torch.zeros(1, dtype=torch.long), 1, temperature=float(s["temperature"]),
                                top_k=int(s["top_k"]), top_p=float(s["top_p"]))
            seen: list[torch.Tensor] = []
            with recorded_multinomial(seen):
                choose(logits[int(s["row"])].clone(), req, torch.Generator().manual_seed(0))
            want = want_all[i]
            name = f"{case.name}/{side}:setting{i}"
            if len(seen) != 1:
                results.append(CheckResult(name, False, detail=f"{len(seen)} multinomial draws, expected 1"))
                continue
            got = seen[0]
            kept, want_kept = (got > 0).nonzero().flatten().tolist(), (want > 0).nonzero().flatten().tolist()
            m = compare(got, want)
            label = f"T {s['temperature']}, top_k {s['top_k']}, top_p {s['top_p']}"
            results.append(CheckResult(name, kept == want_kept and within(m, tol), m, tol,
                                       detail=f"{label}: keeps {len(kept)} tokens" if kept == want_kept else
                                       f"{label}: keeps tokens {kept}, upstream {want_kept}"))
    return results


PROBES = {"cosmos3.generate": golden_generate_probe, "cosmos3.sampling": golden_sampling_probe}
