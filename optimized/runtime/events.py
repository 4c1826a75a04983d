"""Typed runtime events. Kinds: request.accepted, request.rejected, request.admitted, request.preempted,
request.cancelled, request.completed, request.failed, request.output (a streamed piece of a result, e.g. a decoded
video chunk), trace.step, trace.scheduler, trace.cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

EVENT_KINDS = ("request.accepted", "request.rejected", "request.admitted", "request.preempted", "request.cancelled",
               "request.completed", "request.failed", "request.output", "trace.step", "trace.scheduler", "trace.cache")


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


class EventBus:
    """Fan-out to subscribers; a subscriber may filter by kind prefix (e.g. 'request.')."""

    def __init__(self) -> None:
        self._subs: list[tuple[str, Callable[[Event], Any]]] = []

    def subscribe(self, fn: Callable[[Event], Any], prefix: str = "") -> Callable[[], None]:
        entry = (prefix, fn)
        self._subs.append(entry)
        return lambda: self._subs.remove(entry) if entry in self._subs else None

    def emit(self, event: Event) -> None:
        for prefix, fn in list(self._subs):
            if event.kind.startswith(prefix):
                fn(event)
