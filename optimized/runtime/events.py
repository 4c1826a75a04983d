"""Typed runtime events. Kinds: request.accepted, request.rejected, request.admitted, request.preempted,
request.cancelled, request.completed, request.failed, request.output (a streamed piece of a result, e.g. a decoded
video chunk), trace.step, trace.scheduler, trace.batch_failed (a batched step raised; its members are rerun one by one),
trace.cache, trace.subscriber_error (a subscriber raised).

Every event carries the fields of designv2's Observability plane: its request id, session id (if any), program id,
model id, model instance id, loop id (if any), worker id, role, timestamp (epoch seconds), trace id and the versions
it computes with. The emitter gives kind, request id, tick and data; the bus stamps the rest (`Event.context`, one
frozen `EventContext` shared by every event of a request) before any subscriber sees the event:

  * who emits: the engine's `EventSource` (`EventBus.attach(engine)`): model id, resident instance, worker, role,
    weights versions, read from the engine when a request is first seen (a request keeps the instance and versions
    it was accepted on, also across `update_weights`);
  * whose work: the program a request belongs to (a stage request `<program>/<stage>` belongs to `<program>`; any
    other request is its own program) and that program's `ProgramContext` (trace id, parent span, session), opened
    by whoever submits it (`EventBus.open_program`, reading the caller's `submission(...)` scope: a W3C
    `traceparent`, a session id) or made on first sight with a new trace id.

Nothing here imports a metrics or tracing library: observers (optimized/serving/observability.py) subscribe."""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import time
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

EVENT_KINDS = ("request.accepted", "request.rejected", "request.admitted", "request.preempted", "request.cancelled",
               "request.completed", "request.failed", "request.output", "trace.step", "trace.scheduler",
               "trace.batch_failed", "trace.cache", "trace.subscriber_error", "rollout.step")
REQUEST_END_KINDS = ("request.completed", "request.failed", "request.cancelled", "request.rejected")
MAX_PROGRAMS = 4096        # program contexts kept when nobody closes them (oldest forgotten first): memory stays flat

log = logging.getLogger("optimized.runtime.events")


# ------------------------------------------------------------------------------------------- W3C trace context
_TRACEPARENT = re.compile(r"^\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*$")


@dataclass(frozen=True)
class TraceParent:
    """A W3C trace context: `traceparent: 00-<trace_id>-<span_id>-<flags>` (lowercase hex)."""
    trace_id: str                   # 32 hex digits, not all zero
    span_id: str                    # 16 hex digits, not all zero
    sampled: bool = True

    @classmethod
    def parse(cls, header: str | None) -> "TraceParent | None":
        """The header's context, or None when it is absent or malformed (W3C: the receiver then starts a trace)."""
        m = _TRACEPARENT.match(header) if isinstance(header, str) else None
        if m is None:
            return None
        version, trace_id, span_id, flags, rest = m.groups()
        if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(span_id) == {"0"}:
            return None
        return cls(trace_id, span_id, bool(int(flags, 16) & 1))

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


def new_trace_id() -> str:
    return os.urandom(16).hex()


@dataclass(frozen=True)
class Submission:
    """What the caller of a submit knows about the work (set around the call with `submission(...)`)."""
    traceparent: TraceParent | None = None
    session_id: str | None = None


_SUBMISSION: ContextVar[Submission | None] = ContextVar("fv_submission", default=None)


@contextmanager
def submission(traceparent: TraceParent | str | None = None, session_id: str | None = None) -> Iterator[Submission]:
    """Programs opened inside this scope (this thread / asyncio task) continue `traceparent` and belong to
    `session_id`; an enclosing scope's values are kept where this one gives none."""
    outer = _SUBMISSION.get()
    if isinstance(traceparent, str):
        traceparent = TraceParent.parse(traceparent)
    sub = Submission(traceparent or (outer.traceparent if outer else None),
                     session_id or (outer.session_id if outer else None))
    token = _SUBMISSION.set(sub)
    try:
        yield sub
    finally:
        _SUBMISSION.reset(token)


def current_submission() -> Submission | None:
    return _SUBMISSION.get()


# ------------------------------------------------------------------------------------------- contexts
@dataclass(frozen=True)
class ProgramContext:
    """One user-level piece of work (a video program, a bare request): the trace its events belong to."""
    program_id: str
    trace_id: str
    parent_span_id: str | None = None     # the span its work hangs under (the caller's, or a tracer's request span)
    session_id: str | None = None


@dataclass(frozen=True, eq=False)
class EventContext:
    """The fields every event carries besides kind, request id, tick and data."""
    worker_id: str
    role: str
    model_id: str | None = None
    instance_id: str | None = None
    versions: dict = field(default_factory=dict)     # {"weights": ..., "media_weights": ...}
    program_id: str | None = None
    session_id: str | None = None
    trace_id: str | None = None
    parent_span_id: str | None = None
    loop_id: str | None = None                        # the loop the request runs on (trace.step names its own)


