"""Wan denoising as a LoopKernel: the runtime owns the loop, this file owns one step.

Semantics are diffusers 0.42.1 `WanPipeline` / `WanImageToVideoPipeline` (output_type="latent"). One step for a
batch of requests that share (expert, latent shape, text length, dtype, CFG policy), at any mix of step indices,
seeds, guidance scales and solvers: build each request's DiT input, run cond (and uncond) through the CFG policy as
one or two batched forwards, combine in the model's output dtype, advance each request's own solver state.

    t2v    DiT input = latents; timestep [B] (int64 for UniPC, fp32 for Euler)
    i2v    DiT input = [latents, 4-channel first-frame mask, normalised VAE latents of [image, zeros...]]
    ti2v   (expand_timesteps) per-token timesteps from a first-frame mask; with an image, latent frame 0 is the
           normalised VAE latent of the image (in the DiT input every step and in the result)
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Sequence

import torch

from manifests.accel import AccelDecision, AccelSpec
from manifests.accel import sparse as sparse_kinds
from manifests.solvers import FlowMatchEulerConfig, UniPCConfig
from manifests.wan import WanGenerateRequest, WanModelConfig
from manifests.wan.dit import dit_params
from optimized.models.wan.instance import WanModelInstance
from optimized.accel.residual import ResidualCache, ResidualOwner
from optimized.accel.rules import BranchRule, make_rule
from optimized.accel.stack import AccelRow, cached_forward
from optimized.models.wan.transformer import WanCachedStack, WanDiTFast
from optimized.models.wan.vae import ConvCache
from optimized.runtime.cache import CacheKey
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan, per_rank_share
from optimized.solvers import euler, unipc
from optimized.solvers import sde as sde_solver
from optimized.solvers.guidance import CFGPolicy, cfg_combine
from optimized.solvers.policies import make_policy
from optimized.training.records import BehaviorRecorder, CaptureSpec, behavior_header, one_at_a_time

LOOP_ID = "wan.denoise"
SolverState = unipc.UniPCState | euler.EulerState
_REQUEST_TOKENS = itertools.count()
STEP_CACHES = ("fbcache", "dbcache", "taylorseer", "magcache", "cfg_delta")   # kinds whose state spans steps


def is_sparse(spec: AccelSpec | None) -> bool:
    return spec is not None and spec.name in {k.name for k in sparse_kinds.KINDS}


@dataclass
class WanAccelState:
    """One request's acceleration: its rule per CFG branch, whose residuals it owns, every decision so far."""
    spec: AccelSpec
    owner: ResidualOwner
    rules: dict[str, BranchRule]                    # "cond" / "uncond" -> the branch's own rule
    decisions: list[AccelDecision] = field(default_factory=list)


@dataclass(frozen=True)
class WanDenoiseJob:
    request: WanGenerateRequest
    record_trajectory: bool = False
    capture: CaptureSpec | None = None              # RL rollout: keep a BehaviorRecord (result["behavior"])


@dataclass
class WanDenoiseState:
    job: WanDenoiseJob
    solver_name: str                                # "unipc" | "euler"
    timesteps: torch.Tensor                         # [N] model timesteps: int64 (UniPC) or fp32 (Euler), upstream
    sigmas: torch.Tensor                            # fp32 [N + 1]
    experts: tuple[int, ...]                        # 1 or 2 for every step
    latents: torch.Tensor                           # fp32 [1, C, T, h, w]
    solver: SolverState                             # this request's own solver state
    text: torch.Tensor                              # [1, L, text_dim] cond embeddings, run dtype (shared via cache)
    negative_text: torch.Tensor | None              # uncond embeddings when the request runs CFG
    text_keys: tuple[CacheKey, ...] = ()            # the text-embedding cache entries this request reads
    image_embeds: torch.Tensor | None = None        # [1, N, image_dim] (2.1 I2V image branch)
    condition: torch.Tensor | None = None           # i2v: [1, 4 + z, T, h, w]; ti2v with image: [1, z, 1, h, w]
    first_frame_mask: torch.Tensor | None = None    # ti2v: fp32 [1, 1, T, h, w] (0 on frame 0 when conditioned)
    initial: torch.Tensor | None = None             # the initial latents
    step: int = 0
    trajectory: list[torch.Tensor] = field(default_factory=list)
    sde: sde_solver.SDEState | None = None          # SDE rollout steps (request.sde) on the solver's tables
    generator: torch.Generator | None = None        # the request's own generator (SDE step noise comes from it)
    recorder: BehaviorRecorder | None = None        # behavior capture (job.capture)
    accel: WanAccelState | None = None              # request.accel: the step caches' rules and decisions

    @property
    def request(self) -> WanGenerateRequest:
        return self.job.request


