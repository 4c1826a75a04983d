"""cosmos3 flow denoising as a LoopKernel: the runtime owns the loop, this file owns one step.

One step for a batch of requests (any mix of step indices, seeds, guidance scales, shapes and modalities):
build every request's cond (and uncond) forward inputs, run them through the CFG policy as one or two batched
varlen forwards, mask and combine the velocities in fp32, advance each request's own UniPC state.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

import torch

from manifests.accel import AccelDecision, AccelSpec
from manifests.cosmos3.io import Cosmos3ForwardInputs, Cosmos3Prediction
from manifests.cosmos3.sampling import Cosmos3GenerateRequest
from optimized.accel.residual import ResidualCache, ResidualOwner
from optimized.accel.rules import BranchRule, make_rule
from optimized.accel.stack import AccelRow, cached_forward
from optimized.models.cosmos3.model import Cosmos3CachedStack, Cosmos3Fast, unflatten_prediction
from optimized.models.cosmos3.spec import TRANSFORMER
from optimized.runtime.cache import CacheKey
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan, per_rank_share
from optimized.solvers import sde as sde_solver
from optimized.solvers import unipc
from optimized.solvers.guidance import CFGPolicy, cfg_combine
from optimized.solvers.policies import make_policy
from optimized.training.records import BehaviorRecorder, CaptureSpec, behavior_header, one_at_a_time

MODALITIES = ("vision", "sound", "action")
_REQUEST_TOKENS = itertools.count()


@dataclass
class Cosmos3AccelState:
    """One request's acceleration: its rule per CFG branch, whose residuals it owns, every decision so far."""
    spec: AccelSpec
    owner: ResidualOwner
    rules: dict[str, BranchRule]                    # "cond" / "uncond" -> the branch's own rule
    decisions: list[AccelDecision] = field(default_factory=list)


@dataclass(frozen=True)
class DenoiseJob:
    request: Cosmos3GenerateRequest
    record_trajectory: bool = False
    capture: CaptureSpec | None = None             # RL rollout: keep a BehaviorRecord (result["behavior"])


@dataclass
class DenoiseState:
    job: DenoiseJob
    timesteps: list[int]
    latents: dict[str, torch.Tensor]               # current fp32 latents per modality present
    solvers: dict[str, unipc.UniPCState]           # one UniPC state per modality, owned by this request
    vision_keep: torch.Tensor                       # [T, 1, 1]: 1 on noisy frames, 0 on conditioned ones
    action_keep: torch.Tensor | None                # [chunk, 1]
    und_keys: tuple[CacheKey, ...] = ()
    step: int = 0
    trajectory: list[dict[str, torch.Tensor]] = field(default_factory=list)
    initial: dict[str, torch.Tensor] | None = None  # kept only when recording the trajectory
    sde: sde_solver.SDEState | None = None          # SDE rollout steps (request.sde) instead of UniPC
    generator: torch.Generator | None = None        # the request's own generator (SDE step noise comes from it)
    recorder: BehaviorRecorder | None = None        # behavior capture (job.capture)
    accel: Cosmos3AccelState | None = None          # request.accel: the step caches' rules and decisions

    @property
    def request(self) -> Cosmos3GenerateRequest:
        return self.job.request


def advance(solver: unipc.UniPCState, velocity: torch.Tensor, x: torch.Tensor):
    """One UniPC step of one modality of one request."""
    return unipc.unipc_step(solver, velocity, x)


# ------------------------------------------------------------------------------------------------
# The loop kernel
# ------------------------------------------------------------------------------------------------

