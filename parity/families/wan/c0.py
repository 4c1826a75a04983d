"""wan C0: every component of a whole model, reference vs optimized.

Per whole-model variant (or converted checkpoint), per dtype:
    dit/..., dit_2/...    the DiT expert(s): full forward on the anchor and rule-generated cases of the `--cases`
                          matrix (cases.py), batched, each block alone, traces (dit.py)
    umt5/...              the text encoder and WanPipeline's prompt handling (umt5.py)
    image_encoder/...     2.1 I2V: the CLIP image encoder and its processor (clip.py; tiny encoder, random weights)
    scheduler/...         UniPC (flow) and FlowMatch Euler: reference solver vs optimized functional state on the
                          same synthetic velocities (schedules exact, every step's sample)
    vae/...               the model's VAE (vae.py rows; run once per distinct VAE config in a run)
and once per model (fp32, both sides' own pipelines on one request each):
    input/...             what the loop feeds the DiT at step 0: the noise draw, the timestep, the text embeddings,
                          and for i2v / ti2v the image conditioning (mask, VAE latents), reference pipeline vs the
                          optimized loop.
A VAE variant (tiny-2.1, ...) or a converted VAE / DiT / UMT5 directory gets the rows of its component only.
"""

from __future__ import annotations

from typing import Callable

import torch

from manifests.parity import Tolerance
from manifests.solvers import FlowMatchEulerConfig, UniPCConfig
from manifests.wan import WanModelConfig, list_variants, load_variant
from parity.errors import SetupError
from parity.families.wan import cases as case_lib, clip, dit, faults, umt5, vae
from parity.families.wan.common import (DEFAULT_VARIANTS, ModelUnderTest, contract_tolerance, load_optimized_dit,
                                        load_optimized_umt5, load_reference_dit, load_reference_umt5, make_request,
                                        optimized_step_input, reference_pipeline, resolve_models)
from parity.family import DTYPES
from parity.metrics import compare, exact, within
from parity.report import CheckResult, Report, exceptions_fail, tensor_check as check

import optimized.models.wan as opt_wan
from optimized.models.wan.denoise import WanDenoiseLoop
from optimized.models.wan.instance import WanModelInstance
from optimized.solvers import euler, unipc
import reference.wan as ref
from reference.solvers import FlowMatchEuler, UniPCFlow

SCHEDULER_STEPS = 5


