"""Rollouts through the engine: the serving loop with capture on. A GRPO group is K samples of one prompt (same
shape and schedule, seeds differ): submitted together, the scheduler steps them as one batch, and the prompt is
encoded once (the content-hash cache serves the other K - 1; visible as trace.cache "hit" events)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from optimized.engine import Engine, RequestHandle
from optimized.training.records import BehaviorRecord, CaptureSpec


@dataclass
class RolloutSample:
    request_id: str
    request: Any
    latents: dict[str, torch.Tensor]
    record: BehaviorRecord


def submit_rollout(engine: Engine, request: Any, capture: CaptureSpec = CaptureSpec(),
                   request_id: str | None = None) -> RequestHandle:
    """Queue one request with behavior capture (its result carries "behavior"; each step streams a RolloutStep)."""
    name = engine.family.loop_for(request)
    job = engine.family.make_job(name, request)
    if not hasattr(job, "capture"):
        raise ValueError(f"{engine.family.name} loop {name!r} cannot capture behavior")
    return RequestHandle(engine, engine.scheduler.submit(engine.loop(name), replace(job, capture=capture), request_id))


def rollout(engine: Engine, requests: Sequence[Any], capture: CaptureSpec = CaptureSpec()) -> list[RolloutSample]:
    """Submit every request, run the engine until they end, return the samples in order (records carry the
    scheduler's request ids)."""
    handles = [submit_rollout(engine, r, capture) for r in requests]
    engine.run_until_idle()
    out = []
    for h, req in zip(handles, requests):
        result = h.result()
        record = result["behavior"]
        record.request_id = h.request_id
        out.append(RolloutSample(h.request_id, req, result["latents"], record))
    return out


def group(request: Any, k: int, seeds: Sequence[int] | None = None) -> list[Any]:
    """K copies of one request differing only in seed (default: seed, seed + 1, ...)."""
    if k < 1:
        raise ValueError(f"a group needs k >= 1, got {k}")
    seeds = list(seeds) if seeds is not None else [request.seed + i for i in range(k)]
    if len(seeds) != k:
        raise ValueError(f"{k} samples need {k} seeds, got {len(seeds)}")
    return [replace(request, seed=s) for s in seeds]


def rollout_group(engine: Engine, request: Any, k: int, capture: CaptureSpec = CaptureSpec(),
                  seeds: Sequence[int] | None = None) -> list[RolloutSample]:
    return rollout(engine, group(request, k, seeds), capture)