class FlowDenoiseLoop(LoopKernel[DenoiseState]):
    loop_id = "cosmos3.denoise"

    def __init__(self, fast: Cosmos3Fast, cfg_policy: CFGPolicy | str = "batched"):
        self.fast = fast
        self.cfg_policy = make_policy(cfg_policy)
        self.und_refcount: dict[CacheKey, int] = {}
        self.residuals = ResidualCache()              # the step caches' residuals (optimized/accel/residual.py)

    # ---- request -> state
    def init_state(self, job: DenoiseJob | Cosmos3GenerateRequest) -> DenoiseState:
        job = job if isinstance(job, DenoiseJob) else DenoiseJob(job)
        cfg, req = self.fast.cfg, job.request
        try:
            req.validate(cfg)
            self.cfg_policy.check(req.uses_cfg, req.guidance_scale)
        except ValueError as e:  # ManifestError included
            raise ValueError(str(e)) from None
        gen = torch.Generator().manual_seed(req.seed) if req.seed is not None else None
        latents, vision_keep, action_keep = self._initial_latents(req, gen)
        solvers, timesteps = {}, None
        for m in latents:
            solvers[m], timesteps = unipc.new_state(req.scheduler, req.num_steps)
        sde = sde_solver.new_sde_state(req.sde, solvers["vision"].sigmas) if req.sde is not None else None
        texts = [req.text_ids] + ([req.negative_text_ids] if req.uses_cfg else [])
        keys = tuple(self.fast.und_cache_key(t) for t in texts)
        for k in keys:
            self.und_refcount[k] = self.und_refcount.get(k, 0) + 1
        initial = {m: t.clone() for m, t in latents.items()} if job.record_trajectory else None
        recorder = None
        if job.capture is not None:
            stepped = {m: t for m, t in latents.items() if m != "action" or bool((action_keep > 0).any())}
            header = behavior_header("cosmos3", self.loop_id, req, self.fast, self.cfg_policy.name, "unipc",
                                     solvers["vision"].sigmas, timesteps, keys, job.capture)
            recorder = BehaviorRecorder.start(job.capture, header, stepped, len(timesteps))
        accel = self._accel_state(job, latents) if req.accel is not None else None
        return DenoiseState(job, timesteps.tolist(), latents, solvers, vision_keep, action_keep, und_keys=keys,
                            initial=initial, sde=sde, generator=gen, recorder=recorder, accel=accel)

    def _accel_state(self, job: DenoiseJob, latents: dict[str, torch.Tensor]) -> Cosmos3AccelState:
        """The request's rules per branch; refusals (one clear message) for what the accelerated step cannot run."""
        req = job.request
        if job.capture is not None and job.capture.batch_invariant:
            raise ValueError("cosmos3 request: accel with a batch-invariant capture is not supported (the cached "
                             "step batches its rows)")
        if self.layout() is not None or self.fast.sequence_parallel is not None or self.fast.tp is not None \
                or self.cfg_policy.name != "batched":
            raise ValueError("cosmos3 request: accel runs on a single device with the batched CFG policy "
                             f"(this loop: policy {self.cfg_policy.name}, plan {self.layout()})")
        branches = ("cond", "uncond") if req.uses_cfg else ("cond",)
        try:
            rules = {b: make_rule(req.accel, b, req.num_steps, self.fast.cfg.num_layers) for b in branches}
        except ValueError as e:
            raise ValueError(f"cosmos3 request: {e}") from None
        shape = ";".join(f"{m}={'x'.join(map(str, t.shape))}" for m, t in latents.items())
        owner = ResidualOwner(request=f"cosmos3-{next(_REQUEST_TOKENS)}", model_id="cosmos3",
                              component_id=TRANSFORMER, weights_version=self.fast.weights_version,
                              precision=str(self.fast.dtype), shape_signature=shape, spec=req.accel)
        return Cosmos3AccelState(req.accel, owner, rules)

    def _initial_latents(self, req: Cosmos3GenerateRequest, g: torch.Generator | None):
        cfg = self.fast.cfg
        T, H, W = req.latent_frames, req.latent_height, req.latent_width
        keep = torch.ones(T, 1, 1)
        keep[list(req.vision_condition_frames)] = 0.0
        out: dict[str, torch.Tensor] = {}
        # draw order is upstream's: vision, sound, action, each only when not given explicitly
        if req.noise_vision is not None:
            out["vision"] = req.noise_vision.float().clone()  # explicit latents are taken as already mixed
        else:
            noise = torch.randn(1, cfg.latent_channels, T, H, W, generator=g)
            clean = req.condition_latents.float() if req.condition_latents is not None else torch.zeros_like(noise)
            out["vision"] = (1.0 - keep) * clean + keep * noise
        if req.sound_frames:
            out["sound"] = req.noise_sound.float().clone() if req.noise_sound is not None else \
                torch.randn(cfg.sound_dim, req.sound_frames, generator=g)
        action_keep = None
        if req.action is not None:
            a = req.action
            given = a.mode == "forward_dynamics"
            action_keep = torch.full((a.chunk_size, 1), 0.0 if given else 1.0)
            if req.noise_action is not None:
                out["action"] = req.noise_action.float().clone()
            else:
                noise = torch.randn(a.chunk_size, cfg.action_dim, generator=g)
                clean = torch.zeros_like(noise)
                if given:
                    rows = a.raw_actions.float()
                    idx = torch.arange(a.chunk_size).clamp(max=rows.shape[0] - 1)  # repeat the last action
                    clean[:, : rows.shape[1]] = rows[idx]
                out["action"] = (1.0 - action_keep) * clean + action_keep * noise
                if a.raw_action_dim is not None:
                    out["action"][:, a.raw_action_dim:] = 0
        return out, keep, action_keep

    # ---- planning (pure)
    def layout(self):
        """The parallel plan attached to the model (`parallelize`), or None in one process."""
        mesh = getattr(self.fast, "parallel_mesh", None)
        return getattr(mesh, "plan", mesh)

    def _gen_tokens(self, req: Cosmos3GenerateRequest) -> int:
        """Gen-stream tokens of one sample (vision | sound | action), as packing.pack_layout lays them out."""
        p = self.fast.cfg.patch_size
        return req.latent_frames * math.ceil(req.latent_height / p) * math.ceil(req.latent_width / p) + \
            req.sound_frames + (req.action.chunk_size if req.action else 0)

    def plan_step(self, s: DenoiseState) -> WorkPlan:
        """Per rank under a plan (every rank plans the same steps): cfgp splits the CFG branches, ulysses x ring
        the gen tokens (the und text stream runs whole on every rank; the last hidden state is gathered whole)."""
        cfg, req = self.fast.cfg, s.request
        texts = [req.text_ids.numel()] + ([req.negative_text_ids.numel()] if req.uses_cfg else [])
        gen = self._gen_tokens(req)
        tokens, branches = texts[0] + gen, len(texts)
        lay = self.layout()
        cfgp, sp = (lay.cfgp, lay.sp_ulysses * lay.sp_ring) if lay is not None else (1, 1)
        rank_branches, rank_tokens = per_rank_share(branches, cfgp), texts[0] + per_rank_share(gen, sp)
        params_per_token = cfg.num_layers * (4 * cfg.hidden_size ** 2 + 3 * cfg.hidden_size * cfg.intermediate_size)
        act_bytes = rank_tokens * rank_branches * cfg.hidden_size * 4 * 8
        if sp > 1:
            act_bytes += rank_branches * gen * cfg.hidden_size * 4   # the last hidden state, all-gathered whole
        # the step body's shape bucket: padded text keys of each branch, padded gen rows, this request's rows on
        # this rank (a batch's bucket is the max of its members' pads and the sum of their rows)
        buckets = self.fast.buckets
        gen_pad = buckets.pad("gen", gen)
        bucket = f"text={'/'.join(str(buckets.pad('text', n)) for n in texts)};gen={gen_pad};rows={rank_branches}"
        if sp > 1:
            bucket += f";sp_rows={per_rank_share(gen_pad, sp)}"   # padded to a multiple of ulysses x ring, split
        return WorkPlan(
            request_id="", loop_id=self.loop_id, phase="denoise_step", step_index=s.step,
            batch_key=(id(self.fast), str(self.fast.dtype), str(self.fast.device), self.cfg_policy.name),
            resources=ResourceRequest(device_bytes=act_bytes,
                                      cost_seconds=2 * rank_tokens * rank_branches * params_per_token / 5e10),
            cache_reads=s.und_keys,
            shape_signature=f"tokens={tokens};branches={branches}",
            parallel_plan_hash=lay.hash() if lay is not None else self.cfg_policy.layout_hash(),
            graph_bucket=bucket,
            info={"timestep": s.timesteps[s.step], "guidance": req.guidance_scale})

    def admission(self, s: DenoiseState) -> ResourceRequest:
        """Held for the request's life, per rank: latents + solver history (whole on every rank: cfgp gathers the
        predictions, SP the hidden state) and the text K/V of every branch (each rank may run every branch: whole
        under cfgp) with only this rank's KV heads under tp and ulysses (parallelize.py `shard_und`: the GQA
        replication rule keeps max(K, u) / u heads)."""
        cfg = self.fast.cfg
        latent_bytes = sum(t.numel() * 4 for t in s.latents.values()) * 4  # latents + solver history
        texts = [s.request.text_ids] + ([s.request.negative_text_ids] if s.request.uses_cfg else [])
        elem = torch.finfo(self.fast.dtype).bits // 8
        lay = self.layout()
        u = lay.sp_ulysses if lay is not None else 1
        kv_heads = max(self.fast.num_kv_heads, u) // u   # this rank's KV heads (tp.py shards them under tp)
        kv_bytes = sum(2 * cfg.num_layers * t.numel() * kv_heads * cfg.head_dim * elem for t in texts)
        return ResourceRequest(device_bytes=latent_bytes + kv_bytes)

    # ---- the step body
    def _inputs(self, s: DenoiseState, text_ids: torch.Tensor, timestep: int) -> Cosmos3ForwardInputs:
        req, dt = s.request, self.fast.dtype
        a = req.action
        lat = s.latents
        return Cosmos3ForwardInputs(
            text_ids=text_ids, vision_latents=lat["vision"].to(dt), timestep=timestep, fps_vision=req.fps,
            vision_condition_frames=req.vision_condition_frames,
            sound_latents=lat["sound"].to(dt) if "sound" in lat else None,
            fps_sound=float(self.fast.cfg.sound_latent_fps) if "sound" in lat else None,
            action_latents=lat["action"].to(dt) if "action" in lat else None,
            action_condition_rows=tuple(range(a.chunk_size)) if a is not None and a.mode == "forward_dynamics" else (),
            action_domain_id=a.domain_id if a is not None else None)

    def _velocities(self, s: DenoiseState, pred: Cosmos3Prediction) -> dict[str, torch.Tensor]:
        v = {"vision": (pred.vision * s.vision_keep).float()}
        if "sound" in s.latents:
            v["sound"] = pred.sound.float()
        if "action" in s.latents:
            v["action"] = (pred.action * s.action_keep).float()
            if s.request.action.raw_action_dim is not None:
                v["action"][:, s.request.action.raw_action_dim:] = 0
        return v

    def guided_velocities(self, states: Sequence[DenoiseState], one_by_one: bool = False
                          ) -> list[dict[str, torch.Tensor]]:
        """Every state's fp32 velocities at its current step (masked, CFG-combined), from one or two batched
        forwards; one forward per input, in order, when `one_by_one` or a request asks for batch invariance.
        Requests with an acceleration take the cached step (`accel_velocities`); the others this exact path."""
        if any(s.accel is not None for s in states):
            exact = [s for s in states if s.accel is None]
            fast = [s for s in states if s.accel is not None]
            by_state = dict(zip(map(id, exact), self.guided_velocities(exact, one_by_one) if exact else []))
            by_state.update(zip(map(id, fast), self.accel_velocities(fast)))
            if not exact:   # the cached step runs its layers eagerly, segment by segment
                self.fast.last_step_info = {"graph": "eager", "bucket": "accel", "graph_cache": "accel"}
            return [by_state[id(s)] for s in states]
        cond = [self._inputs(s, s.request.text_ids, s.timesteps[s.step]) for s in states]
        guided = [s for s in states if s.request.uses_cfg]
        uncond = [self._inputs(s, s.request.negative_text_ids, s.timesteps[s.step]) for s in guided]
        forward = self.fast.forward_batch
        if one_by_one or any(s.job.capture is not None and s.job.capture.batch_invariant for s in states):
            forward = one_at_a_time(forward)
        with torch.no_grad():
            cond_preds, uncond_preds = self.cfg_policy.run(forward, cond, uncond)
        uncond_by_state = dict(zip(map(id, guided), uncond_preds))
        out = []
        for s, pc in zip(states, cond_preds):
            v = self._velocities(s, pc)
            if id(s) in uncond_by_state:
                vu = self._velocities(s, uncond_by_state[id(s)])
                v = {m: cfg_combine(v[m], vu[m], s.request.guidance_scale) for m in v}
            out.append(v)
        return out

    def accel_velocities(self, states: Sequence[DenoiseState]) -> list[dict[str, torch.Tensor]]:
        """One cached step per group of same-shape requests (their outputs flatten to one length and their gen
        stream pads the same every step): every request's cond and uncond rows in one batch, each row deciding for
        itself (optimized/accel/stack.py); the decisions are appended to each request's state."""
        groups: dict[tuple, list[DenoiseState]] = {}
        for s in states:
            shapes = tuple((m, tuple(t.shape)) for m, t in s.latents.items())
            groups.setdefault((self._gen_tokens(s.request), shapes), []).append(s)
        by_state: dict[int, dict[str, torch.Tensor]] = {}
        for group in groups.values():
            inputs, rows = [], []
            for s in group:
                for branch in s.accel.rules:
                    ids = s.request.text_ids if branch == "cond" else s.request.negative_text_ids
                    inputs.append(self._inputs(s, ids, s.timesteps[s.step]))
                    rows.append(AccelRow(s.accel.owner, branch, s.accel.rules[branch], s.step))
            outputs, decisions = cached_forward(Cosmos3CachedStack(self.fast), inputs, rows, self.residuals)
            i = 0
            for s in group:
                n = len(s.accel.rules)
                s.accel.decisions.extend(decisions[i:i + n])
                like = {m: self._output_shape(s, m) for m in s.latents}
                preds = [None if o is None else unflatten_prediction(o, like) for o in outputs[i:i + n]]
                v = self._velocities(s, preds[0])
                if n == 2 and preds[1] is not None:   # a skipped uncond branch (guidance interval): cond alone
                    vu = self._velocities(s, preds[1])
                    v = {m: cfg_combine(v[m], vu[m], s.request.guidance_scale) for m in v}
                by_state[id(s)] = v
                i += n
        return [by_state[id(s)] for s in states]

    @staticmethod
    def _output_shape(s: DenoiseState, m: str) -> torch.Size:
        """The model's prediction shape of modality m (the latents' shape: vision [1, C, T, H, W], sound [S, T_s],
        action [chunk, A])."""
        return s.latents[m].shape

    def _sde_advance(self, s: DenoiseState, v: dict[str, torch.Tensor]):
        """One SDE (or windowed-ODE) step of every stepped modality; noise drawn in order vision, sound, action
        from the request's generator. Returns (latents, sde state, logprobs, noise) by modality."""
        latents, logprobs, noise, new_sde = dict(s.latents), {}, {}, s.sde
        for m in MODALITIES:
            if m not in latents or (m == "action" and not bool((s.action_keep > 0).any())):
                continue
            draw = torch.randn(latents[m].shape, generator=s.generator, dtype=torch.float32) if s.sde.is_sde \
                else None
            zero_from = s.request.action.raw_action_dim if m == "action" else None
            new_sde, out = sde_solver.sde_step(s.sde, v[m], latents[m], draw, zero_from)
            latents[m], logprobs[m], noise[m] = out.x_next, out.logprob, draw
        return latents, new_sde, logprobs, noise

    def run_step(self, states: Sequence[DenoiseState], plans: Sequence[WorkPlan]) -> list[DenoiseState]:
        out = []
        velocities = self.guided_velocities(states)
        for p in plans:  # trace.step says how the body ran: graph (eager/compiled/replayed), bucket, graph_cache
            p.info.update(self.fast.last_step_info)
        for p, s in zip(plans, states):   # trace.step shows what each accelerated request skipped this step
            if s.accel is not None:
                p.info["accel"] = [asdict(d) for d in s.accel.decisions if d.step == s.step]
        for s, v in zip(states, velocities):
            if s.sde is not None:
                latents, sde, logprobs, noise = self._sde_advance(s, v)
                s = replace(s, latents=latents, sde=sde, step=s.step + 1)
                if s.job.record_trajectory:
                    s.trajectory = s.trajectory + [{m: t.clone() for m, t in latents.items()}]
                if s.recorder is not None:
                    i = s.step - 1
                    s.recorder = s.recorder.step(i, float(s.timesteps[i]), float(sde.sigmas[i]),
                                                 float(sde.sigmas[i + 1]), i in s.recorder.header["sde_steps"],
                                                 logprobs, noise, latents, len(states))
                out.append(s)
                continue
            latents, solvers = dict(s.latents), dict(s.solvers)
            for m in latents:
                if m == "action" and not bool((s.action_keep > 0).any()):
                    continue  # no noisy action row: the action latents are not stepped (upstream)
                solvers[m], latents[m] = advance(solvers[m], v[m], latents[m])
                if m == "action" and s.request.action.raw_action_dim is not None:
                    latents[m][:, s.request.action.raw_action_dim:] = 0  # padded channels re-zeroed every step
            s = replace(s, latents=latents, solvers=solvers, step=s.step + 1)
            if s.job.record_trajectory:
                s.trajectory = s.trajectory + [{m: t.clone() for m, t in latents.items()}]
            if s.recorder is not None:  # an ODE rollout: tables, seeds and latents, no logprobs
                i, sig = s.step - 1, s.solvers["vision"].sigmas
                s.recorder = s.recorder.step(i, float(s.timesteps[i]), float(sig[i]), float(sig[i + 1]), False, {},
                                             {}, latents, len(states))
            out.append(s)
        return out

    def step_output(self, s: DenoiseState, plan: WorkPlan):
        """A rollout streams each step's capture (kind "rollout.step") as the step's output."""
        return None if s.recorder is None else s.recorder.last

    def is_done(self, s: DenoiseState) -> bool:
        return s.step >= len(s.timesteps)

    def finalize(self, s: DenoiseState) -> dict:
        out = {"latents": dict(s.latents), "trajectory": s.trajectory, "initial": s.initial,
               "timesteps": s.timesteps[: s.step]}
        if s.recorder is not None:
            out["behavior"] = s.recorder.record(s.latents)
        if s.accel is not None:
            out["accel"] = {"label": s.accel.spec.label(), "decisions": list(s.accel.decisions)}
            self.residuals.release(s.accel.owner)
        return out

    def release(self, s: DenoiseState) -> None:
        """Drop this request's hold on its und-stream cache entries. A cancelled (or failed) request's entries
        that no live request uses are evicted now; a completed request's stay in the LRU store for reuse."""
        finished = self.is_done(s)
        if s.accel is not None:   # the request's residuals leave the cache store
            self.residuals.release(s.accel.owner)
        for k in s.und_keys:
            n = self.und_refcount.get(k, 0) - 1
            if n <= 0:
                self.und_refcount.pop(k, None)
                if not finished:
                    self.fast.und_cache.evict(k)
            else:
                self.und_refcount[k] = n
        s.und_keys = ()
