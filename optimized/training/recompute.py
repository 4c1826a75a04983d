"""The trainer's logprob recompute on the engine: from a BehaviorRecord, the request it was made from and the
engine's resident weights, every SDE step's log-probability again.

Batch-invariant mode (the only mode): each step's forwards run one input per call (cond, then uncond), one sample
at a time, in record order, through the same loop kernel code the rollout ran (`guided_velocities`), so the numerics
cannot depend on what else was batched. A rollout captured with `CaptureSpec(batch_invariant=True)` ran the same
way, so in fp32 its logprobs and the recompute's are identical (|delta| = 0.0, ratio exactly 1), step 0 included.

The sample's logprob over several stepped modalities (`Recompute.logprob`) is the record's definition,
`records.sample_logprob` (the element-weighted mean), weighted by the element counts of the latents scored here.

Tables: the sigma / timestep tables are rebuilt from the request (the schedule is the request's, not the record's);
a record whose tables differ is reported (`table_mismatch`), and the logprobs use the rebuilt tables.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from optimized.solvers import sde as sde_solver
from optimized.training.records import BehaviorRecord, element_counts, request_hash, sample_logprob


@dataclass
class Recompute:
    logprobs: dict[str, torch.Tensor]        # modality -> fp32 [N], NaN on ODE steps
    numel: dict[str, int]                    # modality -> element count of the latents it scored
    weights_version: str
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    table_mismatch: str | None = None        # how the record's tables differ from the request's, if they do

    @property
    def logprob(self) -> torch.Tensor:
        """The sample's per-step logprob: `sample_logprob` (the record's definition), weighted by the element
        counts of the latents this recompute scored (not the record's own counts)."""
        return sample_logprob(self.logprobs, self.numel)


@contextlib.contextmanager
def cache_use(model: Any, enabled: bool) -> Iterator[None]:
    """Turn the instance's prompt caches (cosmos3 und K/V, wan text embeddings) on or off for a while."""
    holders = [(model, "use_und_cache")] if hasattr(model, "use_und_cache") else []
    enc = getattr(model, "text_encoder", None)
    if enc is not None and hasattr(enc, "use_cache"):
        holders.append((enc, "use_cache"))
    saved = [getattr(o, a) for o, a in holders]
    for o, a in holders:
        setattr(o, a, enabled)
    try:
        yield
    finally:
        for (o, a), v in zip(holders, saved):
            setattr(o, a, v)


def _tables_differ(record: BehaviorRecord, sigmas: torch.Tensor, timesteps: torch.Tensor) -> str | None:
    rs, rt = record.sigmas, record.timesteps
    if rs.shape != sigmas.shape or not torch.equal(rs, sigmas.to(rs)):
        return f"sigma table {rs.tolist()} vs the request's {sigmas.tolist()}"
    if rt.shape != timesteps.shape or not torch.equal(rt.to(torch.float64), timesteps.to(torch.float64)):
        return f"timesteps {rt.tolist()} vs the request's {timesteps.tolist()}"
    return None


def recompute_logprobs(engine: Any, record: BehaviorRecord, request: Any, use_cache: bool = True) -> Recompute:
    """Every SDE step's logprob of `record` (which must hold per-step latents) under the engine's weights."""
    if record.request_hash != request_hash(request):
        raise ValueError("recompute: the request is not the one the record was made from (request hash differs)")
    if getattr(request, "sde", None) is None:
        raise ValueError("recompute: the request has no SDE settings (an ODE rollout has no logprobs)")
    if not record.latents:
        raise ValueError("recompute: the record holds no per-step latents (capture with CaptureSpec(latents=True))")
    name = engine.family.loop_for(request)
    loop = engine.loop(name)
    with cache_use(engine.model, use_cache):  # init_state encodes the prompts (wan): inside, too
        state = loop.init_state(engine.family.make_job(name, request))
    device = engine.model.device
    sigmas = state.sde.sigmas
    timesteps = torch.as_tensor(state.timesteps)
    n = len(state.timesteps)
    out = {m: torch.full((n,), float("nan")) for m in record.modalities}
    try:
        with cache_use(engine.model, use_cache):
            for i in range(n):
                sde = replace(state.sde, index=i)
                if not sde.is_sde:
                    continue
                x_in = {m: t.to(device) for m, t in record.latents_at(i).items()}
                x_out = {m: t.to(device) for m, t in record.latents_at(i + 1).items()}
                lat = x_in if isinstance(state.latents, dict) else x_in["vision"]
                step_state = replace(state, latents=lat, step=i, sde=sde)
                v = loop.guided_velocities([step_state], one_by_one=True)[0]
                v = v if isinstance(v, dict) else {"vision": v}
                for m in record.modalities:
                    out[m][i] = sde_solver.step_logprob(sde, v[m], x_in[m], x_out[m]).cpu()
    finally:
        loop.release(state)
    return Recompute(out, element_counts(record.latents_at(0)), str(engine.model.weights_version), sigmas.cpu(),
                     timesteps.cpu(), _tables_differ(record, sigmas.cpu(), timesteps.cpu()))


@dataclass
class LogprobDelta:
    """Rollout vs recompute, per SDE step: |delta logp| and the importance ratio exp(recompute - rollout)."""
    steps: list[int]
    abs_delta: list[float]
    ratio: list[float]

    @property
    def mean_abs(self) -> float:
        return sum(self.abs_delta) / max(len(self.abs_delta), 1)

    @property
    def max_abs(self) -> float:
        return max(self.abs_delta, default=0.0)


def logprob_delta(rollout: torch.Tensor, recompute: torch.Tensor) -> LogprobDelta:
    steps = [i for i in range(len(rollout)) if not torch.isnan(rollout[i])]
    d = [(recompute[i].double() - rollout[i].double()).item() for i in steps]
    return LogprobDelta(steps, [abs(x) if x == x else float("inf") for x in d],
                        [float(torch.exp(torch.tensor(x, dtype=torch.float64))) for x in d])
