"""The fleet router: which replica of a role pool runs a request's next stage, and what happens when one dies.

A request crosses the role pools in stage order (encoder -> denoiser -> decoder: `deployment.ROLES`); each stage's
output (a TransferManifest + tensors, opaque here: `payload`) is the next stage's input. The router

  * places a stage on the replica with the earliest predicted finish: its backlog (predicted seconds of the stage
    calls it is running or has queued) + this stage's predicted seconds on it, from the DeploymentCard's cost model
    (`StageCostModel`: seconds per work unit per role, calibrated by every completed call). Cache affinity is part
    of the same sum: on a replica where the stage's cache key (the prompt's text embedding for the encoder) is
    resident, the stage costs its measured hit time instead of a miss: the prompt goes where its embedding is,
    unless that replica is so loaded that a miss elsewhere finishes first;
  * keeps a per-request `RequestLedger`: the last completed stage's output is held by the router, so when a replica
    dies mid-stage (`ReplicaDied`: its process is gone or a call timed out) the stage is re-run on another healthy
    replica of the same role from that output; earlier stages are never re-run. A stage output is committed to the
    ledger exactly once (a late answer from an abandoned attempt is dropped), and the artifact is committed once,
    after the last stage; when no healthy replica of the role is left, or `max_attempts` tries were made, the request
    fails with one `FleetRequestFailed` naming the stage, each replica that died and why, and the stages that had
    completed;
  * probes each replica's health (`check_health`, every `health_interval_s` from the gateway): a probe that raises
    or times out marks the replica unhealthy (no new work) until a probe answers again; a replica that died stays
    dead.

An error raised by the stage's own code on a live replica (a bad request) is not a failover: the same inputs would
fail on any replica, so the request fails at once with that error. Cancellation is checked between stages (inside a
stage the replica's scheduler owns the step boundaries). Nothing here knows a model family, Ray or a transport:
replicas are anything with `run_stage` / `health` (`ray_pool.RayReplica`, `LocalReplica`, the tests' fakes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from optimized.fleet.deployment import ROLES, RoutingSpec


class ReplicaDied(RuntimeError):
    """The replica's process is gone (or did not answer within the stage timeout): fail over."""

    def __init__(self, replica_id: str, reason: str):
        super().__init__(f"{replica_id} died: {reason}")
        self.replica_id, self.reason = replica_id, reason


class StageError(RuntimeError):
    """The stage's own code raised on a live replica: not retried elsewhere (the same inputs fail anywhere)."""


class FleetRequestFailed(RuntimeError):
    """A request the fleet could not complete; the message says which stage, which replicas died and why."""


class RequestCancelled(RuntimeError):
    """The request was cancelled between stages."""


@dataclass(frozen=True)
class StageCall:
    """One stage of one request as a replica receives it."""
    request_id: str
    role: str
    attempt: int                       # 1 for the first try of this stage, 2 after one failover, ...
    payload: Any                       # the previous stage's output (for the encoder: the built request)
    cache_key: str | None = None       # what the stage would find resident (encoder: the prompt's embedding key)
    units: float = 1.0                 # work units the cost model prices (e.g. steps x latent tokens)


@dataclass(frozen=True)
class StageOutput:
    payload: Any
    seconds: float                     # wall seconds the replica spent on the stage
    cache_hit: bool = False            # the replica served the stage from a resident entry
    resident: tuple[str, ...] | None = None   # the replica's resident cache keys after the call (None: unchanged)
    bytes_moved: int = 0               # transfer bytes the stage's output carries


@dataclass(frozen=True)
class HealthReport:
    replica_id: str
    role: str
    healthy: bool
    inflight: int = 0
    completed: int = 0
    resident: tuple[str, ...] = ()
    detail: str = ""                   # what it is running now ("REQUEST/role#attempt"), or why it is unhealthy
    pid: int | None = None             # the replica's process (an operator's handle)
    step: int = 0                      # steps the running stage has completed (its loop's trace.step events)


class Replica(Protocol):
    replica_id: str
    role: str

    def run_stage(self, call: StageCall) -> StageOutput: ...   # blocking; ReplicaDied when the process is gone

    def health(self, timeout_s: float) -> HealthReport: ...     # ReplicaDied / TimeoutError when it cannot answer


