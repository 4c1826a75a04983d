"""BehaviorRecord: what one rollout did, captured by the serving loop itself while it ran (never reconstructed).

A loop whose job carries a `CaptureSpec` keeps a `BehaviorRecorder` in the request's state, fills it at
`init_state` (tables, seeds, versions, cache keys) and at every step (logprobs, noise, latents, batch size), and
returns `recorder.record()` in its result under "behavior". Every step also streams a `RolloutStep` (kind
"rollout.step") as the step's output.

On disk (`save` / `load`): one directory, written atomically (a temporary sibling renamed into place):
    record.json          every scalar field, the tensor names, format_version
    tensors.safetensors  sigmas, timesteps, logprobs.<modality>, noise.<modality>.<step>, latents.<modality>.<i>
Tensor naming: logprobs.<m> is fp32 [N] (NaN on ODE steps); noise.<m>.<i> the standard-normal draw of SDE step i;
latents.<m>.<i> the latents entering step i (i = 0..N, N = after the last step) when captured.
The sample's logprob (`BehaviorRecord.logprob`) is derived, never stored: `sample_logprob` of the per-modality
logprobs weighted by extra["numel"] (each modality's element count; extra["logprob_reduction"] names the rule).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from manifests.solvers import SAMPLE_LOGPROB_REDUCTION
from optimized.runtime.cache import content_hash

FORMAT_VERSION = 1
ROLLOUT_STEP = "rollout.step"
NOISE_ORDER = ("one CPU torch.Generator seeded with `seed`: the initial latents first (vision, sound, action; each "
               "only when not given explicitly), then for every SDE step in step order one fp32 randn per stepped "
               "modality (vision, sound, action) of that modality's latent shape; ODE steps draw nothing")


@dataclass(frozen=True)
class CaptureSpec:
    """What a rollout keeps. Small by default: no per-step latents (initial and final latents are hashed)."""
    latents: bool = False          # every step's latents in/out (what the trainer's recompute needs)
    noise: bool = True             # the standard-normal draw of every SDE step
    batch_invariant: bool = False  # run this request's forwards one sample at a time, in a fixed order


@dataclass(frozen=True)
class RolloutStep:
    """A streamed step of a rollout (the payload of the step's `request.output` event)."""
    kind: str
    step: int
    timestep: float
    sigma: float
    sigma_next: float
    sde: bool
    logprobs: dict[str, float]
    batch_size: int
    weights_version: str


def _feed(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(content_hash(value).encode())
    elif is_dataclass(value) and not isinstance(value, type):
        h.update(type(value).__name__.encode())
        for f in fields(value):
            h.update(f.name.encode())
            _feed(h, getattr(value, f.name))
    elif isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__}{len(value)}".encode())
        for v in value:
            _feed(h, v)
    else:
        h.update(repr(value).encode())


def request_hash(request: Any) -> str:
    """A content hash of a request (dataclasses field by field, tensors by content): the request's id."""
    h = hashlib.sha256()
    _feed(h, request)
    return "sha256:" + h.hexdigest()[:32]


def one_at_a_time(forward_batch):
    """Batch-invariant execution: the same forward, one input per call, in the given order."""
    return lambda inputs: [pred for x in inputs for pred in forward_batch([x])]


def behavior_header(family: str, loop_id: str, request: Any, model: Any, cfg_policy: str, solver: str,
                    sigmas: torch.Tensor, timesteps: torch.Tensor, cache_keys, capture: "CaptureSpec") -> dict:
    """The BehaviorRecord fields a loop knows at init_state."""
    n = int(timesteps.numel())
    sde = getattr(request, "sde", None)
    prompts = {"text": tensor_hash(request.text_ids)}
    if request.uses_cfg:
        prompts["negative_text"] = tensor_hash(request.negative_text_ids)
    return dict(family=family, loop_id=loop_id, request_hash=request_hash(request), prompt_hashes=prompts,
                weights_version=str(model.weights_version), seed=request.seed, noise_order=NOISE_ORDER,
                solver=solver, sde=sde_fields(sde), sigmas=sigmas.detach().to("cpu", torch.float32).clone(),
                timesteps=timesteps.detach().to("cpu").clone(),
                sde_steps=[i for i in range(n) if sde is not None and sde.is_sde_step(i, n)],
                guidance_scale=float(request.guidance_scale), uses_cfg=bool(request.uses_cfg), cfg_policy=cfg_policy,
                cache_keys=[k.short() for k in cache_keys], dtype=str(model.dtype).replace("torch.", ""),
                device=str(model.device), graph_mode="eager", parallel_plan=None,
                batch_invariant=capture.batch_invariant)


def tensor_hash(t: torch.Tensor | None) -> str | None:
    return None if t is None else "sha256:" + content_hash(t)[:32]


def element_counts(latents: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each stepped modality's element count: its weight in the sample's logprob (module-level so a negative
    control can plant a wrong weighting)."""
    return {m: int(t.numel()) for m, t in latents.items()}


def sample_logprob(logprobs: dict[str, torch.Tensor], numel: dict[str, int]) -> torch.Tensor:
    """The per-step log-probability of a whole sample over its stepped modalities, fp32 [N] (NaN on ODE steps):
    the element-weighted mean sum_m n_m lp_m / sum_m n_m (manifests.solvers.SAMPLE_LOGPROB_REDUCTION).

    Why this one: each per-modality value lp_m is the Gaussian log-density of that modality's drawn next latents
    averaged over its n_m elements, so n_m lp_m is the modality's log-density. One SDE step draws every modality
    independently given the same velocity forward, so the joint log-density of the step is sum_m n_m lp_m, and per
    element of the whole sample (the per-element convention of every logprob here, which keeps a GRPO / PPO ratio
    exp(logp_new - logp_old) on the same scale at any latent size) it is the element-weighted mean. A plain mean
    over modalities is the density of nothing: it weighs a modality's elements by 1 / n_m, so a longer sound clip
    would count for less. A vision-only sample's value is its vision logprob exactly.

    The one definition on this side: the record, the recompute and C2 all call it (in fp64, returned as fp32)."""
    missing = [m for m in logprobs if m not in numel]
    if missing:
        raise ValueError(f"sample_logprob: no element count for modalities {missing}")
    total = sum(numel[m] for m in logprobs)
    joint = sum(logprobs[m].to(torch.float64) * numel[m] for m in logprobs)
    return (joint / total).to(torch.float32)


@dataclass
class BehaviorRecord:
    family: str
    loop_id: str
    request_hash: str                       # content hash of the whole request
    prompt_hashes: dict[str, str]           # "text" / "negative_text" -> content hash of the token ids
    weights_version: str
    seed: int | None
    noise_order: str                        # how the request's generator is consumed
    solver: str                             # the ODE solver whose tables are used ("unipc" | "euler")
    sde: dict | None                        # SDEConfig fields, None for an ODE rollout
    sigmas: torch.Tensor                    # fp32 [N + 1]
    timesteps: torch.Tensor                 # [N] exactly as the model saw them
    sde_steps: list[int]
    modalities: list[str]                   # stepped modalities, in noise-draw order
    logprobs: dict[str, torch.Tensor]       # modality -> fp32 [N], NaN on ODE steps
    guidance_scale: float
    uses_cfg: bool
    cfg_policy: str
    cache_keys: list[str]                   # short ids of the cache entries the request read
    dtype: str
    device: str
    graph_mode: str = "eager"
    parallel_plan: str | None = None        # None: one device
    batch_invariant: bool = False
    request_id: str | None = None           # the scheduler's id (filled in by the rollout driver)
    batch_sizes: list[int] = field(default_factory=list)   # how many requests shared each step's forward
    experts: list[int] = field(default_factory=list)       # wan: the expert of each step
    initial_hashes: dict[str, str] = field(default_factory=dict)
    final_hashes: dict[str, str] = field(default_factory=dict)
    noise: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)   # modality -> SDE step -> draw
    latents: dict[str, list[torch.Tensor]] = field(default_factory=dict)      # modality -> N + 1 latents
    extra: dict = field(default_factory=dict)

    # ---- derived
    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())

    @property
    def logprob(self) -> torch.Tensor:
        """The per-step log-probability of the whole sample (`sample_logprob`: the element-weighted mean over the
        stepped modalities, weighted by the element counts captured at init_state)."""
        if "numel" not in self.extra:
            raise ValueError("this record holds no per-modality element counts (extra['numel'])")
        return sample_logprob({m: self.logprobs[m] for m in self.modalities}, self.extra["numel"])

    def latents_at(self, i: int) -> dict[str, torch.Tensor]:
        if not self.latents:
            raise ValueError("this record holds no per-step latents (capture them with CaptureSpec(latents=True))")
        return {m: self.latents[m][i] for m in self.modalities}

    # ---- (de)serialisation
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"sigmas": self.sigmas, "timesteps": self.timesteps}
        for m, lp in self.logprobs.items():
            out[f"logprobs.{m}"] = lp
        for m, draws in self.noise.items():
            for i, t in draws.items():
                out[f"noise.{m}.{i}"] = t
        for m, xs in self.latents.items():
            for i, t in enumerate(xs):
                out[f"latents.{m}.{i}"] = t
        return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}

    def meta(self) -> dict:
        tensor_fields = {"sigmas", "timesteps", "logprobs", "noise", "latents"}
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in tensor_fields}
        doc["format_version"] = FORMAT_VERSION
        return json.loads(json.dumps(doc))  # refuses anything that is not plain JSON

    def save(self, path: str | Path) -> Path:
        """Write `path/` (record.json + tensors.safetensors) atomically; an existing record there is replaced."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            tensors = self.tensors()
            save_file(tensors, str(tmp / "tensors.safetensors"))
            meta = self.meta()
            meta["tensor_names"] = sorted(tensors)
            (tmp / "record.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            if path.exists():
                old = path.with_name(f".{path.name}.old")
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path) -> "BehaviorRecord":
        path = Path(path)
        meta = json.loads((path / "record.json").read_text())
        if meta.pop("format_version", None) != FORMAT_VERSION:
            raise ValueError(f"{path}: not a BehaviorRecord of format version {FORMAT_VERSION}")
        names = meta.pop("tensor_names")
        tensors = load_file(str(path / "tensors.safetensors"))
        if sorted(tensors) != names:
            raise ValueError(f"{path}: tensors.safetensors does not hold the tensors record.json names")
        logprobs = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("logprobs.")}
        noise: dict[str, dict[int, torch.Tensor]] = {}
        latents: dict[str, dict[int, torch.Tensor]] = {}
        for k, v in tensors.items():
            kind, *rest = k.split(".")
            if kind in ("noise", "latents"):
                m, i = ".".join(rest[:-1]), int(rest[-1])
                (noise if kind == "noise" else latents).setdefault(m, {})[i] = v
        return cls(**meta, sigmas=tensors["sigmas"], timesteps=tensors["timesteps"], logprobs=logprobs,
                   noise=noise, latents={m: [d[i] for i in sorted(d)] for m, d in latents.items()})

    def summary(self) -> dict:
        """What a sample traces back to: version, trajectory tables, seeds, artifacts (hashes)."""
        return {"request_id": self.request_id, "weights_version": self.weights_version, "seed": self.seed,
                "noise_order": self.noise_order, "sigmas": self.sigmas.tolist(),
                "timesteps": self.timesteps.tolist(), "sde": self.sde, "final": self.final_hashes,
                "request": self.request_hash, "prompts": self.prompt_hashes}


@dataclass
class BehaviorRecorder:
    """Per-request capture state, kept in the loop state (a plain dataclass: the scheduler's step snapshots copy
    its lists, so a step re-run never records twice)."""
    spec: CaptureSpec
    header: dict                                   # the BehaviorRecord fields known at init_state
    modalities: list[str]
    num_steps: int
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    noise: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    latents: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    batch_sizes: list[int] = field(default_factory=list)
    experts: list[int] = field(default_factory=list)
    last: RolloutStep | None = None

    @classmethod
    def start(cls, spec: CaptureSpec, header: dict, initial: dict[str, torch.Tensor], num_steps: int
              ) -> "BehaviorRecorder":
        rec = cls(spec, dict(header), list(initial), num_steps)
        rec.header["initial_hashes"] = {m: tensor_hash(t) for m, t in initial.items()}
        extra = rec.header.setdefault("extra", {})
        extra["numel"], extra["logprob_reduction"] = element_counts(initial), SAMPLE_LOGPROB_REDUCTION
        rec.logprobs = {m: [] for m in initial}
        if spec.latents:
            rec.latents = {m: [t.detach().clone()] for m, t in initial.items()}
        return rec

    def step(self, index: int, timestep: float, sigma: float, sigma_next: float, sde: bool,
             logprobs: dict[str, torch.Tensor | None], noise: dict[str, torch.Tensor | None],
             latents_out: dict[str, torch.Tensor], batch_size: int, expert: int | None = None) -> "BehaviorRecorder":
        """A new recorder with step `index` added (the one in the input state is left as it was)."""
        lps, draws, xs = dict(self.logprobs), dict(self.noise), dict(self.latents)
        for m in self.modalities:
            lp = logprobs.get(m)
            lps[m] = lps[m] + [float("nan") if lp is None else float(lp)]
            if self.spec.noise and noise.get(m) is not None:
                draws[m] = {**draws.get(m, {}), index: noise[m].detach().to("cpu").clone()}
            if self.spec.latents:
                xs[m] = xs[m] + [latents_out[m].detach().clone()]
        last = RolloutStep(ROLLOUT_STEP, index, timestep, sigma, sigma_next, sde,
                           {m: lps[m][-1] for m in self.modalities}, batch_size, self.header["weights_version"])
        return replace(self, logprobs=lps, noise=draws, latents=xs, batch_sizes=self.batch_sizes + [batch_size],
                       experts=self.experts + ([] if expert is None else [expert]), last=last)

    def record(self, final: dict[str, torch.Tensor]) -> BehaviorRecord:
        return BehaviorRecord(
            **self.header, modalities=list(self.modalities), batch_sizes=list(self.batch_sizes),
            experts=list(self.experts), final_hashes={m: tensor_hash(t) for m, t in final.items()},
            logprobs={m: torch.tensor(v, dtype=torch.float32) for m, v in self.logprobs.items()},
            noise={m: dict(d) for m, d in self.noise.items()},
            latents={m: list(v) for m, v in self.latents.items()})


def sde_fields(sde: Any) -> dict | None:
    """An SDEConfig as plain JSON fields (the window as a list)."""
    if sde is None:
        return None
    d = asdict(sde)
    d["sde_window"] = None if d["sde_window"] is None else list(d["sde_window"])
    return d
