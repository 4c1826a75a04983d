"""C1 under an acceleration for cosmos3: the engine's FlowDenoiseLoop and the reference `generate` run the same
request with the same AccelSpec (optimized/accel/ + optimized/models/cosmos3 vs reference/cosmos3/accel.py).

As parity/accel_checks.py does for wan: decisions first (step, CFG branch, action, block ranges, the compared
metric), then the latents after every step (every modality, concatenated) against the contract's C1 tolerance.
The engine request is batched with `extra_requests` others under the same acceleration (other seeds: rows with
other decisions share its steps) and, with `exact_mate`, an exact request too. The faults of
parity/accel_checks.py (`never_refresh`, `wrong_branch`, planted in the engine's residual store) must fail here
and be localised to a step and a branch.
"""

from __future__ import annotations

import torch

from manifests.accel import AccelSpec, parse_accel
from parity.accel_rows import FAULTS, AccelC1Row, compare, first_failure, planted

__all__ = ["FAULTS", "AccelC1Row", "c1_rows", "default_request", "first_failure", "flat_trajectory",
           "run_accel_c1_cosmos3"]

MODALITIES = ("vision", "sound", "action")


def default_request(cfg, spec: AccelSpec | None, num_steps: int = 6, seed: int = 0, guidance_scale: float = 5.0,
                    **kw):
    """A small t2v request on `cfg` (3 x 4 x 6 latents, a 7-token prompt, a 3-token negative prompt)."""
    from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig
    g = torch.Generator().manual_seed(1000 + seed)
    base = {"text_ids": torch.randint(0, cfg.vocab_size, (7,), generator=g),
            "negative_text_ids": torch.randint(0, cfg.vocab_size, (3,), generator=g),
            "latent_frames": 3, "latent_height": 4, "latent_width": 6, "num_steps": num_steps,
            "guidance_scale": guidance_scale, "seed": seed, "scheduler": UniPCConfig(flow_shift=10.0), "accel": spec}
    base.update(kw)
    return Cosmos3GenerateRequest(**base)


def flat_trajectory(trajectory: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each step's latents, every modality flattened and concatenated in a fixed order."""
    return [torch.cat([step[m].reshape(-1).float() for m in MODALITIES if m in step]) for step in trajectory]


def run_accel_c1_cosmos3(spec: AccelSpec | str, *, variant: str = "tiny", weights=None, request=None,
                         num_steps: int = 6, seed: int = 0, fault: str | None = None, extra_requests: int = 1,
                         exact_mate: bool = False, mates=None, tol: float | None = None):
    """(C1 rows, engine results of every submitted request: the checked one first) of one accelerated cosmos3
    request. `mates`: the requests submitted with it (default: `extra_requests` same-shape ones under the same
    acceleration, plus one exact request with `exact_mate`). Greedy batching: every mate shares every step."""
    from manifests.cosmos3 import canonical_key_shapes, load_variant
    from manifests.parity import load_parity_contract
    from optimized.models.cosmos3.loops import DenoiseJob, FlowDenoiseLoop
    from optimized.models.cosmos3.model import load_fast
    from optimized.runtime.scheduler import RequestRejected, WorkUnitScheduler
    from parity.weights import random_state_dict
    from reference.cosmos3 import generate, load_transformer

    spec = parse_accel(spec) if isinstance(spec, str) else spec
    cfg = load_variant(variant)
    weights = weights if weights is not None else random_state_dict(canonical_key_shapes(cfg), seed)
    request = request if request is not None else default_request(cfg, spec, num_steps, seed)
    if mates is None:
        others = [default_request(cfg, spec, request.num_steps, seed + 1 + i) for i in range(extra_requests)]
        if exact_mate:
            others.append(default_request(cfg, None, request.num_steps, seed + 100))
    else:
        others = list(mates)
    tol = tol if tol is not None else load_parity_contract("cosmos3").tolerance("C1", "float32", "cpu").rel_l2

    loop = FlowDenoiseLoop(load_fast(cfg, weights))
    sched = WorkUnitScheduler(batching="greedy")
    with planted(fault):
        try:
            handles = [sched.submit(loop, DenoiseJob(r, record_trajectory=True)) for r in [request, *others]]
        except RequestRejected as e:   # the request / spec cannot run here (one clear message)
            raise ValueError(str(e)) from None
        while not sched.idle:
            sched.tick()
    for h in handles:
        if h.status != "completed":
            raise RuntimeError(f"accel C1 (cosmos3): an engine request failed: {h.error}")
    engine = handles[0].result
    ref = generate(load_transformer(cfg, weights), request, keep_trajectory=True)
    rows = compare(engine["accel"]["decisions"], flat_trajectory(engine["trajectory"]), ref.accel,
                   flat_trajectory(ref.trajectory), tol)
    return rows, [h.result for h in handles]


def c1_rows(spec: AccelSpec | str, *, variant: str | None = None, seed: int = 0, fault: str | None = None,
            num_steps: int = 6, extra_requests: int = 1, tol: float | None = None) -> list[AccelC1Row]:
    """The family hook parity/accel_checks.py dispatches `--accel` C1 for cosmos3 to: the rows alone."""
    rows, _ = run_accel_c1_cosmos3(spec, variant=variant or "tiny", seed=seed, fault=fault, num_steps=num_steps,
                                   extra_requests=extra_requests, tol=tol)
    return rows
