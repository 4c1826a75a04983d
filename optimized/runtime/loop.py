"""Loop inversion: model code describes one step; the runtime owns the loop.

A `LoopKernel` turns a request into typed loop state (`init_state`), says what the next step needs without
doing it (`plan_step`, pure: same state -> same plan), runs the planned step for one or several requests at
once (`run_step`, the only place that computes), and turns finished state into a result (`finalize`).
Cancellation and preemption happen only between steps, at plans marked `cancel_boundary`. The one driver is
`optimized.runtime.scheduler.WorkUnitScheduler` (`run_request` / `stream_request` there for a single request).

Step state is functional: `run_step` returns new states. The scheduler hands it `snapshot`s of the recorded states
(containers copied, generators cloned, tensors shared), so a step that fails part-way, or a batch re-run request by
request to isolate a failing member, always starts again from the states as they were before the step: nothing is
applied twice. A kernel must therefore never write into a tensor of its input states (replace tensors instead), and
any side effect outside the state (a KV pool, a cache) must be idempotent for a given input state.

Admission is decided from the request alone: `estimate(request)` (pure, allocates nothing) says what the request
will hold and what its largest step needs; the scheduler refuses a request that can never fit before `init_state`
allocates anything.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Sequence, TypeVar

import torch

from optimized.runtime.cache import CacheKey

State = TypeVar("State")


@dataclass(frozen=True)
class ResourceRequest:
    """What a step (or a whole request, at admission) must reserve before it runs, on ONE rank: under a parallel
    plan every rank runs the same scheduler against its own device's budget, so a kernel states the bytes its
    rank holds (`per_rank_share` for what the plan splits)."""
    device_bytes: int = 0
    cost_seconds: float = 0.0          # predicted device-seconds: the scheduler's one cost currency

    def __add__(self, other: "ResourceRequest") -> "ResourceRequest":
        return ResourceRequest(self.device_bytes + other.device_bytes, self.cost_seconds + other.cost_seconds)


def per_rank_share(total: int, *splits: int) -> int:
    """Bytes (or work) of one rank when `total` is split over the given plan degrees (ceil: the largest shard)."""
    n = 1
    for d in splits:
        n *= max(int(d), 1)
    return -(-int(total) // n)


@dataclass(frozen=True)
class RequestEstimate:
    """What a request will need, computed from the request alone (before any allocation): bytes held for its whole
    life (its `admission`) and the bytes of its largest step (a plan's `resources.device_bytes`)."""
    held_bytes: int = 0
    step_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.held_bytes + self.step_bytes


def fresh_copy(value: Any) -> Any:
    """A copy of step state that a step may change without touching the original: lists, dicts, sets and non-frozen
    dataclasses are copied (recursively), torch generators cloned; tensors, frozen dataclasses, tuples and other
    values are shared (a kernel replaces tensors instead of writing into them)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, torch.Generator):
        g = torch.Generator(device=value.device)
        g.set_state(value.get_state())
        return g
    if isinstance(value, list):
        return [fresh_copy(v) for v in value]
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = fresh_copy(v)
        return out
    if isinstance(value, set):
        return set(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) \
            and not value.__dataclass_params__.frozen:
        out = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(out, f.name, fresh_copy(getattr(value, f.name)))
        return out
    return value


@dataclass(frozen=True)
class WorkPlan:
    """Every field is read by the scheduler: request_id (filled in by it), loop_id / phase / shape_signature /
    parallel_plan_hash (cost model key, trace), step_index (trace), batch_key (grouping), graph_bucket (batches that
    hit an already compiled / captured body), resources (step memory gate + cost, per rank), cache_reads (trace),
    cancel_boundary (cancel / preempt gate), info (trace only)."""
    request_id: str                    # the scheduler's request id (it replaces whatever the kernel put here)
    loop_id: str                       # e.g. "cosmos3.denoise", "wan.vae_decode"
    phase: str                         # e.g. "denoise_step", "vae_decode_chunk", "ar_token"
    step_index: int
    batch_key: Hashable                # plans with equal keys may run in one `run_step` call (shape for fixed bodies)
    resources: ResourceRequest = ResourceRequest()   # device_bytes: transient memory of this step, on top of admission
    cache_reads: tuple[CacheKey, ...] = ()
    cancel_boundary: bool = True       # the request may be cancelled / preempted before this step
    shape_signature: str = ""          # (loop, phase, shape, plan) -> cost model calibration key
    parallel_plan_hash: str = "single"  # the layout the step runs under (ParallelPlan.hash()): costs and bytes per rank
    graph_bucket: str = ""             # this request's share of the step body's shape bucket ("" = shape_signature)
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
        """Run one planned step for each state (all plans share one batch_key); return the new states. The states
        given are the scheduler's snapshots: if this raises, the scheduler still holds the pre-step states."""

    @abstractmethod
    def is_done(self, state: State) -> bool: ...

    @abstractmethod
    def finalize(self, state: State) -> Any:
        """The request's result once `is_done`."""

    def estimate(self, request: Any) -> RequestEstimate | None:
        """Pure, from the request alone, allocating nothing: the bytes it will hold and those of its largest step.
        The scheduler refuses a request whose estimate exceeds the budget before `init_state` runs. May raise
        ValueError for an invalid request. None = unknown (the state-based check after `init_state` still applies)."""
        return None

    def snapshot(self, state: State) -> State:
        """A copy of `state` that `run_step` may advance without changing `state` (see `fresh_copy`)."""
        return fresh_copy(state)

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

