"""Loop inversion: model code describes one step; the runtime owns the loop.

A `LoopKernel` turns a request into typed loop state (`init_state`), says what the next step needs without
doing it (`plan_step`, pure: same state -> same plan), runs the planned step for one or several requests at
once (`run_step`, the only place that computes), and turns finished state into a result (`finalize`).
Cancellation and preemption happen only between steps, at plans marked `cancel_boundary`. The one driver is
`optimized.runtime.scheduler.WorkUnitScheduler` (`run_request` / `stream_request` there for a single request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Sequence, TypeVar

from optimized.runtime.cache import CacheKey

State = TypeVar("State")


@dataclass(frozen=True)
class ResourceRequest:
    """What a step (or a whole request, at admission) must reserve before it runs."""
    device_bytes: int = 0
    cost_seconds: float = 0.0          # predicted device-seconds: the scheduler's one cost currency

    def __add__(self, other: "ResourceRequest") -> "ResourceRequest":
        return ResourceRequest(self.device_bytes + other.device_bytes, self.cost_seconds + other.cost_seconds)


@dataclass(frozen=True)
class WorkPlan:
    """Every field is read by the scheduler: request_id (filled in by it), loop_id / phase / shape_signature (cost
    model key, trace), step_index (trace), batch_key (grouping), resources (step memory gate + cost), cache_reads
    (trace), cancel_boundary (cancel / preempt gate), info (trace only)."""
    request_id: str                    # the scheduler's request id (it replaces whatever the kernel put here)
    loop_id: str                       # e.g. "cosmos3.denoise", "wan.vae_decode"
    phase: str                         # e.g. "denoise_step", "vae_decode_chunk", "ar_token"
    step_index: int
    batch_key: Hashable                # plans with equal keys may run in one `run_step` call (shape for fixed bodies)
    resources: ResourceRequest = ResourceRequest()   # device_bytes: transient memory of this step, on top of admission
    cache_reads: tuple[CacheKey, ...] = ()
    cancel_boundary: bool = True       # the request may be cancelled / preempted before this step
    shape_signature: str = ""          # (loop, phase, shape) -> cost model calibration key
    info: dict = field(default_factory=dict, compare=False)  # trace-only details (never read by the runtime)


class LoopKernel(ABC, Generic[State]):
    loop_id: str = ""

    @abstractmethod
    def init_state(self, request: Any) -> State:
        """Validate the request and build its loop state. Raises ValueError (with a clear message) on bad input."""

    @abstractmethod
    def plan_step(self, state: State) -> WorkPlan:
        """Pure: what the next step of this request needs. Never mutates state, never computes tensors."""

    @abstractmethod
    def run_step(self, states: Sequence[State], plans: Sequence[WorkPlan]) -> list[State]:
        """Run one planned step for each state (all plans share one batch_key); return the new states."""

    @abstractmethod
    def is_done(self, state: State) -> bool: ...

    @abstractmethod
    def finalize(self, state: State) -> Any:
        """The request's result once `is_done`."""

    def admission(self, state: State) -> ResourceRequest:
        """Resources held for the request's whole life (e.g. its caches); reserved before admission."""
        return ResourceRequest()

    def fits_ever(self, state: State) -> bool:
        """False when the kernel's own pools could never hold the request (refused at submission)."""
        return True

    def reserve(self, state: State) -> bool:
        """Take the kernel's own resources (e.g. KV blocks) at admission; False = not now, keep waiting."""
        return True

    def release(self, state: State) -> None:
        """Free what the request holds (cache entries, reservations) on completion or cancellation."""

    def step_output(self, state: State, plan: WorkPlan) -> Any | None:
        """What the step just run streams out (e.g. a decoded video chunk), emitted as a `request.output` event;
        None = nothing to stream."""
        return None

