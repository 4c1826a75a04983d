"""wan C1 under a parallel plan (`fvparity run wan --level C1 --plan ulysses2`): the plan is checked against the wan
contract (optimized/models/wan PARALLELISM) before anything runs (a refused plan is a setup error, exit 2), the
ranks are spawned on CPU with gloo (optimized/parallel/launch.py `run_ranks`), and every rank runs the plan's case
matrix (`plan_runs`) through its own engine:
  * c1's cases of the `--cases` matrix: the anchor loops and the rule draws (cases.py: guidance < 1, an unguided
    request among guided ones in one same-tick batch, a prompt edit through the warm text cache, the boundary step);
  * under cfgp, `cfgp_mixed_rows` (cases.py): guided and unguided requests in one batch whose rows the cfgp split
    cuts inside a branch, so a rank runs cond and uncond rows together;
  * under sequence parallelism, a loop whose token count does not divide ulysses x ring (`padded_case`);
  * under ring SP, a loop whose self-attention logits reach hundreds, on the same weights with the q / k RMS-norm
    scales enlarged (`large_logit_case`), so a ring merge without the running max overflows there;
  * under Ulysses with fewer than HEADS_PER_RANK heads per rank (every 2-head tiny variant at ulysses2), the first
    anchor and the padded loop again on the same weights read as a DiT with more, narrower heads
    (`more_heads_model`), so every rank holds several heads and their order after the all-to-all matters;
each case's engine parallelized by the family's `parallelize` hook (Ulysses / ring SP inside the DiT; the
cfgp axis through the CFG-parallel policy; tp through column / row-parallel DiT layers). With tp > 1 every rank
loads its DiT shards from a canonical checkpoint (`--checkpoint`, or the variant's weights written as one by
fvconvert into a temporary directory first): only its slices are read (optimized/models/wan/parallelize.py).
A parallel fault is planted by each rank around its whole run, loading included (faults.planted_parallel).

Rows per rank and request: c1's schedule rows, every step's latents and the final latents vs the fp32 reference
pipeline (the loop tolerance), the engine's SP=N final latents vs the engine in one process (`vs_one_process`), and
that every rank holds the same latents (and, for a batch, that some step ran it batched; per case and rank, that no
batched step raised, `no_batch_failed`: the scheduler reruns a batch whose step raised request by request, so a
batched step that cannot run shows only in these two). Each rank also traces
its (parallel) DiT on the reference's own DiT input of every step of each case's first request: for the first case
on each set of weights (the variant's, the more-heads model's, the large-logit loop's) every rank's DiT output on
those inputs is a row of its own vs the reference DiT (C0 under the plan, the C0 DiT tolerance:
`.../rankR/dit_stepS`), and the first divergent step of any case is localised to the first divergent layer of that
trace.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from optimized.parallel.plan import ParallelPlan, ParallelPlanError
from parity.errors import SetupError
from manifests import ManifestError
from parity.families.wan import cases as case_lib, common, faults
from parity.families.wan.cases import LoopCase
from parity.families.wan.trajectory import run_engine_case, run_reference, schedule_checks, trajectory_checks
from parity.families.wan.common import (DiTInputs, ModelUnderTest, contract_tolerance, engine_for, make_request,
                                        reference_pipeline, run_optimized_dit, run_reference_dit)
from parity.engine_events import no_batch_failed_check
from parity.family import DTYPES
from parity.graph_checks import dynamo_counts, graph_kinds_check
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
    axis = faults.PARALLEL_FAULT_AXES.get(fault)
    if axis is not None and getattr(plan, axis) == 1:
        raise SetupError(f"fault {fault} lives on the {axis} axis: give a plan with {axis} > 1")
    return plan


def padded_case(cfg, sp_degree: int) -> LoopCase:
    """A loop whose token count does not divide the SP degree, so the sharded sequence is padded and the pad keys
    must be masked: 1 patch row x (n + 1) patch columns x F latent frames with F % n != 0 (3, or 1 when n divides
    3): F (n + 1) tokens, F mod n past a multiple of n. The anchor loops (2 x 2 x 2 = 8 tokens) never pad at n = 2, 4."""
    n = sp_degree
    frames = 9 if 3 % n else 1      # pixel frames -> 3 (or 1) latent frames
    s = cfg.vae.spatial_compression * cfg.dit.patch_size[1]
    req = make_request(cfg, 8, num_frames=frames, height=s, width=(n + 1) * s)
    return LoopCase(f"sp_padded_{n}", (req,), rules=("sp_padding",))


LARGE_LOGIT_CASE = "sp_ring_large_logits"
LARGE_LOGIT_QK_SCALE = 16.0   # norm_q and norm_k weights x 16: q.k / sqrt(d) x 256, hundreds (exp(89) is fp32 inf)


def large_logit_case(cfg) -> LoopCase:
    """A 2-step loop on the anchors' 2 x 2 x 2 token grid (no padding at ring2 / ring4), run on `large_logit_model`:
    its self-attention logits reach hundreds, so only a softmax with the max shift stays finite."""
    return LoopCase(LARGE_LOGIT_CASE, (make_request(cfg, 9, num_steps=2),), rules=("sp_ring_large_logits",))


def large_logit_model(m: ModelUnderTest) -> ModelUnderTest:
    """The same weights with every DiT self-attention q / k RMS-norm weight scaled by LARGE_LOGIT_QK_SCALE (the
    logits scale by its square); the reference and every engine of the large-logit loop run on these."""
    weights = dict(m.weights)
    for name in ("transformer", "transformer_2"):
        if name in weights:
            weights[name] = {k: v * LARGE_LOGIT_QK_SCALE if k.endswith(("attn1.norm_q.weight", "attn1.norm_k.weight"))
                             else v for k, v in weights[name].items()}
    return ModelUnderTest(f"{m.name}+large-logits", m.kind, m.cfg, weights)   # its own weights_version


HEADS_PER_RANK = 2   # the more-heads model's heads on every rank of the plan's head split (ulysses x tp)


def more_heads_model(m: ModelUnderTest, plan: ParallelPlan) -> ModelUnderTest | None:
    """Under Ulysses, `m`'s weights read as a DiT with HEADS_PER_RANK heads on every rank of the head split: heads x k,
    head_dim / k, so the hidden size (heads x head_dim) and every weight's shape and meaning are unchanged; only
    the grouping of its channels into heads (and the per-head rope) changes. None without Ulysses, when every rank
    already holds that many heads, or when the head_dim cannot be split (the new head_dim must stay a valid one)."""
    split = plan.sp_ulysses * plan.tp
    if plan.sp_ulysses == 1 or m.cfg.dit.num_heads // split >= HEADS_PER_RANK:
        return None
    heads = HEADS_PER_RANK * split

    def regroup(dit):
        if dit is None:
            return None
        if dit.hidden_size % heads:
            raise ValueError(f"hidden size {dit.hidden_size} is not divisible by {heads} heads")
        return replace(dit, num_heads=heads, head_dim=dit.hidden_size // heads).validate()

    try:
        cfg = replace(m.cfg, dit=regroup(m.cfg.dit), dit_2=regroup(m.cfg.dit_2))
    except (ManifestError, ValueError):
        return None
    return ModelUnderTest(f"{m.name}+{heads}heads", m.kind, cfg, m.weights)   # its own weights_version


def plan_cases(cfg, plan: ParallelPlan, matrix: str = "ci", seed: int = 0) -> list[LoopCase]:
    """The plan's cases on the variant's own config: c1's (anchors, then the rule draws of `matrix`), the cfgp
    mixed-rows batches when cfgp > 1, the padded-sequence loop when the plan shards the sequence (ulysses x ring
    > 1) and the large-logit loop when it runs ring attention (ring > 1)."""
    n = plan.sp_ulysses * plan.sp_ring
    return (case_lib.c1_cases(cfg, matrix, seed)
            + (case_lib.cfgp_mixed_rows_cases(cfg, plan.cfgp, matrix, seed) if plan.cfgp > 1 else [])
            + ([padded_case(cfg, n)] if n > 1 else [])
            + ([large_logit_case(cfg)] if plan.sp_ring > 1 else []))


def heads_cases(cfg, plan: ParallelPlan, heads: int) -> list[LoopCase]:
    """What the more-heads model runs: the first anchor (the task's own guided request) and the padded loop,
    named `heads<H>.<case>`."""
    first = case_lib.anchor_cases(cfg)[0]
    return [replace(c, name=f"heads{heads}.{c.name}", rules=c.rules + ("sp_heads_per_rank",))
            for c in (first, padded_case(cfg, plan.sp_ulysses * plan.sp_ring))]


def plan_runs(m: ModelUnderTest, plan: ParallelPlan, matrix: str = "ci", seed: int = 0,
              wanted: Callable[[str], bool] = lambda name: True) -> list[tuple[LoopCase, ModelUnderTest]]:
    """(case, the weights it runs on) of a plan run on `m`: `plan_cases` on `m` (the large-logit loop on its own
    weights), then `heads_cases` on `more_heads_model(m)` when there is one; `wanted` selects by case name."""
    runs = [(c, large_logit_model(m) if c.name == LARGE_LOGIT_CASE else m)
            for c in plan_cases(m.cfg, plan, matrix, seed)]
    more = more_heads_model(m, plan)
    if more is not None:
        runs += [(c, more) for c in heads_cases(m.cfg, plan, more.cfg.dit.num_heads)]
    return [(c, cm) for c, cm in runs if wanted(c.name)]


def _dit_inputs(pipe, req, ref_run, step: int) -> tuple[int, DiTInputs]:
    """(expert, the reference's own cond-branch DiT input) of `step`."""
    prev = ref_run.initial if step == 0 else ref_run.trajectory[step - 1]
    condition = pipe.encode_condition(req, tuple(prev.shape)) if req.image is not None else None
    x, t = pipe.model_inputs(prev, pipe.make_solver(req).timesteps[step], condition)
    text, _ = pipe.encode_text(req)
    image = req.image_embeds.float()[None] if req.image_embeds is not None else None
    detached = (None if v is None else v.detach() for v in (x, t, text, image))   # they cross process boundaries
    return ref_run.experts[step], DiTInputs(*detached)


def write_model_dir(m: ModelUnderTest, root: Path) -> Path:
    """The variant's weights as a canonical model directory: a diffusers pipeline root (canonical DiT / VAE names
    are diffusers'; UMT5 with its tied embedding copy) converted by fvconvert. Returns the directory."""
    from converters.cli import main as fvconvert

    from safetensors.torch import save_file

    cfg, src = m.cfg, root / "src"
    configs = {"transformer": cfg.dit.to_diffusers_config(), "text_encoder": cfg.text_encoder.to_transformers_config(),
               "vae": {"_class_name": "AutoencoderKLWan", **cfg.vae.to_diffusers_config()}}
    if cfg.two_experts:
        configs["transformer_2"] = cfg.dit_2.to_diffusers_config()
    if cfg.has_image_encoder:   # 2.1 I2V: a transformers CLIPVisionModel + its processor (fvconvert requires them)
        configs["image_encoder"] = {"model_type": "clip_vision_model", **cfg.image_encoder.to_transformers_config()}
        common.write_image_processor(cfg, src / "image_processor")
    for name, config in configs.items():
        state = {k: v.contiguous() for k, v in m.weights[name].items()}
        if name == "text_encoder":   # (upstream) transformers saves the tied input embedding too
            state["encoder.embed_tokens.weight"] = state["shared.weight"].clone()
        (src / name).mkdir(parents=True)
        (src / name / "config.json").write_text(json.dumps(config))
        save_file(state, str(src / name / ("model.safetensors" if name in ("text_encoder", "image_encoder") else
                                           "diffusion_pytorch_model.safetensors")))
    # the pipeline's assets: a scheduler config the model config is read from, and a tokenizer folder (never used
    # here: requests carry token ids)
    (src / "scheduler").mkdir()
    (src / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": cfg.num_train_timesteps,
         "flow_shift": cfg.flow_shift, "use_flow_sigmas": True, "prediction_type": "flow_prediction"}))
    (src / "tokenizer").mkdir()
    (src / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    index = {"_class_name": "WanImageToVideoPipeline" if cfg.task == "i2v" else "WanPipeline",
             "_diffusers_version": "0.42.1", "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "T5TokenizerFast"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "transformer": ["diffusers", "WanTransformer3DModel"], "vae": ["diffusers", "AutoencoderKLWan"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"] if cfg.two_experts else [None, None],
             "boundary_ratio": cfg.boundary_ratio, "expand_timesteps": cfg.expand_timesteps,
             **({"image_encoder": ["transformers", "CLIPVisionModel"], "image_processor": [
                 "transformers", "CLIPImageProcessor"]} if cfg.has_image_encoder else {})}
    (src / "model_index.json").write_text(json.dumps(index))
    out = root / "canonical"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):   # not the report
        known = ["--variant", m.name] if m.name in common.variants() else []   # else the configs say it all
        failed = fvconvert(["wan", "--from", "diffusers", str(src), str(out), *known, "--skip-parity"])
    if failed:
        raise SetupError(f"fvconvert could not write {m.name} as a canonical checkpoint for the tp ranks")
    return out


