"""The weight-update lifecycle behind `Engine.update_weights` (family-agnostic).

    1. freeze: nothing is admitted while the update runs (the engine is single-threaded: no tick happens here)
    2. in-flight requests (submitted before the update), by policy:
         "finish"  they keep running on the version they started with: their loop kernels hold the old resident
                   instance, new requests get new kernels on the new one (no stall; both resident until they end)
         "drain"   they are run to completion first, then the weights are swapped (one version resident)
    3. the new resident instance is loaded (the family's own loader and load transforms) with the new version
    4. every cache of the old instance is invalidated: entries move to the new instance's caches only when their
       key's weights_version is the new instance's (never, for a real update), all others are evicted
       (visible as trace.cache "evict" events)
    5. every component derived from the old instance is dropped and rebuilt on first use from the new one (the
       media chain: its VAE and decode / encode kernels; the processor; a model directory's media components come
       from the new checkpoint), so a video started after the update decodes with the new weights
    6. the engine serves the new version: later BehaviorRecords, request records and video results carry it; a
       video program in flight keeps (and is labelled with) the version it started on

A stale cache after an update is impossible by construction: every cache key names the weights version, the new
version must differ from the old one, and the old entries are dropped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optimized.runtime.cache import CacheKey, CacheStore, state_dict_hash
from optimized.runtime.events import Event

POLICIES = ("finish", "drain")
# what an engine builds from its resident instance on first use (optimized/serving): dropped by an update
DERIVED = ("_media_chain", "_processor", "_takes_image")


@dataclass(frozen=True)
class WeightUpdate:
    old_version: str
    new_version: str
    policy: str
    in_flight: tuple[str, ...]          # request ids submitted before the update (they ran / run on old_version)
    evicted: int                        # cache entries dropped
    carried: int                        # cache entries kept (valid under the new version)


def resolve_weights(engine: Any, weights: Any) -> tuple[dict[str, dict[str, torch.Tensor]], str | None]:
    """(weights by component, the checkpoint's version or None) from a checkpoint path, a component dict, or a
    single-component family's state dict."""
    entry, cfg = engine.family, engine.model.cfg
    names = [c.component_id for c in entry.components(cfg)]
    if isinstance(weights, (str, Path)):
        from manifests.checkpoint import load_state, read_checkpoint
        ckpt = read_checkpoint(weights)
        if ckpt.partial:
            raise ValueError(f"update_weights: {weights} is a partial checkpoint")
        return {n: load_state(ckpt, component=n if ckpt.is_model else None) for n in names}, ckpt.weights_version
    if not isinstance(weights, dict) or not weights:
        raise ValueError("update_weights: give a checkpoint path, {component: state_dict} or a state dict")
    if all(isinstance(v, torch.Tensor) for v in weights.values()):
        if len(names) != 1:
            raise ValueError(f"update_weights: {entry.name} has components {names}; give {{component: state}}")
        weights = {names[0]: weights}
    missing = sorted(set(names) - set(weights))
    if missing:
        raise ValueError(f"update_weights: {entry.name} needs components {names}; missing {missing}")
    for comp, state in weights.items():
        for key, t in state.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"update_weights: component {comp!r} key {key!r} holds NaN/Inf values")
    return weights, None


def resolve_version(requested: str, current: str) -> str:
    """The version the new instance serves; an update must bump it (module-level: a negative control plants a
    version that is not bumped here)."""
    if requested == current:
        raise ValueError(f"update_weights: the new weights must carry a new version (got the current {current!r})")
    return requested


def _valid_under(key: CacheKey, version: str) -> bool:
    return key.weights_version == version or key.weights_version.startswith(version + ":")


def carry_caches(old: tuple[CacheStore, ...], new: tuple[CacheStore, ...], version: str) -> tuple[int, int]:
    """Move entries valid under `version` into the new instance's stores; evict every other. (evicted, carried)"""
    evicted = carried = 0
    for src, dst in zip(old, new):
        for key in src.keys():
            if _valid_under(key, version) and dst is not src:
                dst.put(key, src.peek(key))
                carried += 1
            evicted += int(src.evict(key))
    return evicted, carried


def update_weights(engine: Any, weights: Any, version: str | None = None, policy: str = "finish") -> WeightUpdate:
    if policy not in POLICIES:
        raise ValueError(f"update_weights: policy must be one of {POLICIES}, got {policy!r}")
    weights_source = weights
    weights, ckpt_version = resolve_weights(engine, weights)
    old = engine.model
    if version is None:
        version = ckpt_version or "sha256:" + hashlib.sha256("".join(
            state_dict_hash(weights[c]) for c in sorted(weights)).encode()).hexdigest()[:32]
    version = resolve_version(str(version), str(old.weights_version))
    sched = engine.scheduler
    in_flight = tuple(r.request_id for r in sched.records.values() if r.status in ("waiting", "running"))
    if policy == "drain":
        sched.run_until(lambda: all(r not in sched.records or sched.records[r].status not in ("waiting", "running")
                                    for r in in_flight))   # a finished stage's record may already be forgotten
    new = engine.family.load(old.cfg, weights, device=str(old.device), dtype=old.dtype, weights_version=version)
    evicted, carried = carry_caches(tuple(engine.family.caches(old)), tuple(engine.family.caches(new)), version)
    for cache in engine.family.caches(new):  # the new caches join the engine's event stream
        cache.subscribe(lambda ev: engine.bus.emit(Event(
            "trace.cache", None, sched.tick_count,
            {"store": ev.store, "op": ev.op, "key": ev.key.short(), "nbytes": ev.nbytes})))
    engine.model = new
    engine._loops = {}  # new kernels on the new instance; in-flight requests keep theirs (policy "finish")
    rebuild_derived(engine, weights_source)
    return WeightUpdate(str(old.weights_version), version, policy, in_flight, evicted, carried)


def rebuild_derived(engine: Any, weights_source: Any) -> None:
    """Drop what the engine derived from its old instance (DERIVED; rebuilt on first use, in-flight programs hold
    their own). Media components that are not part of the model's weights (an attached or seeded VAE: the chain
    names their own version) are kept as they are; a model directory given as the new weights becomes the source
    of the media components that are."""
    from manifests.checkpoint import read_checkpoint
    from optimized.serving.families import attach_media
    old_chain = engine.__dict__.get("_media_chain")
    for name in DERIVED:
        engine.__dict__.pop(name, None)
    if old_chain is not None and old_chain.weights_version is not None:
        attach_media(engine, vae=old_chain.vae, sound=old_chain.sound, vae_version=old_chain.weights_version)
    if isinstance(weights_source, (str, Path)):
        ckpt = read_checkpoint(weights_source)
        if ckpt.is_model:
            engine.checkpoint, engine.checkpoint_path = ckpt, str(weights_source)