def worker_id() -> str:
    """host:pid, plus :rank<N> inside an initialised process group."""
    wid = f"{socket.gethostname()}:{os.getpid()}"
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            wid += f":rank{dist.get_rank()}"
    except Exception:  # noqa: BLE001 - an odd process group: the host and pid still name the worker
        pass
    return wid


_INSTANCE_SEQ = iter(range(1, 1 << 62))


class EventSource:
    """Who emits: an engine's model, its resident instance, this worker and a role. Read from the engine (held
    weakly) when asked, so a weight update (a new resident instance) shows in the events of later requests."""

    def __init__(self, engine: Any = None, role: str = "engine", model_id: str | None = None):
        self._engine = weakref.ref(engine) if engine is not None else None
        self.role = role
        self.model_id = model_id          # None: "<family>/<variant>" from the engine
        self.worker_id = worker_id()
        self._seen: tuple[int, str] | None = None     # (id(instance), its instance id)
        self._engine_context: tuple[Any, EventContext] | None = None

    def _instance_id(self, engine: Any) -> str:
        model = engine.model
        given = getattr(model, "instance_id", None)
        if isinstance(given, str):
            return given
        if self._seen is None or self._seen[0] != id(model):
            self._seen = (id(model), f"{engine.family.name}-{next(_INSTANCE_SEQ)}")
        return self._seen[1]

    def engine_context(self) -> EventContext:
        """The context of events no request owns (scheduler ticks, caches, batch failures)."""
        engine = self._engine() if self._engine is not None else None
        model = getattr(engine, "model", None)
        media = engine.__dict__.get("_media_chain") if engine is not None else None
        key = (id(model), getattr(model, "weights_version", None), id(media), self.model_id, self.role)
        if self._engine_context is None or self._engine_context[0] != key:
            self._engine_context = (key, self._describe(engine))
        return self._engine_context[1]

    def _describe(self, engine: Any) -> EventContext:
        if engine is None:
            return EventContext(self.worker_id, self.role, self.model_id)
        variant = engine.__dict__.get("variant")
        model_id = self.model_id or (f"{engine.family.name}/{variant}" if variant else engine.family.name)
        versions = {"weights": str(getattr(engine.model, "weights_version", None))}
        media = engine.__dict__.get("_media_chain")
        if getattr(media, "weights_version", None) is not None:
            versions["media_weights"] = str(media.weights_version)
        return EventContext(self.worker_id, self.role, model_id, self._instance_id(engine), versions)

    def loop_of(self, request_id: str) -> str | None:
        engine = self._engine() if self._engine is not None else None
        rec = engine.scheduler.records.get(request_id) if engine is not None else None
        kernel = getattr(rec, "kernel", None)
        return getattr(kernel, "loop_id", None) or (type(kernel).__name__ if kernel is not None else None)


def program_of(request_id: str) -> str:
    """The program a request belongs to: `<program>/<stage>` -> `<program>`; any other request is its own."""
    return request_id.rsplit("/", 1)[0] if "/" in request_id else request_id


# ------------------------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Event:
    kind: str
    request_id: str | None
    tick: int                               # scheduler iteration that produced it
    data: dict = field(default_factory=dict)
    wall_time: float = field(default_factory=time.monotonic, compare=False)   # monotonic: for durations
    timestamp: float = field(default_factory=time.time, compare=False)       # epoch seconds: for logs and traces
    context: EventContext | None = field(default=None, compare=False)        # stamped by the bus that emits it

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}")

    def _ctx(self, name: str) -> Any:
        return getattr(self.context, name) if self.context is not None else None

    session_id = property(lambda self: self._ctx("session_id"))
    program_id = property(lambda self: self._ctx("program_id"))
    model_id = property(lambda self: self._ctx("model_id"))
    instance_id = property(lambda self: self._ctx("instance_id"))
    worker_id = property(lambda self: self._ctx("worker_id"))
    role = property(lambda self: self._ctx("role"))
    trace_id = property(lambda self: self._ctx("trace_id"))
    versions = property(lambda self: dict(self._ctx("versions") or {}))

    @property
    def loop_id(self) -> str | None:
        """The step's loop for trace.step / batch events, else the loop the request runs on."""
        return self.data.get("loop") or self._ctx("loop_id")

    def fields(self) -> dict:
        """The seed's fields as JSON-ready data (what a JSON log line carries besides the message)."""
        return {"event": self.kind, "request_id": self.request_id, "session_id": self.session_id,
                "program_id": self.program_id, "model_id": self.model_id, "instance_id": self.instance_id,
                "loop_id": self.loop_id, "worker_id": self.worker_id, "role": self.role, "timestamp": self.timestamp,
                "trace_id": self.trace_id, "versions": self.versions, "tick": self.tick}


