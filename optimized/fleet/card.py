"""The DeploymentCard's fleet section (the seed's Deployment and Fleet Plane): what a fleet of role pools serves and
how an orchestrator above it (Dynamo-style) routes to it, scales it and checks it.

    role_pools                 each role's pool: replicas (ids), resources per replica, model-parallel ranks
    supported_programs         the engine's programs a fleet runs split at its stage boundaries
    supported_parallel_plans   plans a replica runs (one device per replica here: {} only)
    cache_events               caches whose residency routes work (the encoder's text embeddings), and their events
    transfer_endpoints         producer role -> consumer role, the transport, the TransferManifest's fields
    cost_model                 predicted seconds per work unit per role (miss / hit), calibrated by the router
    health_schema              what /health and `Router.health()` report per replica, the probe cadence
    slo_schema                 the latency / queue objectives and the metrics they are read from

`fleet_card(spec, router=None, engine_card=None)` builds it from the DeploymentSpec (and the live router's cost model
and health, when there is one; the co-located engine's own card for its programs and model). Nothing is measured
or loaded to build it. `optimized/serving/card.py` carries it as `extra["fleet"]` on a fleet gateway's card.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from optimized.fleet.deployment import ROLES, DeploymentSpec

FLEET_CARD_VERSION = 1
# the TransferManifest's fields (optimized/fleet/transfer.py), what an endpoint carries per stage boundary
MANIFEST_FIELDS = ("request_id", "stage", "producer", "consumer", "entries", "lifetime", "cache_key",
                   "completion_event_id")
UNITS = {"encoder": "prompts (1 per request)", "denoiser": "denoise steps x latent tokens",
         "decoder": "latent frames x latent pixels"}


@dataclass(frozen=True)
class RolePool:
    role: str
    replicas: tuple[str, ...]
    num_cpus: float
    num_gpus: float
    ranks: int                      # model-parallel ranks per replica (torchrun launches them, not Ray)
    max_inflight: int


@dataclass(frozen=True)
class TransferEndpoint:
    producer: str                   # role
    consumer: str                   # role
    transport: str
    manifest_fields: tuple[str, ...] = MANIFEST_FIELDS


@dataclass(frozen=True)
class CacheEventSpec:
    cache: str
    resident_on: str                # the role whose replicas hold it (routing goes there on a hit)
    key: str
    events: tuple[str, ...]


@dataclass(frozen=True)
class HealthSchema:
    statuses: tuple[str, ...] = ("healthy", "unhealthy", "dead")
    replica_fields: tuple[str, ...] = ("replica_id", "status", "inflight", "completed", "backlog_s",
                                       "resident_cache_keys", "running", "step", "pid", "reason")
    fleet_statuses: tuple[str, ...] = ("ok", "degraded")   # degraded: some role has no healthy replica
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 10.0
    stage_timeout_s: float = 600.0


@dataclass(frozen=True)
class SLOSchema:
    p95_latency_s: float | None
    max_queue: int
    metrics: tuple[str, ...] = ("request.latency_s", "stage.seconds{role}", "stage.failovers{role}",
                                "transfer.bytes{producer,consumer}")


@dataclass(frozen=True)
class FleetCard:
    engine_id: str
    model_specs: tuple[str, ...]
    role_pools: tuple[RolePool, ...]
    supported_programs: tuple[str, ...]
    supported_parallel_plans: tuple[dict, ...]
    cache_events: tuple[CacheEventSpec, ...]
    transfer_endpoints: tuple[TransferEndpoint, ...]
    cost_model: dict
    health_schema: HealthSchema
    slo_schema: SLOSchema
    health: dict | None = None      # the live router's report, when the card is read from a running fleet
    card_version: int = FLEET_CARD_VERSION

    def to_dict(self) -> dict:
        """Plain JSON data (tuples as lists), as the card is served."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def _engine_id(spec: DeploymentSpec) -> str:
    digest = hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{spec.name}-{digest}"


def fleet_card(spec: DeploymentSpec, router: Any = None, engine_card: dict | None = None) -> FleetCard:
    m = spec.model
    model = f"{m.family}:{m.variant}" if m.variant is not None and ":" not in m.variant else (m.variant or m.path)
    programs = ("video",) if engine_card is None else tuple(p for p in engine_card.get("programs", ()) if p == "video")
    pools = tuple(RolePool(p.role, tuple(spec.replica_ids(p.role)), p.num_cpus, p.num_gpus, p.ranks, p.max_inflight)
                  for p in spec.roles)
    endpoints = tuple(TransferEndpoint(a, b, spec.transport) for a, b in zip(ROLES, ROLES[1:]))
    events = ("cache.stored", "cache.hit", "cache.evicted")
    caches = (CacheEventSpec("stage_output", "encoder", "content key of the stage input (TransferManifest.cache_key: "
                             "its tensors, structure, weights version)", events),
              CacheEventSpec("stage_output", "denoiser", "content key of the stage input (as above)", events),
              CacheEventSpec("text_encoder_output", "denoiser", "text_ids:sha256(prompt token ids) (the text "
                             "encoder's CacheKey input hash; made by the denoise loop)", events))
    if router is not None:
        cost = router.cost.to_dict()
    else:
        from optimized.fleet.router import StageCostModel
        cost = StageCostModel().to_dict()
    cost["units"] = dict(UNITS)
    r = spec.routing
    return FleetCard(engine_id=_engine_id(spec), model_specs=(model,), role_pools=pools,
                     supported_programs=programs, supported_parallel_plans=({},), cache_events=caches,
                     transfer_endpoints=endpoints, cost_model=cost,
                     health_schema=HealthSchema(probe_interval_s=r.health_interval_s,
                                                probe_timeout_s=r.health_timeout_s,
                                                stage_timeout_s=r.stage_timeout_s),
                     slo_schema=SLOSchema(spec.slo.p95_latency_s, spec.slo.max_queue),
                     health=None if router is None else router.health())


__all__ = ["CacheEventSpec", "FleetCard", "HealthSchema", "RolePool", "SLOSchema", "TransferEndpoint", "fleet_card"]