# ------------------------------------------------------------------------------------------------ the cost model
class StageCostModel:
    """Predicted seconds of a stage on one replica: seconds per work unit for each role (separately for calls served
    from a resident cache entry), an exponential moving average of the calls' measured seconds / units, starting
    from `prior_s_per_unit` (the card's analytic prior). The router's and the DeploymentCard's one currency."""

    def __init__(self, prior_s_per_unit: dict[str, float] | None = None, hit_fraction: dict[str, float] | None = None,
                 smoothing: float = 0.5):
        self.per_unit: dict[tuple[str, bool], float] = {
            (role, False): float(s) for role, s in (prior_s_per_unit or {r: 1.0 for r in ROLES}).items()}
        # a hit not yet measured: the encoder's skips the whole stage; a denoiser's only its text encoding (no
        # discount until measured)
        self.hit_fraction = {"encoder": 0.05, **(hit_fraction or {})}
        self.smoothing = smoothing
        self.observed: dict[tuple[str, bool], int] = {}

    def rate(self, role: str, hit: bool = False) -> float:
        """Seconds per unit. A hit never costs more than a miss (it does strictly less work: a slower measured hit
        is noise); one not yet measured costs hit_fraction of a miss."""
        miss = self.per_unit.get((role, False), 1.0)
        if not hit:
            return miss
        return min(miss, self.per_unit.get((role, True), miss * self.hit_fraction.get(role, 1.0)))

    def predict(self, role: str, units: float, hit: bool = False) -> float:
        return self.rate(role, hit) * max(units, 0.0)

    def observe(self, role: str, units: float, seconds: float, hit: bool = False) -> None:
        if units <= 0:
            return
        key, rate = (role, hit), seconds / units
        old = self.per_unit.get(key)
        self.per_unit[key] = rate if old is None or key not in self.observed else \
            (1 - self.smoothing) * old + self.smoothing * rate
        self.observed[key] = self.observed.get(key, 0) + 1

    def to_dict(self) -> dict:
        return {"currency": "predicted seconds = seconds_per_unit[role][hit|miss] x units",
                "seconds_per_unit": {role: {"miss": self.rate(role), "hit": self.rate(role, True)}
                                     for role in sorted({r for r, _ in self.per_unit})},
                "observations": {f"{r}.{'hit' if h else 'miss'}": n for (r, h), n in sorted(self.observed.items())}}


# --------------------------------------------------------------------------------------------------- the ledger
@dataclass
class StageRecord:
    role: str
    replica_id: str
    attempt: int
    seconds: float
    cache_hit: bool
    bytes_moved: int


@dataclass
class RequestLedger:
    """What the fleet has done for one request: each completed stage once, each failed try, the artifact once."""
    request_id: str
    completed: dict[str, StageRecord] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)       # role -> its committed output payload
    failures: list[str] = field(default_factory=list)           # "denoise on denoiser-0 (try 1): denoiser-0 died: ..."
    artifact: Any = None
    artifact_commits: int = 0

    def commit_stage(self, record: StageRecord, payload: Any) -> None:
        if record.role in self.completed:   # a second answer for a finished stage: dropped, never a duplicate
            raise RuntimeError(f"{self.request_id}: stage {record.role} already committed by "
                               f"{self.completed[record.role].replica_id}")
        self.completed[record.role], self.outputs[record.role] = record, payload

    def commit_artifact(self, artifact: Any) -> None:
        if self.artifact_commits:
            raise RuntimeError(f"{self.request_id}: artifact already committed")
        self.artifact, self.artifact_commits = artifact, 1

    @property
    def bytes_moved(self) -> int:
        return sum(r.bytes_moved for r in self.completed.values())

    def summary(self) -> dict:
        return {"request_id": self.request_id,
                "stages": {role: {"replica": r.replica_id, "attempt": r.attempt, "seconds": r.seconds,
                                  "cache_hit": r.cache_hit, "bytes_moved": r.bytes_moved}
                           for role, r in self.completed.items()},
                "failovers": list(self.failures), "bytes_moved": self.bytes_moved}


# --------------------------------------------------------------------------------------------------- the router
@dataclass
class _ReplicaState:
    replica: Any
    healthy: bool = True
    dead: bool = False
    reason: str = ""
    backlog_s: float = 0.0             # predicted seconds of the calls it runs / has queued
    inflight: int = 0
    completed: int = 0
    resident: frozenset = frozenset()
    last_probe: float = 0.0
    running: str = ""                  # the stage it reported running at the last probe
    pid: int | None = None
    step: int = 0                      # ... and the steps that stage had completed