def subscriber_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class EventBus:
    """Fan-out to subscribers; a subscriber may filter by kind prefix (e.g. 'request.').

    Subscribers are isolated: an exception raised by one never reaches the emitter (the scheduler, a kernel, a
    cache), the other subscribers or any request. Rule: the subscriber is kept (it still gets later events); its
    first failure is reported once, as a `trace.subscriber_error` event to the other subscribers and a log warning;
    later failures are only counted (`failures[name]`).

    Contexts: a live request's `EventContext` is kept until its terminal event; program contexts until
    `close_program` (the observer closes them) or, beyond MAX_PROGRAMS, oldest first."""

    def __init__(self, source: EventSource | None = None) -> None:
        self._subs: list[tuple[str, Callable[[Event], Any]]] = []
        self.failures: dict[str, int] = {}       # subscriber name -> exceptions raised so far
        self._reported: set[int] = set()         # ids of subscriber entries whose first failure was reported
        self.source = source or EventSource()
        self.program_hooks: list[Callable[[ProgramContext], ProgramContext | None]] = []
        self._requests: dict[str, EventContext] = {}
        self._programs: OrderedDict[str, ProgramContext] = OrderedDict()
        self._lock = threading.Lock()            # programs are opened on the caller's thread, read on the driver's

    def attach(self, engine: Any, role: str = "engine") -> None:
        """Events name `engine`'s model, instance and versions from now on."""
        self.source = EventSource(engine, role, self.source.model_id)

    def subscribe(self, fn: Callable[[Event], Any], prefix: str = "") -> Callable[[], None]:
        entry = (prefix, fn)
        self._subs.append(entry)
        return lambda: self._subs.remove(entry) if entry in self._subs else None

    # ---- programs
    def open_program(self, program_id: str, sub: Submission | None = None) -> ProgramContext:
        """The context of a program about to be submitted: the caller's `submission` scope (or `sub`) gives its
        parent trace and session; a new trace otherwise. `program_hooks` may refine it (a tracer opening the
        program's request span names the trace and the parent span); a hook that raises is skipped."""
        sub = sub if sub is not None else _SUBMISSION.get()
        parent = sub.traceparent if sub is not None else None
        ctx = ProgramContext(program_id, parent.trace_id if parent else new_trace_id(),
                             parent.span_id if parent else None, sub.session_id if sub is not None else None)
        for hook in list(self.program_hooks):
            try:
                ctx = hook(ctx) or ctx
            except Exception as e:  # noqa: BLE001 - an observer's bug never refuses the work
                log.warning("program hook %s raised on %s: %s: %s", subscriber_name(hook), program_id,
                            type(e).__name__, e)
        self._remember(ctx)
        return ctx

    def program_context(self, program_id: str) -> ProgramContext | None:
        return self._programs.get(program_id)

    def close_program(self, program_id: str) -> None:
        with self._lock:
            self._programs.pop(program_id, None)

    def _remember(self, ctx: ProgramContext) -> None:
        with self._lock:
            self._programs[ctx.program_id] = ctx
            self._programs.move_to_end(ctx.program_id)
            while len(self._programs) > MAX_PROGRAMS:
                self._programs.popitem(last=False)

    # ---- emission
    def emit(self, event: Event) -> None:
        if event.context is None:
            self._stamp(event)
        for entry in list(self._subs):
            prefix, fn = entry
            if event.kind.startswith(prefix):
                try:
                    fn(event)
                except Exception as e:  # noqa: BLE001 - a subscriber's bug is its own
                    self._failed(entry, event, e)

    def _stamp(self, event: Event) -> None:
        rid = event.request_id
        if rid is None:
            ctx = self.source.engine_context()
        else:
            ctx = self._requests.get(rid)
            if ctx is None:
                ctx = self._request_context(rid)
                if event.kind not in REQUEST_END_KINDS:
                    self._requests[rid] = ctx
            elif event.kind in REQUEST_END_KINDS:
                del self._requests[rid]
        object.__setattr__(event, "context", ctx)   # once, before any subscriber sees it (the event stays frozen)

    def _request_context(self, rid: str) -> EventContext:
        pid = program_of(rid)
        program = self._programs.get(pid)
        if program is None:   # nobody opened it (a bare Engine's request, a sync program): a trace of its own
            program = ProgramContext(pid, new_trace_id())
            if pid != rid:    # its later stages share the trace
                self._remember(program)
        return replace(self.source.engine_context(), program_id=pid, session_id=program.session_id,
                       trace_id=program.trace_id, parent_span_id=program.parent_span_id,
                       loop_id=self.source.loop_of(rid))

    def _failed(self, entry: tuple[str, Callable], event: Event, error: Exception) -> None:
        name = subscriber_name(entry[1])
        self.failures[name] = self.failures.get(name, 0) + 1
        if id(entry) in self._reported:
            return
        self._reported.add(id(entry))
        message = f"{type(error).__name__}: {error}"
        log.warning("event subscriber %s raised on %s (kept; reported once): %s", name, event.kind, message)
        report = Event("trace.subscriber_error", event.request_id, event.tick,
                       {"subscriber": name, "event_kind": event.kind, "error": message}, context=event.context)
        for other in list(self._subs):
            if other is not entry and report.kind.startswith(other[0]):
                try:
                    other[1](report)
                except Exception as e:  # noqa: BLE001
                    self._failed(other, report, e)