@dataclass(frozen=True)
class BranchInput:
    """One DiT forward row: the inputs of one request's cond or uncond branch (batch dim 1)."""
    latents: torch.Tensor                           # [1, C_in, T, h, w], run dtype
    timestep: torch.Tensor                          # [1] or [1, seq]
    text: torch.Tensor                              # [1, L, text_dim]
    image_embeds: torch.Tensor | None
    lora: tuple = ()                                # the request's LoraRefs (applied per row, optimized/adapters)


def advance(solver: SolverState, velocity: torch.Tensor, x: torch.Tensor) -> tuple[SolverState, torch.Tensor]:
    """One solver step of one request (module-level so a fault can be planted here)."""
    if isinstance(solver, euler.EulerState):
        return euler.euler_step(solver, velocity, x)
    return unipc.unipc_step(solver, velocity, x)


def forward_rows(dit: WanDiTFast, rows: list[BranchInput]) -> list[torch.Tensor]:
    """One batched DiT forward over same-shape rows; one [1, C_out, T, h, w] prediction per row."""
    ts = [r.timestep for r in rows]
    if len({t.dtype for t in ts}) > 1:  # int and float timesteps in one batch: the DiT embeds them as fp32 anyway
        ts = [t.to(torch.float32) for t in ts]
    images = None if rows[0].image_embeds is None else torch.cat([r.image_embeds for r in rows])
    lora = {} if not any(r.lora for r in rows) else {"lora": dit.lora_bank.rows(dit, [r.lora for r in rows])}
    out = dit.forward_batch(torch.cat([r.latents for r in rows]), torch.cat(ts), torch.cat([r.text for r in rows]),
                            images, **lora)
    return list(out.split(1))


def expert_schedule(cfg: WanModelConfig, timesteps: torch.Tensor) -> tuple[int, ...]:
    """Expert 1 while t >= boundary_ratio * num_train_timesteps, expert 2 after (upstream; tensor comparison)."""
    if cfg.boundary_ratio is None:
        return (1,) * len(timesteps)
    boundary = cfg.boundary_ratio * cfg.num_train_timesteps
    return tuple(1 if bool(t >= boundary) else 2 for t in timesteps)


