"""cosmos3 C1: whole denoising loops, reference `generate` vs the engine, compared after every step.

Cases: one request; three concurrent requests (different seeds, guidance scales, start times) batched by the
scheduler, each against its own solo reference run; both CFG policies; image-to-video; sound; each action mode;
the shipped Karras schedule; a prompt change on a warm und cache. The first divergent step is localised to a
layer by re-running that step's forward on both sides with their own inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from manifests import ManifestError
from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs
from manifests.cosmos3.sampling import ActionSpec, Cosmos3GenerateRequest, UniPCConfig
from manifests.parity import Tolerance, load_parity_contract
from parity.errors import SetupError
from parity.families.cosmos3 import faults as fault_lib
from parity.families.cosmos3.ar import ar_checks
from parity.families.cosmos3.common import DEFAULT_VARIANTS, load_reference, resolve_models
from parity.family import DTYPE_NAMES, DTYPES
from parity.localise import TraceRecorder, first_divergence
from parity.metrics import compare, within
from parity.report import CheckResult, Report

import optimized
import reference.cosmos3 as ref

STEPS = 4


@dataclass(frozen=True)
class LoopCase:
    name: str
    requests: tuple[Cosmos3GenerateRequest, ...]
    start_ticks: tuple[int, ...] = (0,)      # scheduler ticks before each request is submitted
    cfg_policy: str = "batched"


def _request(cfg: Cosmos3Config, seed: int, guidance: float = 5.0, text_len: int = 7, **kw) -> Cosmos3GenerateRequest:
    g = torch.Generator().manual_seed(1000 + seed)
    base = dict(text_ids=torch.randint(0, cfg.vocab_size, (text_len,), generator=g),
                negative_text_ids=torch.randint(0, cfg.vocab_size, (3,), generator=g),
                latent_frames=3, latent_height=4, latent_width=6, num_steps=STEPS, guidance_scale=guidance,
                seed=seed, scheduler=UniPCConfig(flow_shift=10.0))
    base.update(kw)
    return Cosmos3GenerateRequest(**base)


def _condition(cfg: Cosmos3Config, seed: int, frames: int = 3) -> torch.Tensor:
    return torch.randn(1, cfg.latent_channels, frames, 4, 6, generator=torch.Generator().manual_seed(2000 + seed))


def loop_cases(cfg: Cosmos3Config) -> list[LoopCase]:
    cases = [
        LoopCase("t2v", (_request(cfg, 1),)),
        # req0 and req2 share a shape (so a shared solver state would mix them); req1 differs in every way
        LoopCase("concurrent3", (_request(cfg, 2, 3.0), _request(cfg, 3, 7.5, text_len=5, latent_frames=2),
                                 _request(cfg, 4, 1.0)), start_ticks=(0, 1, 2)),
        LoopCase("two_forward_cfg", (_request(cfg, 5),), cfg_policy="two-forward"),
        LoopCase("i2v", (_request(cfg, 6, vision_condition_frames=(0,), condition_latents=_condition(cfg, 6)),)),
        LoopCase("karras_shipped", (_request(cfg, 7, scheduler=UniPCConfig.shipped()),)),
        LoopCase("prompt_change_warm_cache", (_request(cfg, 8), _request(cfg, 9)), start_ticks=(0, STEPS + 1)),
    ]
    if cfg.has_sound:
        cases.append(LoopCase("sound", (_request(cfg, 10, sound_frames=5),)))
    if cfg.has_action:
        A = cfg.action_dim
        raw = max(1, A - 2)
        dom = cfg.num_embodiment_domains - 1
        cases += [
            LoopCase("policy", (_request(cfg, 11, action=ActionSpec("policy", 3, dom, raw_action_dim=raw),
                                         vision_condition_frames=(0,), condition_latents=_condition(cfg, 11)),)),
            LoopCase("forward_dynamics", (_request(cfg, 12, action=ActionSpec(
                "forward_dynamics", 3, 0, raw_action_dim=raw,
                raw_actions=torch.randn(2, raw, generator=torch.Generator().manual_seed(12))),
                vision_condition_frames=(0,), condition_latents=_condition(cfg, 12)),)),
            LoopCase("inverse_dynamics", (_request(cfg, 13, action=ActionSpec("inverse_dynamics", 3, 1),
                                                   vision_condition_frames=(0, 1, 2),
                                                   condition_latents=_condition(cfg, 13)),)),
        ]
    return cases


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


def run_engine_case(engine, case: LoopCase) -> list[SideRun]:
    """Each request's run; a failed request keeps the steps it completed and its error (a failed check, not a
    crash of the harness)."""
    handles = []
    for req, start in zip(case.requests, case.start_ticks):
        while engine.scheduler.tick_count < start and not engine.scheduler.idle:
            engine.step()
        handles.append(engine.submit(req, record_trajectory=True))
    engine.run_until_idle()
    runs = []
    for h in handles:
        batches = [len(e.data["batch"]) for e in h.events if e.kind == "trace.step"]
        if h.status == "completed":
            r = h.result()
            runs.append(SideRun(r["trajectory"], r["initial"], r["timesteps"], {"batch_sizes": batches}))
        else:
            st = h.record.state
            runs.append(SideRun(st.trajectory, st.initial, st.timesteps,
                                {"batch_sizes": batches, "error": f"engine request {h.status}: {h.record.error}"}))
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


def localise_step(reference, engine, req, ref_run: SideRun, eng_run: SideRun, step: int, tol, dtype) -> str:
    """Each side re-runs the cond forward of `step` from its own inputs (they agreed up to this step)."""
    cfg = reference.cfg
    ref_lat = ref_run.initial if step == 0 else ref_run.trajectory[step - 1]
    eng_lat = eng_run.initial if step == 0 else eng_run.trajectory[step - 1]
    if ref_run.timesteps[step] != eng_run.timesteps[step]:
        where = f"timestep fed to the model: {eng_run.timesteps[step]} vs reference {ref_run.timesteps[step]}; "
    else:
        where = ""
    branches = [("cond", req.text_ids)] + ([("uncond", req.negative_text_ids)] if req.uses_cfg else [])
    for branch, text in branches:
        rt, ot = TraceRecorder(), TraceRecorder(sample=0)
        with torch.no_grad():
            reference(forward_inputs(cfg, req, ref_lat, ref_run.timesteps[step], dtype, text), trace=rt)
            engine.model.forward_batch([forward_inputs(cfg, req, eng_lat, eng_run.timesteps[step], dtype, text)],
                                       trace=ot)
        div = first_divergence(ot.records, rt.records, tol)
        if div is not None:
            return f"step {step}, {where}{branch} branch, layer {div.name}"
    return f"step {step}, {where}no layer: after the transformer (CFG combine / solver)"


def compare_runs(prefix: str, ref_run: SideRun, eng_run: SideRun, tol: Tolerance,
                 localise: Callable[[int], str]) -> list[CheckResult]:
    checks = []
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


def run_c1(variants, checkpoint, device, dtypes, seed, fault, progress) -> Report:
    if fault is not None and fault not in fault_lib.COSMOS3_C1_FAULTS:
        raise SetupError(f"unknown C1 fault {fault!r}; known: {', '.join(fault_lib.COSMOS3_C1_FAULTS)}")
    contract = load_parity_contract("cosmos3")
    report = Report("cosmos3", "C1", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                      "dtypes": dtypes, "seed": seed, "checkpoint": checkpoint, "fault": fault,
                                      "steps": STEPS})
    for vname, cfg, state in resolve_models(variants, checkpoint, seed):
        for dname in dtypes:
            dtype = DTYPES[dname]
            tol = contract.tolerance("C1", DTYPE_NAMES[dname], device.split(":")[0])
            c0_tol = contract.tolerance("C0", DTYPE_NAMES[dname], device.split(":")[0])
            reference = load_reference(cfg, state, device, dtype)
            for case in loop_cases(cfg):
                progress(f"[cosmos3 C1] {vname} {dname}: {case.name} ({len(case.requests)} request(s), "
                         f"{case.cfg_policy} CFG)")
                engine = optimized.Engine.from_state_dict(cfg, state, device, dtype, cfg_policy=case.cfg_policy)
                with fault_lib.planted_c1(fault, engine):
                    eng_runs = run_engine_case(engine, case)
                    for k, (req, eng_run) in enumerate(zip(case.requests, eng_runs)):
                        ref_run = run_reference_loop(reference, req)
                        prefix = f"{vname}/{dname}/{case.name}" + (f"/req{k}" if len(case.requests) > 1 else "")
                        checks = compare_runs(prefix, ref_run, eng_run, tol, lambda step, req=req, r=ref_run,
                                              e=eng_run: localise_step(reference, engine, req, r, e, step,
                                                                       c0_tol, dtype))
                        if len(case.requests) > 1 and case.name == "concurrent3":
                            batched = max(eng_run.extra["batch_sizes"]) > 1
                            checks.append(CheckResult(f"{prefix}/batched_with_others", batched,
                                                      detail=f"batch sizes per step {eng_run.extra['batch_sizes']}"))
                        report.checks += checks
            with fault_lib.planted_c1(fault, None):
                report.checks += ar_checks(f"{vname}/{dname}", cfg, state, reference, dtype, device, c0_tol, tol,
                                           progress)
    return report


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
            guidance_scale=float(p["guidance_scale"]), fps=float(p["fps"]), seed=None,
            scheduler=UniPCConfig(**p["scheduler"]),
            vision_condition_frames=tuple(int(f) for f in p.get("vision_condition_frames", [])),
            condition_latents=t.get("condition_latents"), sound_frames=int(p.get("sound_frames", 0)),
            action=action, noise_vision=t["noise_vision"], noise_sound=t.get("noise_sound"),
            noise_action=t.get("noise_action"))
    except (KeyError, TypeError) as e:
        raise SetupError(f"golden case {case.path}: incomplete cosmos3.generate inputs/params ({e})") from None


def golden_generate_probe(case, sides) -> list[CheckResult]:
    from converters import ConversionError, convert_diffusers_dir_to_canonical_state_dict

    try:
        cfg, state = convert_diffusers_dir_to_canonical_state_dict(case.path / "upstream")
        req = golden_request(case).validate(cfg)
    except (ConversionError, ManifestError) as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    tol, out = case.tolerance, case.outputs
    results: list[CheckResult] = []
    for side in sides:
        name = f"{case.name}/{side}"
        if side == "reference":
            res = ref.generate(load_reference(cfg, state, "cpu", torch.float32), req, keep_trajectory=True)
            final = {"vision": res.vision, "sound": res.sound, "action": res.action}
            trajectory, timesteps = res.trajectory, res.timesteps
        else:
            engine = optimized.Engine.from_state_dict(cfg, state)
            r = engine.generate(req, record_trajectory=True)
            final, trajectory, timesteps = r["latents"], r["trajectory"], r["timesteps"]
        want_ts = out.get("model_timesteps", out.get("timesteps"))
        ok = want_ts is not None and list(timesteps) == want_ts.tolist()
        results.append(CheckResult(f"{name}:model_timesteps", ok,
                                   detail="" if ok else f"{timesteps} vs upstream {want_ts.tolist()}"))
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


PROBES = {"cosmos3.generate": golden_generate_probe}
