"""The WorkUnit scheduler: running-first, reservation-gated admission, one cost currency, cross-request batching.

Each `tick()`:
  1. retire cancelled / preempted requests at the step boundary (their reservations and caches are freed);
  2. admit waiting requests in arrival order while their reservation fits (a request that can never fit was
     refused at submission; one that cannot fit now waits);
  3. plan one step for every running request (`plan_step` is pure), group plans by `batch_key`;
  4. run groups (running requests first, oldest first) while the tick's predicted device-seconds fit the
     budget (the first group always runs, so nothing starves), one `run_step` call per group;
  5. measure, calibrate the cost model, emit `trace.step`, finish requests whose loop is done.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from optimized.runtime.events import Event, EventBus
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan


class RequestRejected(ValueError):
    """A request refused at submission (invalid, or can never fit); the message says why."""


class CostModel:
    """Predicted device-seconds per (loop, phase, shape signature). Starts from the kernel's estimate in the
    plan and converges to measurements (exponential moving average of the per-unit share of a batched run)."""

    def __init__(self, smoothing: float = 0.5):
        self.smoothing = smoothing
        self.measured: dict[tuple[str, str, str], float] = {}

    @staticmethod
    def key(plan: WorkPlan) -> tuple[str, str, str]:
        return plan.loop_id, plan.phase, plan.shape_signature

    def predict(self, plan: WorkPlan) -> float:
        return self.measured.get(self.key(plan), plan.resources.cost_seconds)

    def observe(self, plans: list[WorkPlan], seconds: float) -> None:
        share = seconds / max(len(plans), 1)
        for p in plans:
            k = self.key(p)
            old = self.measured.get(k)
            self.measured[k] = share if old is None else (1 - self.smoothing) * old + self.smoothing * share


@dataclass
class RequestRecord:
    request_id: str
    kernel: LoopKernel
    state: Any
    reservation: ResourceRequest
    arrival: int
    status: str = "waiting"           # waiting | running | completed | cancelled | failed
    cancel_requested: bool = False
    preempt_requested: bool = False
    preempted_at: int = -1
    steps_run: int = 0
    result: Any = None
    error: str | None = None
    events: list[Event] = field(default_factory=list)


class WorkUnitScheduler:
    def __init__(self, memory_budget_bytes: int = 8 << 30, tick_budget_seconds: float = float("inf"),
                 max_batch: int = 16, bus: EventBus | None = None):
        self.memory_budget_bytes = memory_budget_bytes
        self.tick_budget_seconds = tick_budget_seconds
        self.max_batch = max_batch
        self.bus = bus or EventBus()
        self.cost = CostModel()
        self.records: dict[str, RequestRecord] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.reserved_bytes = 0
        self.tick_count = 0
        self._ids = itertools.count()
        self._deferred: set = set()

    # ------------------------------------------------------------------ events
    def _emit(self, kind: str, rec: RequestRecord | None, **data) -> None:
        ev = Event(kind, rec.request_id if rec else None, self.tick_count, data)
        if rec is not None:
            rec.events.append(ev)
        self.bus.emit(ev)

    # ------------------------------------------------------------------ API
    def submit(self, kernel: LoopKernel, request: Any, request_id: str | None = None) -> RequestRecord:
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.records:
            raise RequestRejected(f"request id {rid!r} already used")
        try:
            state = kernel.init_state(request)
        except ValueError as e:  # invalid request: refused here, nothing else is disturbed
            self.bus.emit(Event("request.rejected", rid, self.tick_count, {"reason": str(e)}))
            raise RequestRejected(str(e)) from None
        need = kernel.admission(state)
        if need.device_bytes > self.memory_budget_bytes or not kernel.fits_ever(state):
            kernel.release(state)
            reason = (f"request needs {need.device_bytes} bytes, more than the whole budget "
                      f"({self.memory_budget_bytes}) or the loop's own pool; it can never fit")
            self.bus.emit(Event("request.rejected", rid, self.tick_count, {"reason": reason}))
            raise RequestRejected(reason)
        rec = RequestRecord(rid, kernel, state, need, arrival=len(self.records))
        self.records[rid] = rec
        self.waiting.append(rid)
        self._emit("request.accepted", rec, reservation_bytes=need.device_bytes)
        return rec

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step boundary."""
        self.records[request_id].cancel_requested = True

    def preempt(self, request_id: str) -> None:
        """Move a running request back to waiting at the next step boundary (its loop state is kept)."""
        self.records[request_id].preempt_requested = True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def run_until_idle(self, max_ticks: int = 1_000_000) -> None:
        for _ in range(max_ticks):
            if self.idle:
                return
            self.tick()
        raise RuntimeError(f"scheduler not idle after {max_ticks} ticks")

    def run_until(self, done: Callable[[], bool], max_ticks: int = 1_000_000) -> None:
        for _ in range(max_ticks):
            if done() or self.idle:
                return
            self.tick()

    # ------------------------------------------------------------------ one iteration
    def tick(self) -> None:
        self.tick_count += 1
        self._retire_at_boundary()
        self._admit()
        plans = {rid: self.records[rid].kernel.plan_step(self.records[rid].state) for rid in self.running}
        groups: dict[tuple[int, Any], list[str]] = defaultdict(list)
        for rid in self.running:  # running order = admission order: oldest first
            groups[(id(self.records[rid].kernel), plans[rid].batch_key)].append(rid)
        spent, ran, deferred = 0.0, [], set()
        # groups deferred last tick go first (aging), so no loop kind starves behind another
        order = sorted(groups.items(), key=lambda item: item[0] not in self._deferred)
        for group_key, rids in order:
            for chunk in (rids[i:i + self.max_batch] for i in range(0, len(rids), self.max_batch)):
                predicted = sum(self.cost.predict(plans[r]) for r in chunk)
                if ran and spent + predicted > self.tick_budget_seconds:
                    deferred.add(group_key)  # the first group always runs
                    continue
                self._run_group(chunk, [plans[r] for r in chunk], group_key[1])
                spent += predicted
                ran.append(group_key)
        self._deferred = deferred
        self._emit("trace.scheduler", None, running=list(self.running), waiting=list(self.waiting),
                   groups=len(ran), predicted_seconds=spent, reserved_bytes=self.reserved_bytes)
        self._finish_done()

    def _retire_at_boundary(self) -> None:
        for rid in list(self.running) + list(self.waiting):
            rec = self.records[rid]
            if rec.cancel_requested:
                self._drop(rec, "cancelled")
                self._emit("request.cancelled", rec, steps_run=rec.steps_run)
            elif rec.preempt_requested and rid in self.running:
                rec.preempt_requested = False
                rec.preempted_at = self.tick_count
                self.running.remove(rid)
                self.reserved_bytes -= rec.reservation.device_bytes
                self.waiting.insert(0, rid)  # first in line to come back
                rec.status = "waiting"
                self._emit("request.preempted", rec, steps_run=rec.steps_run)

    def _admit(self) -> None:
        for rid in list(self.waiting):
            rec = self.records[rid]
            if rec.preempted_at == self.tick_count:
                continue  # room made by a preemption goes to others this tick

            if self.reserved_bytes + rec.reservation.device_bytes > self.memory_budget_bytes \
                    or not rec.kernel.reserve(rec.state):
                break  # FIFO: later arrivals do not overtake a waiting earlier one
            self.waiting.remove(rid)
            self.running.append(rid)
            self.reserved_bytes += rec.reservation.device_bytes
            rec.status = "running"
            self._emit("request.admitted", rec, reserved_bytes=self.reserved_bytes)

    def _run_group(self, rids: list[str], plans: list[WorkPlan], batch_key: Any) -> None:
        recs = [self.records[r] for r in rids]
        kernel = recs[0].kernel
        t0 = time.perf_counter()
        try:
            new_states = kernel.run_step([r.state for r in recs], plans)
        except Exception as e:  # a failing step fails its own request, not the engine or its batch mates
            if len(recs) > 1:
                for rid, plan in zip(rids, plans):  # isolate the culprit: rerun each alone
                    self._run_group([rid], [plan], batch_key)
                return
            for rec in recs:
                rec.error = f"{type(e).__name__}: {e}"
                self._drop(rec, "failed")
                self._emit("request.failed", rec, error=rec.error)
            return
        seconds = time.perf_counter() - t0
        self.cost.observe(plans, seconds)
        for rec, plan, state in zip(recs, plans, new_states):
            rec.state = state
            rec.steps_run += 1
            self._emit("trace.step", rec, loop=plan.loop_id, phase=plan.phase, step=plan.step_index,
                       batch_size=len(recs), batch=[r.request_id for r in recs], seconds=seconds, **plan.info)

    def _finish_done(self) -> None:
        for rid in list(self.running):
            rec = self.records[rid]
            if rec.kernel.is_done(rec.state):
                rec.result = rec.kernel.finalize(rec.state)
                self._drop(rec, "completed")
                self._emit("request.completed", rec, steps_run=rec.steps_run)

    def _drop(self, rec: RequestRecord, status: str) -> None:
        if rec.request_id in self.running:
            self.running.remove(rec.request_id)
            self.reserved_bytes -= rec.reservation.device_bytes
        if rec.request_id in self.waiting:
            self.waiting.remove(rec.request_id)
        rec.kernel.release(rec.state)
        rec.status = status
