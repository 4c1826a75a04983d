"""Role pools as Ray actors: one actor per replica (its own process, with its own resident role worker and
scheduler), reserved in one placement group, driven by the fleet router (optional `fleet` extra: ray).

    pools = RayRolePools.start(spec, worker_factory)       # spec: DeploymentSpec; ray.init per spec.placement
    router = Router(pools.replicas, spec.routing, ...)     # RayReplica: run_stage / health over actor calls
    ...
    pools.shutdown()                                       # actors killed, placement group removed, ray stopped
                                                           # (when this process started it)

Each actor is `ReplicaActor(replica_id, role, worker_factory)`: `worker_factory(role, replica_id)` builds the role's
worker in the actor's process (`fleet_server.make_stage_worker`: fleetcore's role body `RoleEngine` for the role, or
anything with `run_stage(call) -> StageOutput` and `resident()`); the actor is the replica's process, so the body
runs in it directly (not in a second spawned `RoleWorker` process). Actors are threaded (max_concurrency 2) so a health probe answers
while a stage runs; stage calls are serialised on a lock (one role worker, one scheduler). A call whose actor
process is gone (`RayActorError`, killed or crashed) or that does not answer within `stage_timeout_s`
(`GetTimeoutError`; the actor is then killed, so a late answer can never arrive) is `ReplicaDied` for the router,
which fails over; an exception of the stage's own code comes back as itself (the router fails the request).

Placement: one bundle per replica ({CPU: num_cpus, GPU: num_gpus}) in a placement group with the spec's strategy
(PACK on one machine; SPREAD across nodes). torchrun stays the launcher of the model-parallel ranks inside one
replica: Ray places replicas, it does not start ranks (`ranks` > 1 is refused by the spec until a replica can).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optimized.fleet.deployment import ROLES, DeploymentSpec
from optimized.fleet.router import HealthReport, ReplicaDied, StageCall, StageOutput


class RayUnavailable(RuntimeError):
    """Ray is not installed or the cluster cannot be reached (exit 2 for the CLI)."""


def _ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("placement.backend ray needs Ray: pip install -e '.[fleet]' (ray==2.60.0)") from None
    return ray


class ReplicaActor:
    """The body of one replica's actor (also usable in-process: `LocalReplica`)."""

    def __init__(self, replica_id: str, role: str, worker_factory: Callable[[str], Any]):
        self.replica_id, self.role = replica_id, role
        self.worker = worker_factory(role, replica_id)
        self.lock = threading.Lock()
        self.inflight = 0
        self.completed = 0
        self.current: str | None = None           # "REQUEST/role#attempt" while a stage runs

    def run_stage(self, call: StageCall) -> StageOutput:
        with self.lock:
            self.inflight += 1
            self.current = f"{call.request_id}/{call.role}#{call.attempt}"
            t0 = time.perf_counter()
            try:
                out = self.worker.run_stage(call)
            finally:
                self.inflight -= 1
                self.current = None
            self.completed += 1
            seconds = time.perf_counter() - t0
            return StageOutput(out.payload, seconds, out.cache_hit, tuple(self.worker.resident()), out.bytes_moved)

    def health(self) -> HealthReport:
        return HealthReport(self.replica_id, self.role, True, inflight=self.inflight, completed=self.completed,
                            resident=tuple(self.worker.resident()), detail=self.current or "", pid=os.getpid(),
                            step=int(getattr(self.worker, "steps_done", 0)) if self.current else 0)

    def pid(self) -> int:
        return os.getpid()

    def running(self) -> str | None:
        return self.current


class LocalReplica:
    """A replica in this process (placement.backend local; tests): the same ReplicaActor body, no Ray."""

    def __init__(self, replica_id: str, role: str, worker_factory: Callable[[str], Any]):
        self.replica_id, self.role = replica_id, role
        self.actor = ReplicaActor(replica_id, role, worker_factory)

    def run_stage(self, call: StageCall) -> StageOutput:
        return self.actor.run_stage(call)

    def health(self, timeout_s: float) -> HealthReport:
        return self.actor.health()


