"""Typed runtime events. Kinds: request.accepted, request.rejected, request.admitted, request.preempted,
request.cancelled, request.completed, request.failed, request.output (a streamed piece of a result, e.g. a decoded
video chunk), trace.step, trace.scheduler, trace.batch_failed (a batched step raised; its members are rerun one by one),
trace.cache, trace.subscriber_error (a subscriber raised)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

EVENT_KINDS = ("request.accepted", "request.rejected", "request.admitted", "request.preempted", "request.cancelled",
               "request.completed", "request.failed", "request.output", "trace.step", "trace.scheduler",
               "trace.batch_failed", "trace.cache", "trace.subscriber_error", "rollout.step")

log = logging.getLogger("optimized.runtime.events")


@dataclass(frozen=True)
class Event:
    kind: str
    request_id: str | None
    tick: int                               # scheduler iteration that produced it
    data: dict = field(default_factory=dict)
    wall_time: float = field(default_factory=time.monotonic, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}")


def subscriber_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class EventBus:
    """Fan-out to subscribers; a subscriber may filter by kind prefix (e.g. 'request.').

    Subscribers are isolated: an exception raised by one never reaches the emitter (the scheduler, a kernel, a
    cache), the other subscribers or any request. Rule: the subscriber is kept (it still gets later events); its
    first failure is reported once, as a `trace.subscriber_error` event to the other subscribers and a log warning;
    later failures are only counted (`failures[name]`)."""

    def __init__(self) -> None:
        self._subs: list[tuple[str, Callable[[Event], Any]]] = []
        self.failures: dict[str, int] = {}       # subscriber name -> exceptions raised so far
        self._reported: set[int] = set()         # ids of subscriber entries whose first failure was reported

    def subscribe(self, fn: Callable[[Event], Any], prefix: str = "") -> Callable[[], None]:
        entry = (prefix, fn)
        self._subs.append(entry)
        return lambda: self._subs.remove(entry) if entry in self._subs else None

    def emit(self, event: Event) -> None:
        for entry in list(self._subs):
            prefix, fn = entry
            if event.kind.startswith(prefix):
                try:
                    fn(event)
                except Exception as e:  # noqa: BLE001 - a subscriber's bug is its own
                    self._failed(entry, event, e)

    def _failed(self, entry: tuple[str, Callable], event: Event, error: Exception) -> None:
        name = subscriber_name(entry[1])
        self.failures[name] = self.failures.get(name, 0) + 1
        if id(entry) in self._reported:
            return
        self._reported.add(id(entry))
        message = f"{type(error).__name__}: {error}"
        log.warning("event subscriber %s raised on %s (kept; reported once): %s", name, event.kind, message)
        report = Event("trace.subscriber_error", event.request_id, event.tick,
                       {"subscriber": name, "event_kind": event.kind, "error": message})
        for other in list(self._subs):
            if other is not entry and report.kind.startswith(other[0]):
                try:
                    other[1](report)
                except Exception as e:  # noqa: BLE001
                    self._failed(other, report, e)