def _rank_engine(m: ModelUnderTest, mesh, dname: str, seed: int, policy, checkpoint: str | None):
    """This rank's engine: with tp > 1 the DiT shards are read from the checkpoint, else the whole weights."""
    if mesh.plan.tp > 1 and checkpoint:
        import optimized
        from optimized.models.wan import FAMILY
        from optimized.models.wan.instance import load_sharded_instance

        return optimized.Engine(load_sharded_instance(checkpoint, mesh, "cpu", DTYPES[dname]), FAMILY,
                                cfg_policy=policy, batching="greedy")
    return engine_for(m, "cpu", DTYPES[dname], seed, policy)


def _rank_worker(group, plan_text: str, models: list[ModelUnderTest], seed: int, dname: str, cases: list[LoopCase],
                 fault: str | None, probes: list[list[tuple[int, DiTInputs]]], checkpoints: list[str | None],
                 graph: str = "eager") -> list:
    """This rank's runs of every case, and its DiT traces on the probe inputs: [(runs, [trace per step])]; `graph`:
    how the block stack runs under the plan (eager / compile; traces always run eager)."""
    from optimized.parallel.cfg_parallel import CFGParallel
    from optimized.parallel.mesh import build_mesh

    plan = ParallelPlan.parse(plan_text)
    mesh = build_mesh(plan)
    out = []
    with faults.planted_parallel(fault):   # this rank's own patch, before anything is loaded
        for case, m, case_probes, checkpoint in zip(cases, models, probes, checkpoints):
            policy = CFGParallel(mesh.axis("cfgp")) if plan.cfgp > 1 else case.cfg_policy
            engine = _rank_engine(m, mesh, dname, seed, policy, checkpoint)
            engine.family.parallelize(engine.model, mesh)
            engine.model.configure_graph(graph, cfg_policy=getattr(policy, "name", policy))
            traces = []
            with faults.planted_engine(fault, engine):
                runs = run_engine_case(engine, case)
                for expert, x in case_probes:
                    trace: dict = {}
                    run_optimized_dit(engine.model.expert(expert), x, trace)
                    traces.append({k: v.float() for k, v in trace.items()})
            if graph == "compile":  # what dynamo really compiled on this rank (a silent eager run would show 0)
                runs[0].extra["dynamo"] = dynamo_counts()
            out.append((runs, traces))
    return out