class RayReplica:
    """The router's handle on one replica actor."""

    def __init__(self, replica_id: str, role: str, actor: Any, stage_timeout_s: float):
        self.replica_id, self.role, self.actor, self.stage_timeout_s = replica_id, role, actor, stage_timeout_s

    def _get(self, ref: Any, timeout: float) -> Any:
        ray = _ray()
        from ray import exceptions as rx
        try:
            return ray.get(ref, timeout=timeout)
        except rx.GetTimeoutError:
            ray.kill(self.actor, no_restart=True)   # never a late answer from an abandoned attempt
            raise ReplicaDied(self.replica_id, f"no answer within {timeout:g} s (actor killed)") from None
        except rx.RayActorError as e:               # the process is gone (killed, crashed, its node lost)
            raise ReplicaDied(self.replica_id, f"actor process gone ({type(e).__name__})") from None
        except rx.RayTaskError as e:                # the stage's own error: raised as itself
            cause = e.as_instanceof_cause()
            raise (cause if isinstance(cause, Exception) else RuntimeError(str(e))) from None

    def run_stage(self, call: StageCall) -> StageOutput:
        return self._get(self.actor.run_stage.remote(call), self.stage_timeout_s)

    def health(self, timeout_s: float) -> HealthReport:
        from ray import exceptions as rx
        try:
            return _ray().get(self.actor.health.remote(), timeout=timeout_s)
        except rx.GetTimeoutError:
            raise TimeoutError(f"{self.replica_id}: no health answer within {timeout_s:g} s") from None
        except rx.RayActorError as e:
            raise ReplicaDied(self.replica_id, f"actor process gone ({type(e).__name__})") from None

    def pid(self) -> int:
        return _ray().get(self.actor.pid.remote(), timeout=60)

    def running(self) -> str | None:
        return _ray().get(self.actor.running.remote(), timeout=60)


@dataclass
class RayRolePools:
    """The started actors of every role pool, their placement group, and whether this process started Ray."""
    spec: DeploymentSpec
    replicas: dict[str, list[Any]] = field(default_factory=dict)     # role -> RayReplica (the router's pools)
    placement_group: Any = None
    started_ray: bool = False

    @classmethod
    def start(cls, spec: DeploymentSpec, worker_factory: Callable[[str], Any],
              ready_timeout_s: float = 600.0) -> RayRolePools:
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        pools = cls(spec)
        if not ray.is_initialized():
            kw: dict = {"include_dashboard": False, "log_to_driver": False}
            kw["address"] = spec.placement.address   # "local": always a new cluster (never one found on the machine)
            if spec.placement.address == "local" and spec.placement.num_cpus is not None:
                kw["num_cpus"] = spec.placement.num_cpus
            try:
                ray.init(**kw)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise RayUnavailable(f"placement.address {spec.placement.address!r}: cannot start or join a Ray "
                                     f"cluster ({e})") from None
            pools.started_ray = True
        bundles = [{"CPU": p.num_cpus, **({"GPU": p.num_gpus} if p.num_gpus else {})}
                   for p in spec.roles for _ in range(p.replicas)]
        try:
            pg = placement_group(bundles, strategy=spec.placement.strategy)
            if not pg.wait(timeout_seconds=min(ready_timeout_s, 120)):
                remove_placement_group(pg)
                raise RayUnavailable(f"the cluster cannot reserve {len(bundles)} replicas ({bundles}) with strategy "
                                     f"{spec.placement.strategy}: lower roles.*.num_cpus or add nodes")
            pools.placement_group = pg
            actor_cls = ray.remote(ReplicaActor)
            index = 0
            for p in spec.roles:
                pools.replicas[p.role] = []
                for rid in spec.replica_ids(p.role):
                    strategy = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                placement_group_bundle_index=index)
                    actor = actor_cls.options(num_cpus=p.num_cpus, num_gpus=p.num_gpus, max_concurrency=2,
                                              max_restarts=0, scheduling_strategy=strategy,
                                              name=f"{spec.name}/{rid}").remote(rid, p.role, worker_factory)
                    pools.replicas[p.role].append(RayReplica(rid, p.role, actor, spec.routing.stage_timeout_s))
                    index += 1
            for role in ROLES:   # every actor built its worker (the model loaded) before the fleet serves
                for r in pools.replicas[role]:
                    try:
                        r._get(r.actor.pid.remote(), ready_timeout_s)
                    except ReplicaDied as e:
                        raise RayUnavailable(f"replica {r.replica_id} did not start ({e.reason}); its log is under "
                                             f"the Ray session's logs/") from None
        except BaseException:
            pools.shutdown()
            raise
        return pools

    def shutdown(self) -> None:
        ray = _ray()
        for reps in self.replicas.values():
            for r in reps:
                try:
                    ray.kill(r.actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        self.replicas = {}
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001 - the cluster may already be down
                pass
            self.placement_group = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False


def local_pools(spec: DeploymentSpec, worker_factory: Callable[[str], Any]) -> dict[str, list[LocalReplica]]:
    """placement.backend local: every replica a LocalReplica in this process (same bodies as the actors)."""
    return {p.role: [LocalReplica(rid, p.role, worker_factory) for rid in spec.replica_ids(p.role)]
            for p in spec.roles}


__all__ = ["LocalReplica", "RayReplica", "RayRolePools", "RayUnavailable", "ReplicaActor", "local_pools"]