@dataclass(frozen=True)
class StagePlan:
    """How the router prices one stage of one request."""
    role: str
    units: float = 1.0
    cache_key: str | None = None


class Router:
    def __init__(self, pools: dict[str, Sequence[Any]], routing: RoutingSpec = RoutingSpec(),
                 cost: StageCostModel | None = None, max_inflight: dict[str, int] | None = None,
                 on_event: Callable[[str, str, dict], Any] | None = None):
        missing = [r for r in ROLES if not pools.get(r)]
        if missing:
            raise ValueError(f"no replica for role {missing[0]!r}")
        self.routing, self.cost = routing, cost or StageCostModel()
        self.max_inflight = dict(max_inflight or {})
        self.states: dict[str, dict[str, _ReplicaState]] = {
            role: {r.replica_id: _ReplicaState(r) for r in reps} for role, reps in pools.items()}
        self.lock = threading.Lock()
        self.on_event = on_event
        self.ledgers: dict[str, RequestLedger] = {}

    # ---- placement
    def _holds(self, st: _ReplicaState, plan: StagePlan) -> bool:
        return bool(self.routing.affinity and plan.cache_key is not None and plan.cache_key in st.resident)

    def _predicted(self, role: str, st: _ReplicaState, plan: StagePlan) -> float:
        return st.backlog_s + self.cost.predict(role, plan.units, self._holds(st, plan))

    def place(self, plan: StagePlan, exclude: Sequence[str] = (), reserve: bool = False
              ) -> tuple[_ReplicaState, float] | tuple[None, float]:
        """The live replica of `plan.role` with the earliest predicted finish (replicas under their max_inflight
        first; ties go to the one holding the stage's cache key, then to the lower id) and the stage's predicted
        seconds there; (None, 0) when none is left. `reserve`: the choice and its backlog are taken under one lock
        (two requests placed at once never both see the same replica idle)."""
        with self.lock:
            live = [st for rid, st in sorted(self.states[plan.role].items())
                    if st.healthy and not st.dead and rid not in exclude]
            if not live:
                return None, 0.0
            cap = self.max_inflight.get(plan.role)
            free = [st for st in live if cap is None or st.inflight < cap] or live
            st = min(free, key=lambda st: (self._predicted(plan.role, st, plan), not self._holds(st, plan)))
            seconds = self.cost.predict(plan.role, plan.units, self._holds(st, plan))
            if reserve:
                st.backlog_s += seconds
                st.inflight += 1
            return st, seconds

    def _emit(self, kind: str, request_id: str, **data: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, request_id, data)
            except Exception:  # noqa: BLE001 - a listener's bug never stops a request
                pass

    # ---- one stage, with failover
    def run_stage(self, ledger: RequestLedger, plan: StagePlan, payload: Any,
                  cancelled: Callable[[], bool] = lambda: False) -> Any:
        """Run `plan.role` for the request on the best live replica, failing over on ReplicaDied; commits the
        stage's output to the ledger once and returns it."""
        tried: list[str] = []
        for attempt in range(1, self.routing.max_attempts + 1):
            if cancelled():
                raise RequestCancelled(f"{ledger.request_id}: cancelled before {plan.role}")
            st, predicted = self.place(plan, exclude=tried, reserve=True)
            if st is None:
                break
            rid = st.replica.replica_id
            tried.append(rid)
            self._emit("stage.started", ledger.request_id, role=plan.role, replica=rid, attempt=attempt)
            call = StageCall(ledger.request_id, plan.role, attempt, payload, plan.cache_key, plan.units)
            try:
                out = st.replica.run_stage(call)
            except ReplicaDied as e:
                self.mark_dead(rid, e.reason)
                ledger.failures.append(f"{plan.role} on {rid} (try {attempt}): {e}")
                self._emit("stage.failover", ledger.request_id, role=plan.role, replica=rid, attempt=attempt,
                           error=str(e))
                continue
            except Exception as e:
                raise StageError(f"{ledger.request_id}: {plan.role} on {rid} raised {type(e).__name__}: {e}") \
                    from e
            finally:
                with self.lock:
                    st.backlog_s = max(0.0, st.backlog_s - predicted)
                    st.inflight -= 1
            with self.lock:
                st.completed += 1
                if out.resident is not None:
                    st.resident = frozenset(out.resident)
            self.cost.observe(plan.role, plan.units, out.seconds, out.cache_hit)
            record = StageRecord(plan.role, rid, attempt, out.seconds, out.cache_hit, out.bytes_moved)
            ledger.commit_stage(record, out.payload)
            self._emit("stage.completed", ledger.request_id, role=plan.role, replica=rid, attempt=attempt,
                       seconds=out.seconds, cache_hit=out.cache_hit)
            return out.payload
        done = ", ".join(ledger.completed) or "none"
        why = "; ".join(ledger.failures) or "no replica was healthy"
        left = "no healthy replica left" if self.place(plan, exclude=tried)[0] is None else \
            f"gave up after {self.routing.max_attempts} tries"
        raise FleetRequestFailed(f"request {ledger.request_id}: stage {plan.role} could not complete ({left}: "
                                 f"{why}); completed stages: {done}")

    def run(self, request_id: str, payload: Any, plans: Sequence[StagePlan],
            finish: Callable[[Any], Any] = lambda p: p, cancelled: Callable[[], bool] = lambda: False
            ) -> tuple[Any, RequestLedger]:
        """Every stage of one request in order; `finish(last output)` makes the artifact (committed once)."""
        ledger = self.ledgers[request_id] = RequestLedger(request_id)
        try:
            for plan in plans:
                payload = self.run_stage(ledger, plan, payload, cancelled)
            if cancelled():
                raise RequestCancelled(f"{request_id}: cancelled after {plans[-1].role}")
            ledger.commit_artifact(finish(payload))
            return ledger.artifact, ledger
        finally:
            self.ledgers.pop(request_id, None)

    # ---- health
    def mark_dead(self, replica_id: str, reason: str) -> None:
        with self.lock:
            for pool in self.states.values():
                st = pool.get(replica_id)
                if st is not None:
                    st.dead, st.healthy, st.reason, st.resident = True, False, reason, frozenset()

    def check_health(self, now: float | None = None) -> dict[str, bool]:
        """Probe every live replica whose last probe is older than health_interval_s; returns id -> healthy."""
        now = time.monotonic() if now is None else now
        out = {}
        for pool in self.states.values():
            for rid, st in sorted(pool.items()):
                if st.dead:
                    out[rid] = False
                    continue
                if now - st.last_probe < self.routing.health_interval_s and st.last_probe:
                    out[rid] = st.healthy
                    continue
                st.last_probe = now
                try:
                    report = st.replica.health(self.routing.health_timeout_s)
                except ReplicaDied as e:
                    self.mark_dead(rid, e.reason)
                    out[rid] = False
                    continue
                except Exception as e:  # noqa: BLE001 - a probe that cannot answer: unhealthy for now
                    with self.lock:
                        st.healthy, st.reason = False, f"health probe failed: {type(e).__name__}: {e}"
                    out[rid] = False
                    continue
                with self.lock:
                    st.healthy = bool(report.healthy)
                    st.reason = "" if st.healthy else report.detail
                    st.running, st.pid = (report.detail if st.healthy else ""), report.pid
                    st.step = report.step if st.running else 0
                    st.resident = frozenset(report.resident)
                out[rid] = st.healthy
        return out

    def health(self) -> dict:
        """The fleet's health in the DeploymentCard's health_schema shape."""
        with self.lock:
            pools = {role: [{"replica_id": rid, "status": "dead" if st.dead else "healthy" if st.healthy else
                             "unhealthy", "inflight": st.inflight, "completed": st.completed,
                             "backlog_s": round(st.backlog_s, 6), "resident_cache_keys": len(st.resident),
                             "running": st.running, "step": st.step, "pid": st.pid, **({"reason": st.reason} if st.reason else {})}
                            for rid, st in sorted(pool.items())] for role, pool in self.states.items()}
        ready = all(any(r["status"] == "healthy" for r in reps) for reps in pools.values())
        return {"status": "ok" if ready else "degraded", "roles": pools}


__all__ = ["FleetRequestFailed", "HealthReport", "Replica", "ReplicaDied", "RequestCancelled", "RequestLedger",
           "Router", "StageCall", "StageCostModel", "StageError", "StageOutput", "StagePlan", "StageRecord"]
