"""The WorkUnit scheduler: running-first, reservation-gated admission, one cost currency, cross-request batching.

Memory: a request holds its `admission()` bytes for its whole life; each step also needs its plan's
`resources.device_bytes` while it runs. A request is refused at submission when it can never fit the budget: first
from the kernel's `estimate(request)` (before `init_state` allocates anything), then from its state's admission plus
its first step. It is admitted when they fit beside what running requests hold, and a batch is split so that held
bytes + the batch's step bytes fit; a later step that can never fit fails its request.

Failures: a step runs on snapshots of the recorded states (`LoopKernel.snapshot`), so when a batched step raises,
every member still has its pre-step state and the batch is re-run request by request from there: the failing
request fails alone, its batch mates advance exactly once. The batch's failure is emitted first, as one
`trace.batch_failed` event (error, member ids, loop, each member's step index), so a batched step that cannot run is
never silent even when every solo rerun succeeds.

Each `tick()`:
  1. retire cancelled / preempted requests at a step boundary (a plan with `cancel_boundary`; reservations and
     caches are freed);
  2. admit waiting requests in arrival order while their reservation fits (one that cannot fit now waits);
  3. plan one step for every running request (`plan_step` is pure), group plans by `batch_key`;
  4. split each group into batches the cost model allows (never a batch measured slower than its members run one
     by one; when split, members grouped so a batch lands on a compiled / captured body: `_chunks`), run them (running
     requests first, oldest first) while the tick's predicted device-seconds fit the budget (the first group always
     runs, so nothing starves), one `run_step` call per memory-fitting batch;
  5. measure (`clock`; a step that compiled or captured its body is not a measurement), calibrate the cost model,
     emit `trace.step` (and `request.output` for what a step streams out), finish requests whose loop is done.

Retention: a finished request's loop state is released at once (a completed one's; a failed or cancelled one keeps
its state for diagnosis until it expires); its result is held by the record until its owner takes it
(`RequestHandle.result()` moves it into the handle; a program stage's `take_result` also forgets the record). The
scheduler keeps at most `retain_finished` finished records (oldest forgotten first), so memory stays flat however
many requests it serves.

Under a parallel plan every rank runs this scheduler on its own device: budgets, reservations and step bytes are per
rank, and the cost model keys on the plan (`WorkPlan.parallel_plan_hash`).

`run_request` / `run_requests` / `stream_request` drive a bare kernel through a private scheduler (no engine):
the scheduler is the only loop driver.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, NoReturn, Sequence

from optimized.runtime.events import Event, EventBus
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan


class RequestRejected(ValueError):
    """A request refused at submission (invalid, or can never fit); the message says why and `field` names the
    request field at fault when one is (the HTTP server's 400 `param`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnknownRequest(ValueError):
    """A request id the scheduler never accepted (e.g. `cancel("nosuch")`)."""


class RequestFailed(RuntimeError):
    """A request that ended without a result (failed or cancelled); the message says why."""


CostKey = tuple[str, str, str, str]
# how a group is cut into batches: "measured" = never a batch measured slower than its members one by one (serving;
# one process only: under a multi-rank layout, where every rank must form the same batches, it batches as "greedy");
# "greedy" = the largest batch memory and max_batch allow, whatever the clock says (reproducible batch composition)
BATCHING = ("measured", "greedy")


class CostModel:
    """Predicted device-seconds per (loop, phase, shape signature, parallel plan hash): the same step under another
    layout costs something else. Starts from the kernel's estimate in the plan and converges to measurements
    (exponential moving averages):

      * `measured`: each request's share of the runs it was part of (the tick budget's currency);
      * `solo`: seconds of the step run alone; `batched`: seconds of a batch, per composition (the multiset of its
        members' keys). `slower_than_solo(plans)` is True once that batch was measured slower than the sum of its
        members run one by one: the scheduler then never forms it (or a larger one) again. Solo times are learned
        from the steps that run alone (a request before its batch mates arrive, after they finish, or a probe: see
        `unmeasured_solo`).
    """

    def __init__(self, smoothing: float = 0.5):
        self.smoothing = smoothing
        self.measured: dict[CostKey, float] = {}
        self.solo: dict[CostKey, float] = {}
        self.batched: dict[tuple[CostKey, ...], float] = {}

    @staticmethod
    def key(plan: WorkPlan) -> CostKey:
        return plan.loop_id, plan.phase, plan.shape_signature, plan.parallel_plan_hash

    @classmethod
    def composition(cls, plans: Sequence[WorkPlan]) -> tuple[CostKey, ...]:
        return tuple(sorted(cls.key(p) for p in plans))

    def _ema(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else (1 - self.smoothing) * old + self.smoothing * value

    def predict(self, plan: WorkPlan) -> float:
        return self.measured.get(self.key(plan), plan.resources.cost_seconds)

    def observe(self, plans: Sequence[WorkPlan], seconds: float) -> None:
        share = seconds / max(len(plans), 1)
        for p in plans:
            self._ema(self.measured, self.key(p), share)
        if len(plans) == 1:
            self._ema(self.solo, self.key(plans[0]), seconds)
        elif plans:
            self._ema(self.batched, self.composition(plans), seconds)

    def batch_ratio(self, plans: Sequence[WorkPlan]) -> float | None:
        """Measured seconds of this batch / the sum of its members' solo seconds; None until both are known."""
        batch = self.batched.get(self.composition(plans))
        solos = [self.solo.get(self.key(p)) for p in plans]
        if batch is None or any(t is None for t in solos) or sum(solos) <= 0:
            return None
        return batch / sum(solos)

    def slower_than_solo(self, plans: Sequence[WorkPlan]) -> bool:
        ratio = self.batch_ratio(plans) if len(plans) > 1 else None
        return ratio is not None and ratio > 1.0

    def unmeasured_solo(self, plans: Sequence[WorkPlan]) -> int | None:
        """Index of the first member whose solo seconds are unknown once this batch has been measured (requests that
        arrive together never step alone, so without a probe their batch could never be compared); else None."""
        if len(plans) < 2 or self.composition(plans) not in self.batched:
            return None
        return next((i for i, p in enumerate(plans) if self.key(p) not in self.solo), None)


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
    weights_version: str | None = None  # the resident instance's version its kernel computes with (the engine's)


class WorkUnitScheduler:
    def __init__(self, memory_budget_bytes: int = 8 << 30, tick_budget_seconds: float = float("inf"),
                 max_batch: int = 16, bus: EventBus | None = None, clock: Callable[[], float] = time.perf_counter,
                 batching: str = "measured", retain_finished: int = 256):
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
        self.batching = batching           # "greedy": batch sizes never depend on timing (parity runs, tests)
        self.memory_budget_bytes = memory_budget_bytes   # per rank: every rank of a plan runs its own scheduler
        self.tick_budget_seconds = tick_budget_seconds
        self.max_batch = max_batch
        self.bus = bus or EventBus()
        self.clock = clock                 # step timing for the cost model (a fake clock in tests)
        self.cost = CostModel()
        self.warm: dict[tuple, None] = {}  # (group, bucket composition) with a compiled / captured body (ordered)
        self.graph_groups: set = set()     # groups whose step body reported a compiled / replayed graph
        self.records: dict[str, RequestRecord] = {}
        self.retain_finished = retain_finished   # finished records kept for lookups (cancel, status), oldest forgotten
        self._finished: dict[str, None] = {}     # finished ids, oldest first
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.reserved_bytes = 0
        self.peak_bytes = 0               # most bytes held + stepping at once (reservations + a batch's step bytes)
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
            estimate = kernel.estimate(request)  # from the request alone: nothing is allocated yet
            if estimate is not None and estimate.total_bytes > self.memory_budget_bytes:
                self._reject(rid, f"request needs about {estimate.held_bytes} bytes held + {estimate.step_bytes} "
                                  f"bytes for its largest step, more than the whole budget "
                                  f"({self.memory_budget_bytes}); it can never fit")
            state = kernel.init_state(request)
        except RequestRejected:
            raise
        except ValueError as e:  # invalid request: refused here, nothing else is disturbed
            self._reject(rid, str(e), getattr(e, "field", None))
        need = kernel.admission(state)
        first_step = kernel.plan_step(state).resources.device_bytes
        if need.device_bytes + first_step > self.memory_budget_bytes or not kernel.fits_ever(state):
            kernel.release(state)
            self._reject(rid, f"request needs {need.device_bytes} bytes held + {first_step} bytes for its first "
                              f"step, more than the whole budget ({self.memory_budget_bytes}) or the loop's own "
                              f"pool; it can never fit")
        rec = RequestRecord(rid, kernel, state, need, arrival=len(self.records))
        self.records[rid] = rec
        self.waiting.append(rid)
        self._emit("request.accepted", rec, reservation_bytes=need.device_bytes)
        return rec

    def _reject(self, rid: str, reason: str, field: str | None = None) -> NoReturn:
        self.bus.emit(Event("request.rejected", rid, self.tick_count, {"reason": reason, "field": field}))
        raise RequestRejected(reason, field) from None

    def record(self, request_id: str) -> RequestRecord:
        """The record of an accepted request; UnknownRequest for an id never accepted."""
        rec = self.records.get(request_id) if isinstance(request_id, str) else None
        if rec is None:
            raise UnknownRequest(f"no request with id {request_id!r} was accepted by this scheduler")
        return rec

    def take_result(self, request_id: str) -> Any:
        """A finished request's result, handed to its owner: the scheduler forgets the record."""
        rec = self.record(request_id)
        if rec.status in ("waiting", "running"):
            raise RuntimeError(f"request {request_id} has not finished ({rec.status})")
        self.forget(request_id)
        return rec.result

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (its owner holds what it needs)."""
        rec = self.records.get(request_id)
        if rec is not None and rec.status not in ("waiting", "running"):
            del self.records[request_id]
            self._finished.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """Takes effect at the next step boundary (a request that already ended is left as it is)."""
        self.record(request_id).cancel_requested = True

    def preempt(self, request_id: str) -> None:
        """Move a running request back to waiting at the next step boundary (its loop state is kept)."""
        self.record(request_id).preempt_requested = True

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
    def _plan(self, rec: RequestRecord) -> WorkPlan:
        plan = rec.kernel.plan_step(rec.state)
        return plan if plan.request_id == rec.request_id else replace(plan, request_id=rec.request_id)

    def tick(self) -> None:
        self.tick_count += 1
        self._retire_at_boundary()
        self._admit()
        plans = {rid: self._plan(self.records[rid]) for rid in self.running}
        groups: dict[tuple[int, Any], list[str]] = defaultdict(list)
        for rid in self.running:  # running order = admission order: oldest first
            groups[(id(self.records[rid].kernel), plans[rid].batch_key)].append(rid)
        spent, ran, deferred, starved = 0.0, [], set(), []
        # groups deferred last tick go first (aging), so no loop kind starves behind another
        order = sorted(groups.items(), key=lambda item: item[0] not in self._deferred)
        for group_key, rids in order:
            for chunk in self._chunks(group_key, rids, plans):
                predicted = sum(self.cost.predict(plans[r]) for r in chunk)
                if ran and spent + predicted > self.tick_budget_seconds:
                    deferred.add(group_key)  # the first group always runs
                    continue
                for batch in self._memory_batches(chunk, plans, starved):
                    self._run_group(batch, [plans[r] for r in batch], group_key[1])
                    ran.append(group_key)
                spent += predicted
        if not ran and starved:  # every step waits on memory held by others: send the newest back to waiting
            victim = self.running[-1]
            if victim != starved[0]:
                self.preempt(victim)
        self._deferred = deferred
        self._emit("trace.scheduler", None, running=list(self.running), waiting=list(self.waiting),
                   groups=len(ran), predicted_seconds=spent, reserved_bytes=self.reserved_bytes)
        self._finish_done()

    @staticmethod
    def _buckets(plans: Sequence[WorkPlan]) -> tuple[str, ...]:
        return tuple(sorted(p.graph_bucket or p.shape_signature for p in plans))

    def _chunks(self, group_key: tuple, rids: list[str], plans: dict[str, WorkPlan]) -> list[list[str]]:
        """Split a group (oldest first) into batches of the largest size the cost model allows: at most `max_batch`,
        and never as large as a batch already measured slower than its members run one by one (a batch measured
        before its members' solo seconds are known sends one member alone once, as a probe). When the group must
        be split and its step body is compiled / captured, each batch (which always holds the oldest member left)
        takes members whose bucket composition already has a compiled / captured body, where one exists, instead
        of the next ones in age order: the split never adds a batch, it picks who goes together."""
        out, rest = [], list(rids)
        # across ranks every scheduler must form the same batches (their steps meet in collectives), and each rank's
        # clock reads differently: under a multi-rank layout batch sizes never follow the clock
        measured = self.batching == "measured" and all(plans[r].parallel_plan_hash == "single" for r in rids)
        while rest:
            cand = rest[:self.max_batch]
            size = 1
            for b in range(2, len(cand) + 1):
                if measured and self.cost.slower_than_solo([plans[r] for r in cand[:b]]):
                    break  # batching this many lost against one by one: a larger batch is not tried either
                size = b
            batch = rest[:size]
            if size < len(rest) and group_key in self.graph_groups:
                batch = self._warm_batch(group_key, rest, size, plans) or batch
            probe = self.cost.unmeasured_solo([plans[r] for r in batch]) if measured else None
            if probe is not None:  # step one member alone (the rest still batch) to learn what one by one costs
                batch = [batch[probe]]
            out.append(batch)
            rest = [r for r in rest if r not in batch]
        return out

    def _warm_batch(self, group_key: tuple, rest: list[str], size: int, plans: dict[str, WorkPlan]) -> list[str]:
        """`size` members of `rest`, the oldest included, whose bucket composition is warm (oldest first within each
        bucket); [] when no warm composition of that size can be filled."""
        bucket = {r: self._buckets([plans[r]])[0] for r in rest}
        for g, composition in self.warm:
            if g != group_key or len(composition) != size or bucket[rest[0]] not in composition:
                continue
            need, batch = list(composition), []
            for r in rest:
                if bucket[r] in need:
                    need.remove(bucket[r])
                    batch.append(r)
            if not need and rest[0] in batch:
                return batch
        return []

    def _memory_batches(self, rids: list[str], plans: dict[str, WorkPlan], starved: list[str]) -> list[list[str]]:
        """Split a group into batches whose step bytes fit beside the held reservations; a request whose step can
        never fit fails, one that cannot fit now waits for the next tick (appended to `starved`)."""
        room = self.memory_budget_bytes - self.reserved_bytes
        batches: list[list[str]] = []
        current, used = [], 0
        for rid in rids:
            need = plans[rid].resources.device_bytes
            rec = self.records[rid]
            if rec.reservation.device_bytes + need > self.memory_budget_bytes:
                rec.error = (f"step {plans[rid].step_index} ({plans[rid].phase}) needs {need} bytes beside the "
                             f"{rec.reservation.device_bytes} it holds: more than the budget "
                             f"{self.memory_budget_bytes}")
                self._drop(rec, "failed")
                self._emit("request.failed", rec, error=rec.error)
                continue
            if need > room:
                starved.append(rid)
                continue
            if used + need > room:
                batches.append(current)
                current, used = [], 0
            current.append(rid)
            used += need
        return batches + ([current] if current else [])

    def _retire_at_boundary(self) -> None:
        for rid in list(self.running) + list(self.waiting):
            rec = self.records[rid]
            if rid in self.running and (rec.cancel_requested or rec.preempt_requested) \
                    and not rec.kernel.plan_step(rec.state).cancel_boundary:
                continue  # mid-way through steps that must run together: wait for the next boundary
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

            headroom = rec.kernel.plan_step(rec.state).resources.device_bytes  # its next step must fit too
            if self.reserved_bytes + rec.reservation.device_bytes + headroom > self.memory_budget_bytes \
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
        t0 = self.clock()
        try:
            # the step advances snapshots: until it returns, every record keeps its pre-step state
            new_states = kernel.run_step([kernel.snapshot(r.state) for r in recs], plans)
            if len(new_states) != len(recs):
                raise RuntimeError(f"{kernel.loop_id or type(kernel).__name__}.run_step returned "
                                   f"{len(new_states)} states for {len(recs)} requests")
        except Exception as e:  # a failing step fails its own request, not the engine or its batch mates
            if len(recs) > 1:
                # said before the solo reruns: they may all succeed, and a batch that cannot run is still a bug
                self._emit("trace.batch_failed", None, error=f"{type(e).__name__}: {e}", batch=list(rids),
                           loop=plans[0].loop_id, steps=[p.step_index for p in plans])
                for rid, plan in zip(rids, plans):  # isolate the culprit: rerun each alone from its pre-step state
                    self._run_group([rid], [plan], batch_key)
                return
            for rec in recs:
                rec.error = f"{type(e).__name__}: {e}"
                self._drop(rec, "failed")
                self._emit("request.failed", rec, error=rec.error)
            return
        seconds = self.clock() - t0
        group_key = (id(kernel), batch_key)
        self.warm[(group_key, self._buckets(plans))] = None
        if any(p.info.get("graph") in ("compiled", "replayed") for p in plans):
            self.graph_groups.add(group_key)
        if not any(p.info.get("graph_cache") == "miss" for p in plans):  # a compile / capture is not the step's cost
            self.cost.observe(plans, seconds)
        step_bytes = sum(p.resources.device_bytes for p in plans)
        self.peak_bytes = max(self.peak_bytes, self.reserved_bytes + step_bytes)
        for rec, plan, state in zip(recs, plans, new_states):
            rec.state = state
            rec.steps_run += 1
            self._emit("trace.step", rec, loop=plan.loop_id, phase=plan.phase, step=plan.step_index,
                       parallel_plan=plan.parallel_plan_hash, batch_size=len(recs), batch=[r.request_id for r in recs],
                       seconds=seconds,
                       step_bytes=plan.resources.device_bytes, cache_reads=[k.short() for k in plan.cache_reads],
                       **plan.info)
            output = kernel.step_output(state, plan)
            if output is not None:
                self._emit("request.output", rec, output=output, step=plan.step_index,
                           step_bytes=plan.resources.device_bytes, **plan.info)

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
        if status == "completed":
            rec.state = None   # the result is all that is left of it (failed / cancelled keep theirs: diagnosis)
        self._finished[rec.request_id] = None
        while len(self._finished) > self.retain_finished:   # the oldest finished records expire
            oldest = next(iter(self._finished))
            del self._finished[oldest]
            self.records.pop(oldest, None)


# ---------------------------------------------------------------------- one kernel, no engine
def stream_request(kernel: LoopKernel, request: Any, *, memory_budget_bytes: int = 8 << 30,
                   cancelled: Callable[[], bool] = lambda: False,
                   scheduler: WorkUnitScheduler | None = None) -> Iterator[Any]:
    """Run one request through a scheduler, yielding what each step streams out (`step_output`) as it lands; the
    generator's return value is the result. `cancelled()` is polled before every tick (the scheduler cancels at
    the next boundary). Raises RequestRejected at submission, RequestFailed when the request fails or is cancelled."""
    sched = scheduler or WorkUnitScheduler(memory_budget_bytes)
    rec = sched.submit(kernel, request)
    seen = 0
    while rec.status not in ("completed", "cancelled", "failed"):
        if cancelled() and not rec.cancel_requested:
            sched.cancel(rec.request_id)
        sched.tick()
        outputs = [e for e in rec.events[seen:] if e.kind == "request.output"]
        seen = len(rec.events)
        for ev in outputs:
            yield ev.data["output"]
    if rec.status != "completed":
        raise RequestFailed(f"request {rec.request_id} {rec.status}" + (f": {rec.error}" if rec.error else ""))
    return rec.result


def run_request(kernel: LoopKernel, request: Any, **kw) -> Any:
    """`stream_request` to its end; the result."""
    gen = stream_request(kernel, request, **kw)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def run_requests(kernel: LoopKernel, requests: Sequence[Any], *, memory_budget_bytes: int = 8 << 30,
                 max_batch: int = 16) -> list[Any]:
    """Several requests on one scheduler (steps with equal batch_keys batched); results in order."""
    sched = WorkUnitScheduler(memory_budget_bytes, max_batch=max_batch)
    recs = [sched.submit(kernel, r) for r in requests]
    sched.run_until_idle()
    bad = [r for r in recs if r.status != "completed"]
    if bad:
        raise RequestFailed("; ".join(f"request {r.request_id} {r.status}: {r.error}" for r in bad))
    return [r.result for r in recs]