class WanDenoiseLoop(LoopKernel[WanDenoiseState]):
    loop_id = LOOP_ID

    def __init__(self, model: WanModelInstance, cfg_policy: CFGPolicy | str = "batched"):
        self.model = model
        self.cfg: WanModelConfig = model.cfg
        self.cfg_policy = make_policy(cfg_policy)
        self.residuals = ResidualCache()              # the step caches' residuals (optimized/accel/residual.py)

    # ---- request -> state
    def init_state(self, job: WanDenoiseJob | WanGenerateRequest) -> WanDenoiseState:
        job = job if isinstance(job, WanDenoiseJob) else WanDenoiseJob(job)
        cfg, req = self.cfg, job.request
        try:
            req.validate(cfg)
            self.cfg_policy.check(req.uses_cfg, req.guidance_scale)
        except ValueError as e:  # ManifestError included: one clear message, nothing else disturbed
            raise ValueError(str(e)) from None
        solver_name = req.solver or cfg.solver
        shift = float(req.flow_shift if req.flow_shift is not None else cfg.flow_shift)
        if solver_name == "euler":
            solver, timesteps = euler.new_euler_state(FlowMatchEulerConfig(cfg.num_train_timesteps, shift),
                                                      req.num_steps)
        else:
            solver, timesteps = unipc.new_state(UniPCConfig(num_train_timesteps=cfg.num_train_timesteps,
                                                            flow_shift=shift).validate(), req.num_steps)
        gen = torch.Generator().manual_seed(req.seed) if req.seed is not None else None
        latents = self._initial_latents(req, gen)
        text, negative = self._encode_text(req)
        keys = tuple(self.model.text_encoder.cache_key(ids)
                     for ids in (req.text_ids,) + ((req.negative_text_ids,) if req.uses_cfg else ()))
        state = WanDenoiseState(job, solver_name, timesteps, solver.sigmas, expert_schedule(cfg, timesteps),
                                latents, solver, text, negative, text_keys=keys, initial=latents, generator=gen)
        if req.sde is not None:  # SDE steps on this solver's tables
            state.sde = sde_solver.new_sde_state(req.sde, solver.sigmas)
        if job.capture is not None:
            header = behavior_header("wan", self.loop_id, req, self.model, self.cfg_policy.name, solver_name,
                                     solver.sigmas, timesteps, keys, job.capture)
            state.recorder = BehaviorRecorder.start(job.capture, header, {"vision": latents}, len(timesteps))
        if req.image_embeds is not None:  # (upstream) image_embeds.repeat(batch_size, 1, 1).to(transformer_dtype)
            state.image_embeds = req.image_embeds.unsqueeze(0).to(self.model.device, self.model.dtype)
        self._condition(req, state)
        if req.accel is not None:
            state.accel = self._accel_state(req, state)
        return state

    def _accel_state(self, req: WanGenerateRequest, s: WanDenoiseState) -> WanAccelState:
        """The request's rules per branch; refusals (one clear message) for what the accelerated step cannot run."""
        if req.lora:
            raise ValueError("wan request: accel with per-request LoRA is not supported (merge the adapter)")
        if s.job.capture is not None and s.job.capture.batch_invariant:
            raise ValueError("wan request: accel with a batch-invariant capture is not supported (the cached step "
                             "batches its rows)")
        if self.layout() is not None or self.cfg_policy.name != "batched":
            raise ValueError("wan request: accel runs on a single device with the batched CFG policy "
                             f"(this loop: policy {self.cfg_policy.name}, plan {self.layout()})")
        spec = req.accel
        dits = [self.model.expert(e) for e in sorted(set(s.experts))]
        layers = dits[0].cfg.num_layers
        if any(d.cfg.num_layers != layers for d in dits):
            raise ValueError("wan request: accel needs both experts to have the same number of blocks")
        if len(set(s.experts)) > 1 and spec.name in STEP_CACHES:
            raise ValueError(f"wan request: accel {spec.name} on a two-expert run is not supported (upstream keeps "
                             "one cache per transformer; this loop would carry one across the expert switch)")
        branches = ("cond", "uncond") if req.uses_cfg else ("cond",)
        try:
            rules = {b: BranchRule() if is_sparse(spec) else make_rule(spec, b, req.num_steps, layers)
                     for b in branches}
        except ValueError as e:
            raise ValueError(str(e)) from None
        owner = ResidualOwner(request=f"wan-{next(_REQUEST_TOKENS)}", model_id="wan", component_id=dits[0].component_id,
                              weights_version=dits[0].weights_version, precision=str(self.model.dtype),
                              shape_signature="x".join(map(str, s.latents.shape[1:])), spec=spec)
        return WanAccelState(spec, owner, rules)

    def _initial_latents(self, req: WanGenerateRequest, g: torch.Generator | None) -> torch.Tensor:
        if req.noise is not None:  # (upstream) caller latents are cast to float32
            return req.noise.to(self.model.device, torch.float32, copy=True)
        # (upstream) one float32 randn of the whole [1, C, T, h, w] from a CPU generator
        return torch.randn(1, *req.latent_shape(self.cfg), generator=g, dtype=torch.float32).to(self.model.device)

    def _encode_text(self, req: WanGenerateRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each prompt through UMT5Fast's content-hash cache (a prompt shared by K requests is encoded once);
        (upstream) embeddings cast to the transformer dtype."""
        enc, L, dt = self.model.text_encoder, self.cfg.max_sequence_length, self.model.dtype
        text = enc.encode([req.text_ids], L).to(self.model.device, dt)
        negative = enc.encode([req.negative_text_ids], L).to(self.model.device, dt) if req.uses_cfg else None
        return text, negative

    def _vae_mean(self, video: torch.Tensor) -> torch.Tensor:
        """VAE posterior mode (upstream `retrieve_latents(sample_mode="argmax")`), encoded as upstream does:
        video frame 0 alone, then 4 frames at a time, the causal-conv cache carried between chunks."""
        vae, z = self.model.vae, self.cfg.vae.z_dim
        t = self.cfg.vae.temporal_compression
        video = video.to(self.model.device, vae.dtype)
        cache, moments = ConvCache(), []
        with torch.no_grad():
            for i in range(1 + (video.shape[2] - 1) // t):
                chunk = video[:, :, :1] if i == 0 else video[:, :, 1 + t * (i - 1): 1 + t * i]
                m, cache = vae.encode_chunk(chunk, cache, first=i == 0)
                moments.append(m)
        return torch.cat(moments, 2)[:, :z]

    def _normalised_condition(self, video: torch.Tensor) -> torch.Tensor:
        vae_cfg = self.cfg.vae
        latent = self._vae_mean(video).to(self.model.device, torch.float32)
        mean = torch.tensor(vae_cfg.latents_mean).view(1, vae_cfg.z_dim, 1, 1, 1).to(latent.device, latent.dtype)
        inv_std = 1.0 / torch.tensor(vae_cfg.latents_std).view(1, vae_cfg.z_dim, 1, 1, 1).to(latent.device,
                                                                                          latent.dtype)
        return (latent - mean) * inv_std  # (upstream) multiplies by 1 / std

    def _condition(self, req: WanGenerateRequest, s: WanDenoiseState) -> None:
        cfg = self.cfg
        _, T, h, w = req.latent_shape(cfg)
        image = None if req.image is None else req.image.to(torch.float32).unsqueeze(0).unsqueeze(2)  # [1,3,1,H,W]
        if cfg.expand_timesteps:
            mask = torch.ones(1, 1, T, h, w, dtype=torch.float32, device=self.model.device)
            if image is not None:
                s.condition = self._normalised_condition(image)
                mask[:, :, 0] = 0
            s.first_frame_mask = mask
        elif cfg.task == "i2v":
            frames = torch.cat([image, image.new_zeros(1, 3, req.num_frames - 1, req.height, req.width)], dim=2)
            latent = self._normalised_condition(frames)
            # (upstream) the pixel-frame mask [1, 1 (first frame x4), 0...] viewed as 4 channels: frame 0 ones
            mask = torch.zeros(1, 4, T, h, w, dtype=torch.float32, device=latent.device)
            mask[:, :, 0] = 1
            s.condition = torch.cat([mask, latent], dim=1)

    # ---- planning (pure)
    def _tokens(self, s: WanDenoiseState) -> int:
        _, T, h, w = s.latents.shape[1:]
        pt, ph, pw = self.cfg.dit.patch_size
        return (T // pt) * (h // ph) * (w // pw)

    def layout(self):
        """The parallel plan attached to the model instance (`parallelize`), or None in one process."""
        mesh = getattr(self.model, "parallel_mesh", None)
        return getattr(mesh, "plan", mesh)

    def plan_step(self, s: WanDenoiseState) -> WorkPlan:
        expert = s.experts[s.step]
        dit_cfg = self.cfg.dit if expert == 1 else self.cfg.dit_2
        tokens, branches = self._tokens(s), 2 if s.request.uses_cfg else 1
        elem = torch.finfo(self.model.dtype).bits // 8
        # per rank: cfgp splits the branches, ulysses x ring the video tokens, tp the FFN width and the weights
        lay = self.layout()
        cfgp, sp, tp = (lay.cfgp, lay.sp_ulysses * lay.sp_ring, lay.tp) if lay is not None else (1, 1, 1)
        rank_branches, rank_tokens = per_rank_share(branches, cfgp), per_rank_share(tokens, sp)
        act_bytes = rank_branches * rank_tokens * (dit_cfg.hidden_size * elem * 12 +
                                                   per_rank_share(dit_cfg.ffn_dim, tp) * elem * 2)
        cost = 2 * rank_branches * (rank_tokens + s.text.shape[1]) * dit_params(dit_cfg) / tp / 5e10
        image_n = None if s.image_embeds is None else s.image_embeds.shape[1]
        shape = tuple(s.latents.shape[1:])
        signature = f"expert={expert};latent={'x'.join(map(str, shape))}"
        return WorkPlan(
            request_id="", loop_id=self.loop_id, phase="denoise_step", step_index=s.step,
            batch_key=(expert, shape, s.text.shape[1], image_n, str(self.model.dtype), self.cfg_policy.name)
            + ((s.request.accel.label(),) if is_sparse(s.request.accel) else ()),   # one attention mask per batch
            resources=ResourceRequest(device_bytes=act_bytes, cost_seconds=cost), cache_reads=s.text_keys,
            shape_signature=f"{signature};branches={branches}",
            parallel_plan_hash=lay.hash() if lay is not None else self.cfg_policy.layout_hash(),
            graph_bucket=f"{signature};rows={rank_branches}",   # the block stack's rows: this request's branches
            info={"timestep": s.timesteps[s.step].item(), "expert": expert,
                  "guidance": s.request.guidance_for_expert(expert)})

    def admission(self, s: WanDenoiseState) -> ResourceRequest:
        """Held for the request's life: latents + solver history (+ trajectory), conditioning, text embeddings (the
        same on every rank of a plan: each rank keeps the whole latents and texts)."""
        latent = s.latents.numel() * 4
        held = latent * (6 + (len(s.timesteps) if s.job.record_trajectory else 0))
        for t in (s.condition, s.first_frame_mask, s.text, s.negative_text, s.image_embeds):
            held += 0 if t is None else t.numel() * t.element_size()
        return ResourceRequest(device_bytes=held)

    # ---- the step body
    def _branch(self, s: WanDenoiseState, text: torch.Tensor) -> BranchInput:
        dt, t = self.model.dtype, s.timesteps[s.step]
        if self.cfg.expand_timesteps:
            x = s.latents if s.condition is None else \
                (1 - s.first_frame_mask) * s.condition + s.first_frame_mask * s.latents
            # (upstream) per-token timesteps read the mask at a hard-coded stride 2 (the DiT's spatial patch)
            timestep = (s.first_frame_mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0)
        else:
            x = s.latents if s.condition is None else torch.cat([s.latents, s.condition], dim=1)
            timestep = t.reshape(1)
        return BranchInput(x.to(dt), timestep, text, s.image_embeds, tuple(s.request.lora or ()))

    def guided_velocities(self, states: Sequence[WanDenoiseState], one_by_one: bool = False) -> list[torch.Tensor]:
        """Every state's velocity at its current step (CFG-combined) from one or two batched forwards of one
        expert; one forward per row, in order, when `one_by_one` or a request asks for batch invariance."""
        expert = states[0].experts[states[0].step]
        if any(s.experts[s.step] != expert for s in states):
            raise ValueError("wan.denoise: one batch must run one expert")
        dit = self.model.expert(expert)
        if any(s.accel is not None for s in states):
            return self._mixed_velocities(states, expert, one_by_one)
        cond = [self._branch(s, s.text) for s in states]
        guided = [s for s in states if s.request.uses_cfg]
        uncond = [self._branch(s, s.negative_text) for s in guided]
        forward = partial(forward_rows, dit)
        if one_by_one or any(s.job.capture is not None and s.job.capture.batch_invariant for s in states):
            forward = one_at_a_time(forward)
        with torch.no_grad():
            cond_preds, uncond_preds = self.cfg_policy.run(forward, cond, uncond)
        uncond_by_state = dict(zip(map(id, guided), uncond_preds))
        out = []
        for s, v in zip(states, cond_preds):
            if id(s) in uncond_by_state:  # (upstream) combined in the transformer's output dtype
                v = cfg_combine(v, uncond_by_state[id(s)], s.request.guidance_for_expert(expert))
            out.append(v)
        return out

    def _mixed_velocities(self, states: Sequence[WanDenoiseState], expert: int, one_by_one: bool) -> list[torch.Tensor]:
        """Requests without accel through the exact path (bitwise as alone), the others through one cached step."""
        exact = [s for s in states if s.accel is None]
        fast = [s for s in states if s.accel is not None]
        by_state = dict(zip(map(id, exact), self.guided_velocities(exact, one_by_one) if exact else []))
        by_state.update(zip(map(id, fast), self.accel_velocities(fast, expert)))
        return [by_state[id(s)] for s in states]

    def accel_velocities(self, states: Sequence[WanDenoiseState], expert: int) -> list[torch.Tensor]:
        """One cached step for requests with accelerations: every request's cond and uncond rows in one batch, each
        row deciding for itself (optimized/accel/stack.py); the decisions are appended to each request's state."""
        dit = self.model.expert(expert)
        inputs, rows = [], []
        for s in states:
            for branch in s.accel.rules:
                inputs.append(self._branch(s, s.text if branch == "cond" else s.negative_text))
                rows.append(AccelRow(s.accel.owner, branch, s.accel.rules[branch], s.step))
        sparse_spec = next((s.accel.spec for s in states if is_sparse(s.accel.spec)), None)
        stack = WanCachedStack(dit, self._sparse_attention(sparse_spec) if sparse_spec is not None else None)
        outputs, decisions = cached_forward(stack, inputs, rows, self.residuals)
        out, i = [], 0
        for s in states:
            n = len(s.accel.rules)
            mine, preds = decisions[i:i + n], outputs[i:i + n]
            s.accel.decisions.extend(mine)
            v = preds[0]
            if n == 2 and preds[1] is not None:  # (upstream) combined in the transformer's output dtype
                v = cfg_combine(v, preds[1], s.request.guidance_for_expert(expert))
            out.append(v)
            i += n
        return out

    @staticmethod
    def _sparse_attention(spec: AccelSpec):
        from optimized.accel.sparse import sparse_self_attention  # written by the sparse-attention work
        return lambda q, k, v, grid, **where: sparse_self_attention(q, k, v, grid, spec, **where)

    def run_step(self, states: Sequence[WanDenoiseState], plans: Sequence[WorkPlan]) -> list[WanDenoiseState]:
        out = []
        dit = self.model.expert(states[0].experts[states[0].step])
        dit.last_step_info = {}  # a forward that does not run the CompileCache (sequence parallel) reports nothing
        velocities = self.guided_velocities(states)
        step_info = dict(dit.last_step_info)
        for p in plans:  # trace.step says how the block stack ran: graph (eager/compiled/replayed), bucket, graph_cache
            p.info.update(step_info)
        for p, s in zip(plans, states):   # trace.step shows what each accelerated request skipped this step
            if s.accel is not None:
                p.info["accel"] = [asdict(d) for d in s.accel.decisions if d.step == s.step]
        for s, v in zip(states, velocities):
            i, logprob, noise = s.step, None, None
            if s.sde is not None:  # one fp32 randn of the latent shape per SDE step, from the request's generator
                noise = torch.randn(s.latents.shape, generator=s.generator, dtype=torch.float32) \
                    if s.sde.is_sde else None
                sde, step = sde_solver.sde_step(s.sde, v, s.latents, noise)
                s = replace(s, sde=sde, latents=step.x_next, step=s.step + 1)
                logprob = step.logprob
            else:
                solver, x = advance(s.solver, v, s.latents)
                s = replace(s, solver=solver, latents=x.to(torch.float32), step=s.step + 1)
            if s.job.record_trajectory:
                s.trajectory = s.trajectory + [s.latents]
            if s.recorder is not None:
                s.recorder = s.recorder.step(i, float(s.timesteps[i]), float(s.sigmas[i]), float(s.sigmas[i + 1]),
                                             logprob is not None, {"vision": logprob}, {"vision": noise},
                                             {"vision": s.latents}, len(states), expert=s.experts[i])
            out.append(s)
        return out

    def step_output(self, s: WanDenoiseState, plan: WorkPlan):
        """A rollout streams each step's capture (kind "rollout.step") as the step's output."""
        return None if s.recorder is None else s.recorder.last

    def is_done(self, s: WanDenoiseState) -> bool:
        return s.step >= len(s.timesteps)

    def finalize(self, s: WanDenoiseState) -> dict:
        x = s.latents
        if self.cfg.expand_timesteps and s.condition is not None:  # (upstream) frame 0 replaced after the loop
            x = (1 - s.first_frame_mask) * s.condition + s.first_frame_mask * x
        out = {"latents": {"vision": x}, "trajectory": list(s.trajectory),
               "timesteps": s.timesteps[: s.step].tolist(), "experts": list(s.experts[: s.step]),
               "initial": s.initial}
        if s.recorder is not None:
            out["behavior"] = s.recorder.record({"vision": x})
        if s.accel is not None:
            out["accel"] = {"label": s.accel.spec.label(), "decisions": list(s.accel.decisions)}
            self.residuals.release(s.accel.owner)
        return out

    def release(self, s: WanDenoiseState) -> None:
        """The request's residuals leave the cache store; the text embeddings stay in the encoder's LRU cache."""
        if s.accel is not None:
            self.residuals.release(s.accel.owner)