def run_c0(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress: Callable[[str], None], cases: str = "ci") -> Report:
    """`cases`: the DiT case matrix ("ci": every rule once, "full": every draw; cases.py)."""
    faults.check_fault(fault, "C0", faults.C0_FAULTS)
    if cases not in case_lib.MATRICES:
        raise SetupError(f"unknown case matrix {cases!r}; known: {', '.join(case_lib.MATRICES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError("--device cuda requested but CUDA is not available")
    report = Report("wan", "C0", {"variants": variants or list(DEFAULT_VARIANTS), "device": device, "dtypes": dtypes,
                                  "seed": seed, "checkpoint": checkpoint, "fault": fault, "cases": cases})
    models = resolve_models(variants, checkpoint, seed)
    vae_done: list = []   # VAE configs already checked in this run (several tiny models share one VAE)
    for m in models:
        for dname in dtypes:
            dtype = DTYPES[dname]
            tol = lambda component: contract_tolerance("C0", component, dname, device)  # noqa: E731
            prefix = f"{m.name}/{dname}"
            if m.kind in ("model", "transformer"):
                report.checks += dit_rows(prefix, m, tol("dit"), dtype, device, seed, fault, dname == "fp32",
                                          progress, cases)
            if m.kind in ("model", "text_encoder"):
                with exceptions_fail(report.checks, f"{prefix}/umt5"):  # an exception fails these rows, not the run
                    report.checks += umt5_rows(prefix, m, tol("umt5"), dtype, device, seed, fault, progress)
            if m.is_model and m.cfg.dit.image_dim is not None:   # 2.1 I2V: the CLIP encoder feeding the image branch
                with exceptions_fail(report.checks, f"{prefix}/image_encoder"):
                    report.checks += clip.clip_rows(prefix, m.cfg.dit.image_dim, tol("image_encoder"), device, dtype,
                                                    seed, fault)
            if m.is_model:
                with exceptions_fail(report.checks, f"{prefix}/scheduler"):
                    report.checks += scheduler_checks(f"{prefix}/scheduler", m.cfg, tol("scheduler"), dtype, seed)
            if m.kind == "vae" or (m.is_model and (m.cfg.vae, dname) not in vae_done):
                vcfg = m.cfg if m.kind == "vae" else m.cfg.vae
                vae_done.append((vcfg, dname))
                report.checks += vae_rows(m, vcfg, tol("vae"), dname, dtype, device, seed, fault, progress)
        if m.is_model:
            with exceptions_fail(report.checks, f"{m.name}/fp32/input"):
                report.checks += input_checks(f"{m.name}/fp32/input", m,
                                              contract_tolerance("C0", "input", "fp32", "cpu"), seed, fault, progress)
    if fault is not None:
        report.settings["fault_planted_in"] = _planted_in(fault)
    return report


def _planted_in(fault: str) -> str:
    if fault in faults.DIT_FAULTS:
        return "optimized DiT (expert 1)"
    if fault in faults.UMT5_FAULTS:
        return "optimized UMT5"
    if fault in faults.CLIP_FAULTS:
        return "optimized CLIP image encoder"
    return "optimized VAE"


# ------------------------------------------------------------------------------------------------
# Components
# ------------------------------------------------------------------------------------------------

def dit_rows(prefix, m: ModelUnderTest, tol, dtype, device, seed, fault, traces, progress, matrix: str = "ci"
             ) -> list[CheckResult]:
    if m.is_model:
        experts = [("dit", "transformer", m.cfg.dit)] + ([("dit_2", "transformer_2", m.cfg.dit_2)]
                                                         if m.cfg.two_experts else [])
        max_len = m.cfg.max_sequence_length
    else:
        experts, max_len = [("dit", "transformer", m.cfg)], None
    checks = []
    for label, component, cfg in experts:
        progress(f"[wan C0] {prefix}: {label} loading both sides")
        with exceptions_fail(checks, f"{prefix}/{label}"):  # an exception fails this expert's rows, not the run
            reference = load_reference_dit(cfg, m.weights[component], device, dtype)
            fast = load_optimized_dit(cfg, m.weights[component], device, dtype, component)
            with faults.planted_dit(fault if label == "dit" else None, fast):
                checks += dit.dit_checks(f"{prefix}/{label}", cfg, reference, fast, tol, dtype, device, seed,
                                         max_len, traces, progress, matrix)
    return checks


def umt5_rows(prefix, m: ModelUnderTest, tol, dtype, device, seed, fault, progress) -> list[CheckResult]:
    cfg = m.cfg.text_encoder if m.is_model else m.cfg
    L = m.cfg.max_sequence_length if m.is_model else 16
    reference = load_reference_umt5(cfg, m.weights["text_encoder"], device, dtype)
    fast = load_optimized_umt5(cfg, m.weights["text_encoder"], device, dtype)
    with faults.planted_umt5(fault, fast):
        return umt5.umt5_checks(f"{prefix}/umt5", cfg, reference, fast, tol, device, seed, L, progress)


def vae_rows(m: ModelUnderTest, vcfg, tol, dname, dtype, device, seed, fault, progress) -> list[CheckResult]:
    """vae.py's rows on this VAE; named by the VAE variant it equals (several tiny models share one)."""
    name = next((v for v in list_variants() if load_variant(v) == vcfg), None) if m.is_model else m.name
    prefix = f"vae:{name}/{dname}" if name and m.is_model else f"{m.name}/{dname}" + ("/vae" if m.is_model else "")
    state = m.weights["vae"]
    progress(f"[wan C0] {prefix}: VAE decode / encode")
    checks: list[CheckResult] = []
    with exceptions_fail(checks, prefix):  # an exception fails this VAE's rows, not the run
        model = ref.load_vae(vcfg, state, device, dtype)
        fast = opt_wan.load_fast_vae(vcfg, state, device, dtype)
        with faults.planted_vae(fault, fast):
            checks += vae.c0_checks(prefix, vcfg, model, fast, tol, dtype, device, seed,
                                    not (name or "").startswith("tiny"), components=dname == "fp32", progress=progress)
    return checks


# ------------------------------------------------------------------------------------------------
# Scheduler step: reference solver objects vs optimized functional states, same synthetic velocities
# ------------------------------------------------------------------------------------------------

def scheduler_checks(prefix: str, cfg: WanModelConfig, tol: Tolerance, dtype: torch.dtype, seed: int
                     ) -> list[CheckResult]:
    T, shift = cfg.num_train_timesteps, float(cfg.flow_shift)
    g = torch.Generator().manual_seed(seed + 60)
    shape = (1, cfg.latent_channels, 2, 4, 4)
    x0 = torch.randn(shape, generator=g)
    velocities = [torch.randn(shape, generator=g).to(dtype) for _ in range(SCHEDULER_STEPS)]
    checks = []
    for name in ("unipc", "euler"):
        if name == "unipc":
            ref_solver = UniPCFlow(UniPCConfig(num_train_timesteps=T, flow_shift=shift), SCHEDULER_STEPS)
            state, timesteps = unipc.new_state(UniPCConfig(num_train_timesteps=T, flow_shift=shift).validate(),
                                               SCHEDULER_STEPS)
            step = unipc.unipc_step
        else:
            ref_solver = FlowMatchEuler(FlowMatchEulerConfig(T, shift), SCHEDULER_STEPS)
            state, timesteps = euler.new_euler_state(FlowMatchEulerConfig(T, shift), SCHEDULER_STEPS)
            step = euler.euler_step
        for what, got, want in (("timesteps", timesteps, ref_solver.timesteps), ("sigmas", state.sigmas,
                                                                                   ref_solver.sigmas)):
            ok = exact(got, want)
            checks.append(CheckResult(f"{prefix}/{name}/{what}", ok,
                                      detail=f"exact incl. dtype: {want.tolist()}" if ok else
                                      f"{got.dtype} {got.tolist()} vs reference {want.dtype} {want.tolist()}"))
        xr = xo = x0
        per_step = []
        for v in velocities:
            xr = ref_solver.step(v, xr)
            state, xo = step(state, v, xo)
            per_step.append(compare(xo, xr))
        bad = [k for k, mt in enumerate(per_step) if not within(mt, tol)]
        worst = max(per_step, key=lambda mt: mt.rel_l2)
        checks.append(CheckResult(f"{prefix}/{name}/steps", not bad, worst, tol,
                                  detail=f"{SCHEDULER_STEPS} steps, shift {shift}, velocities in {str(dtype)[6:]}; "
                                         + ", ".join(f"{mt.rel_l2:.1e}" for mt in per_step),
                                  divergence=f"{name} step {bad[0]}" if bad else None))
    return checks


# ------------------------------------------------------------------------------------------------
# What the loop feeds the DiT: reference pipeline vs optimized loop, one request per model
# ------------------------------------------------------------------------------------------------

def input_checks(prefix: str, m: ModelUnderTest, tol: Tolerance, seed: int, fault: str | None,
                 progress) -> list[CheckResult]:
    cfg: WanModelConfig = m.cfg
    progress(f"[wan C0] {prefix}: the step-0 DiT input, reference pipeline vs optimized loop")
    req = make_request(cfg, seed + 70)
    pipe = reference_pipeline(m)
    instance = WanModelInstance(cfg, m.weights, weights_version=f"parity-c0:{m.name}:{seed}")
    loop = WanDenoiseLoop(instance)
    with faults.planted_umt5(fault, instance.text_encoder):
        state, branch = optimized_step_input(loop, req)
    latents = pipe.initial_latents(req)
    solver = pipe.make_solver(req)
    condition = pipe.encode_condition(req, tuple(latents.shape)) if req.image is not None else None
    x, t = pipe.model_inputs(latents, solver.timesteps[0], condition)
    text, _ = pipe.encode_text(req)
    C = cfg.latent_channels
    checks = [CheckResult(f"{prefix}/noise", exact(state.initial, latents),
                          detail=f"initial latents {list(latents.shape)} from seed {req.seed}: bitwise")]
    ok = exact(branch.timestep, t)
    zero0 = ", per token: 0 on latent frame 0 by construction" if cfg.expand_timesteps and condition is not None else ""
    got_t = f"{branch.timestep.dtype} {branch.timestep.flatten()[:8].tolist()}"
    checks.append(CheckResult(f"{prefix}/timestep", ok, detail=f"exact incl. dtype ({t.dtype}{zero0})" if ok else
                              f"{got_t} vs reference {t.dtype} {t.flatten()[:8].tolist()}"))
    n = req.text_ids.numel()
    c = check(f"{prefix}/text", branch.text, text, tol,
              detail=f"cond embeddings, {n} real rows of {text.shape[1]} (the rest zero by construction)")
    if not c.passed:
        mask = (torch.arange(text.shape[1]) < n).long()[None]
        c.divergence = umt5.padding_divergence(branch.text.float(), text.float(), mask, tol)
    checks.append(c)
    got_x = branch.latents.float()
    layout = {"t2v": "the noisy latents alone",
              "i2v": f"[latents {C}, mask 4 (0 off frame 0 by construction), condition {C}]",
              "ti2v": "latent frame 0 = image latents" if condition is not None else "the noisy latents alone"}
    checks.append(check(f"{prefix}/dit_input", got_x, x, tol, divergence="conditioning",
                        detail=f"{list(x.shape)}: {layout[cfg.task]}"))
    if cfg.task == "i2v":
        checks.append(CheckResult(f"{prefix}/mask", exact(got_x[:, C:C + 4], x[:, C:C + 4]),
                                  detail="4-channel first-frame mask: 1 on latent frame 0, 0 elsewhere by "
                                         "construction; bitwise"))
        checks.append(check(f"{prefix}/condition_latents", got_x[:, C + 4:], x[:, C + 4:], tol,
                            divergence="vae encode (image + zero frames)",
                            detail="normalised VAE latents of [image, zeros...] (every frame non-zero)"))
    elif cfg.task == "ti2v" and condition is not None:
        checks.append(check(f"{prefix}/condition_latents", got_x[:, :, :1], x[:, :, :1], tol,
                            divergence="vae encode (image)", detail="latent frame 0: the image's normalised latents"))
    return checks