def run_c1_plan(report: Report, models: list[ModelUnderTest], plan: ParallelPlan, device: str, dtypes: list[str],
                seed: int, fault: str | None, progress: Callable[[str], None], graph: str = "eager",
                cases: str = "ci", wanted: Callable[[str], bool] = lambda name: True) -> Report:
    """`cases`: the case matrix (ci / full); `wanted`: which cases run, by name (every one by default)."""
    report.settings["plan"] = plan.name()
    report.settings["cases"] = cases
    with tempfile.TemporaryDirectory(prefix="fvparity-tp-") as tmp:
        for m in models:
            checkpoint = report.settings.get("checkpoint")
            if plan.tp > 1 and not checkpoint:
                progress(f"[wan C1] {m.name}: writing the weights as a canonical checkpoint for the tp ranks")
                checkpoint = str(write_model_dir(m, Path(tmp) / m.name))
            _run_model(report, m, plan, device, dtypes, seed, fault, progress, checkpoint, graph, cases, wanted)
    return report


def _run_model(report: Report, m: ModelUnderTest, plan: ParallelPlan, device: str, dtypes: list[str], seed: int,
               fault: str | None, progress: Callable[[str], None], checkpoint: str | None,
               graph: str = "eager", matrix: str = "ci", wanted: Callable[[str], bool] = lambda name: True) -> None:
    from optimized.parallel.launch import run_ranks

    pairs = plan_runs(m, plan, matrix, seed, wanted)
    if not pairs:
        return
    cases, models = [c for c, _ in pairs], [cm for _, cm in pairs]
    first_on = [c for c, cm in enumerate(models) if all(cm is not x for x in models[:c])]   # first case per weights
    # the checkpoint holds the variant's weights: a case on other weights cuts its tp shards from them instead
    checkpoints = [checkpoint if cm is m else None for cm in models]
    pipe_of = {id(models[c]): reference_pipeline(models[c]) for c in first_on}
    pipes = [pipe_of[id(cm)] for cm in models]
    ref_runs = [[run_reference(pipe, req) for req in case.requests] for case, pipe in zip(cases, pipes)]
    probes = [[_dit_inputs(pipe, case.requests[0], runs[0], s) for s in range(len(runs[0].trajectory))]
              for case, runs, pipe in zip(cases, ref_runs, pipes)]
    for dname in dtypes:
        tol = contract_tolerance("C1", "loop", dname, device)
        step_tol = contract_tolerance("C0", "dit", dname, device)
        progress(f"[wan C1] {m.name}/{dname}: plan {plan.name()} on {plan.world_size} gloo ranks, "
                 f"{len(cases)} cases")
        ranks = run_ranks(_rank_worker, plan.world_size,
                          (plan.name(), models, seed, dname, cases, fault, probes, checkpoints, graph),
                          timeout_s=RANK_TIMEOUT_S)
        for c, case in enumerate(cases):
            pipe = pipes[c]
            one = run_engine_case(engine_for(models[c], device, DTYPES[dname], seed, case.cfg_policy), case)
            prefix = f"{m.name}/{dname}/{plan.name()}/{case.name}"
            if len(case.requests) > 1 and case.batched:  # on every rank, no batched step raised (solo reruns hide it)
                report.checks += [no_batch_failed_check(f"{prefix}/rank{r}", rank[c][0][0].extra["batch_failures"])
                                  for r, rank in enumerate(ranks)]
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
                    if graph != "eager":  # every step of this rank ran the asked graph, with the plan in its key
                        report.checks.append(graph_kinds_check(f"{p}/graph_{graph}", graph,
                                                               eng_run.extra.get("graphs", []),
                                                               rank[c][0][0].extra.get("dynamo")))
                    if len(case.requests) > 1 and case.batched:  # the batch a mixed-rows case exists for
                        sizes = eng_run.extra["batch_sizes"]
                        report.checks.append(CheckResult(f"{p}/batched_with_others", max(sizes, default=0) > 1,
                                                         detail=f"batch size per step {sizes}"))
                lat = [rank[c][0][k].latents for rank in ranks]
                agree = all(x is not None and torch.equal(x, lat[0]) for x in lat)
                report.checks.append(CheckResult(
                    f"{prefix}" + (f"/req{k}" if len(case.requests) > 1 else "") + "/ranks_agree", agree,
                    detail=f"final latents bitwise equal on all {len(ranks)} ranks" if agree else
                    "the ranks hold different final latents"))
        for c in first_on:
            report.checks += _dit_checks(f"{m.name}/{dname}/{plan.name()}/{cases[c].name}", pipes[c], probes[c],
                                         [rank[c][1] for rank in ranks], step_tol)


def _dit_checks(prefix: str, pipe, probes: list[tuple[int, DiTInputs]], rank_traces: list[list[dict]],
                tol) -> list[CheckResult]:
    """C0 under the plan: every rank's parallel DiT output on the reference's own cond-branch input of every step of
    one case (the first on each set of weights) vs the reference DiT on that input (the C0 DiT tolerance)."""
    out = []
    for step, (expert, x) in enumerate(probes):
        want: dict = {}
        run_reference_dit(pipe.transformer if expert == 1 else pipe.transformer_2, x, want)
        for r, traces in enumerate(rank_traces):
            mt = compare(traces[step]["proj_out"], want["proj_out"].float())   # the output head, before unpatchify
            out.append(CheckResult(f"{prefix}/rank{r}/dit_step{step}", within(mt, tol), mt, tol,
                                   detail=f"parallel DiT (expert {expert}) on the reference's step-{step} input vs "
                                          f"the reference DiT"))
    return out


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
