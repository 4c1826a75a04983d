"""Observability of a served engine: Prometheus `/metrics`, OpenTelemetry spans, JSON logs (designv2's
Observability plane). `prometheus-client` and `opentelemetry-sdk` are optional (the `metrics` extra): without
prometheus-client `/metrics` answers 501 saying so; without an OpenTelemetry SDK no span is made.

    observer = install_observability(app, engine)        # server.create_app does this (one line)
    install_observability(app, engine, tracer_provider=p)  # again: the same observer, spans to `p` from now on

Sources, each read where it is produced and never blocking it:
  * the engine's EventBus, on the driver thread: stage requests (`<program>/<stage>`), steps (`trace.step`: one per
    member of a batch; the batch itself is counted once, on its first member), cache operations, batch failures;
  * the AsyncEngine's program events, on the event loop: a program's terminal event (requests by status, latency,
    per-stage seconds from the program's timings);
  * the bus's program hook, on the submitting task: a program's trace (the request span) opens there, continuing
    the caller's W3C `traceparent` (the HTTP middleware puts the header into `events.submission(...)`);
  * live values read at scrape time (queue depth, scheduler queues, memory reserved, cache hit ratios): nothing is
    paid for them between scrapes.

Span tree of one video request: fv.request (submission -> terminal event; child of the caller's span) -> fv.program
(the driver started it -> terminal) -> fv.stage (encode | denoise | decode: its scheduler request) -> fv.step (one per
step, timed by the scheduler's clock: start = end - the batch's seconds). Every engine event of the program carries the
request span's trace id (`Event.trace_id`), so logs and traces join.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, Callable

from optimized.runtime.events import REQUEST_END_KINDS, Event, ProgramContext, current_submission, submission

log = logging.getLogger("optimized.serving.observability")
event_log = logging.getLogger("optimized.events")    # lifecycle events at INFO, stages and steps at DEBUG

METRICS_MISSING = ("prometheus-client is not installed: /metrics needs the optional `metrics` extra "
                   "(pip install -e '.[metrics]')")
LOG_FORMAT_ENV = "FVGEN_LOG_FORMAT"
LOG_FORMATS = ("text", "json")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 600)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
MAX_TRACKED = 4096         # programs / stages tracked at once (beyond: the oldest spans are ended, unfinished)
TERMINAL_KINDS = ("request.completed", "request.failed", "request.cancelled")
HTTP_METHODS = ("GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS")   # any other: "other" (bounded labels)


def _hex(n: int, width: int) -> str:
    return format(n, f"0{width}x")


# ================================================================================================ metrics
class Metrics:
    """A registry of its own per observer (several apps in one process never collide)."""

    def __init__(self, observer: "Observer"):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client import ProcessCollector

        self.registry = r = CollectorRegistry()
        self.requests = Counter("fv_requests", "Video requests by final status", ["status"], registry=r)
        self.submitted = Counter("fv_requests_submitted", "Video requests submitted to the engine", registry=r)
        self.http = Counter("fv_http_requests", "HTTP requests by method, route and status code",
                            ["method", "route", "code"], registry=r)
        self.request_seconds = Histogram("fv_request_duration_seconds", "Seconds from submission to the final "
                                         "event, by final status", ["status"], buckets=LATENCY_BUCKETS, registry=r)
        self.stage_seconds = Histogram("fv_stage_duration_seconds", "Seconds per stage of a completed video "
                                       "(encode, denoise, decode, write)", ["stage"], buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.step_seconds = Histogram("fv_step_duration_seconds", "Seconds per scheduled step (one batch run), by "
                                      "loop and phase", ["loop", "phase"], buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("fv_batch_size", "Requests per scheduled step, by loop", ["loop"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_failures = Counter("fv_batch_failures", "Batched steps that raised (members rerun alone)",
                                      ["loop"], registry=r)
        self._children: dict[tuple, Any] = {}      # labelled children, looked up once (the hot path is a dict get)
        self.cache_ops: dict[tuple[str, str], int] = {}
        self._cache_lock = threading.Lock()
        r.register(_LiveCollector(observer, self))
        ProcessCollector(registry=r)               # process_resident_memory_bytes, cpu seconds, open fds

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def cache_op(self, cache: str, op: str) -> None:
        with self._cache_lock:    # cache events come from the driver and from request building on the event loop
            self.cache_ops[(cache, op)] = self.cache_ops.get((cache, op), 0) + 1

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LiveCollector:
    """Values read at scrape time from the engine (scheduler queues, memory) and the AsyncEngine (queue depth)."""

    def __init__(self, observer: "Observer", metrics: Metrics):
        self.observer, self.metrics = observer, metrics

    def describe(self) -> list:
        return []   # unchecked collector: its families depend on what the engine has

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        engine, driver = self.observer.engine, self.observer.async_engine
        sched = engine.scheduler
        depth = GaugeMetricFamily("fv_queue_depth", "Video requests in flight on the AsyncEngine (queued + running)")
        depth.add_metric([], driver.queue_depth if driver is not None else 0)
        yield depth
        if driver is not None:
            yield GaugeMetricFamily("fv_queue_capacity", "max_queue: requests in flight at once", value=driver.max_queue)
            sessions = getattr(getattr(driver, "_sessions", None), "sessions", None)
            if sessions is not None:
                yield GaugeMetricFamily("fv_sessions_open", "Realtime sessions open", value=len(sessions))
            yield CounterMetricFamily("fv_driver_errors", "Scheduler ticks / driver commands that raised",
                                      value=len(driver.driver_errors))
        queues = GaugeMetricFamily("fv_scheduler_requests", "Scheduler requests (stages) by state", labels=["state"])
        queues.add_metric(["waiting"], len(sched.waiting))
        queues.add_metric(["running"], len(sched.running))
        yield queues
        for name, doc, value in (
                ("fv_memory_reserved_bytes", "Bytes held by admitted requests' reservations", sched.reserved_bytes),
                ("fv_memory_budget_bytes", "The scheduler's memory budget", sched.memory_budget_bytes),
                ("fv_memory_peak_bytes", "Most bytes held + stepping at once so far", sched.peak_bytes)):
            yield GaugeMetricFamily(name, doc, value=value)
        device = self.observer.cuda_device()
        if device is not None:
            import torch
            yield GaugeMetricFamily("fv_device_memory_reserved_bytes", "torch.cuda.memory_reserved",
                                    value=torch.cuda.memory_reserved(device))
            yield GaugeMetricFamily("fv_device_memory_allocated_bytes", "torch.cuda.memory_allocated",
                                    value=torch.cuda.memory_allocated(device))
        with self.metrics._cache_lock:
            ops = dict(self.metrics.cache_ops)
        counts = CounterMetricFamily("fv_cache_operations", "Cache operations by cache and op (hit, miss, put, "
                                     "evict)", labels=["cache", "op"])
        ratio = GaugeMetricFamily("fv_cache_hit_ratio", "hits / (hits + misses) per cache", labels=["cache"])
        for (cache, op), n in sorted(ops.items()):
            counts.add_metric([cache, op], n)
        for cache in sorted({c for c, _ in ops}):
            hits, misses = ops.get((cache, "hit"), 0), ops.get((cache, "miss"), 0)
            if hits + misses:
                ratio.add_metric([cache], hits / (hits + misses))
        yield counts
        yield ratio
        yield CounterMetricFamily("fv_event_subscriber_failures", "Exceptions raised by event subscribers",
                                  value=sum(engine.bus.failures.values()))


# ================================================================================================ tracing
class _ProgramSpans:
    __slots__ = ("request", "program", "opened", "status")

    def __init__(self, request: Any, opened: float):
        self.request, self.program, self.opened, self.status = request, None, opened, None


class Tracing:
    """Spans request -> program -> stage -> step from the events (explicit start / end times)."""

    def __init__(self, provider: Any, step_spans: bool = True):
        from opentelemetry import trace
        self.trace = trace
        self.tracer = provider.get_tracer("fastvideo.serving")
        self.step_spans = step_spans
        self.programs: OrderedDict[str, _ProgramSpans] = OrderedDict()
        self.stages: OrderedDict[str, Any] = OrderedDict()
        self.lock = threading.Lock()

    def _parent(self, ctx: ProgramContext) -> Any:
        """The span the request hangs under: the current one (an instrumented HTTP server's), else the caller's
        `traceparent`, else none (a new trace)."""
        from opentelemetry.context import Context
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
        current = self.trace.get_current_span()
        if current.get_span_context().is_valid:
            return None                       # the default: the current context
        sub = current_submission()
        caller = sub.traceparent if sub is not None else None
        if caller is None:
            return Context()
        span = NonRecordingSpan(SpanContext(int(caller.trace_id, 16), int(caller.span_id, 16), is_remote=True,
                                            trace_flags=TraceFlags(TraceFlags.SAMPLED if caller.sampled else 0)))
        return self.trace.set_span_in_context(span, Context())

    def open(self, ctx: ProgramContext) -> ProgramContext | None:
        span = self.tracer.start_span("fv.request", context=self._parent(ctx), kind=self.trace.SpanKind.INTERNAL,
                                      attributes={"fv.request_id": ctx.program_id,
                                                  **({"fv.session_id": ctx.session_id} if ctx.session_id else {})})
        if not span.is_recording():
            return None                       # no SDK (or not sampled): nothing more is made for this program
        with self.lock:
            self.programs[ctx.program_id] = _ProgramSpans(span, time.time())
            self._bound(self.programs)
        sc = span.get_span_context()
        return replace(ctx, trace_id=_hex(sc.trace_id, 32), parent_span_id=_hex(sc.span_id, 16))

    def _bound(self, table: OrderedDict) -> None:
        while len(table) > MAX_TRACKED:
            _, old = table.popitem(last=False)
            for s in (old.program, old.request) if isinstance(old, _ProgramSpans) else (old,):
                if s is not None:
                    s.end()

    @staticmethod
    def _ns(t: float) -> int:
        return int(t * 1e9)

    def on_stage_event(self, ev: Event, pid: str, stage: str) -> None:
        """Driver thread: the scheduler events of a program's stage request."""
        rid = ev.request_id
        if ev.kind == "trace.step":
            span = self.stages.get(rid)
            if span is not None and self.step_spans:
                self._step(span, ev)
            return
        if ev.kind == "request.accepted":
            with self.lock:
                prog = self.programs.get(pid)
                if prog is None:
                    return
                if prog.program is None:      # its first stage: the driver has started the program
                    prog.program = self.tracer.start_span(
                        "fv.program", context=self.trace.set_span_in_context(prog.request),
                        start_time=self._ns(ev.timestamp), attributes={"fv.program_id": pid})
                span = self.tracer.start_span(
                    f"fv.stage {stage}", context=self.trace.set_span_in_context(prog.program),
                    start_time=self._ns(ev.timestamp),
                    attributes={"fv.stage": stage, "fv.request_id": rid, "fv.loop": ev.loop_id or ""})
                self.stages[rid] = span
                self._bound(self.stages)
            return
        span = self.stages.get(rid)
        if span is None:
            return
        if ev.kind in ("request.admitted", "request.preempted"):
            span.add_event(ev.kind, timestamp=self._ns(ev.timestamp))
        elif ev.kind in REQUEST_END_KINDS:
            with self.lock:
                self.stages.pop(rid, None)
            self._finish(span, ev.kind.split(".")[1], ev.data.get("error"), self._ns(ev.timestamp))

    def _step(self, parent: Any, ev: Event) -> None:
        d = ev.data
        end = ev.timestamp
        attrs = {"fv.loop": str(d.get("loop")), "fv.phase": str(d.get("phase")), "fv.step": int(d.get("step", 0)),
                 "fv.batch_size": int(d.get("batch_size", 1))}
        if d.get("graph") is not None:
            attrs["fv.graph"] = str(d["graph"])
        span = self.tracer.start_span("fv.step", context=self.trace.set_span_in_context(parent),
                                      start_time=self._ns(end - float(d.get("seconds", 0.0))), attributes=attrs)
        span.end(end_time=self._ns(end))

    def _finish(self, span: Any, status: str, error: str | None, end_ns: int | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode
        span.set_attribute("fv.status", status)
        if status == "failed":
            span.set_status(Status(StatusCode.ERROR, str(error or "failed")))
        span.end(end_time=end_ns)

    def on_program_end(self, pid: str, status: str, error: str | None, at: float) -> None:
        """Event loop: the program's terminal event."""
        with self.lock:
            prog = self.programs.pop(pid, None)
        if prog is None:
            return
        if prog.program is not None:
            self._finish(prog.program, status, error, self._ns(at))
        self._finish(prog.request, status, error)

    def close(self) -> None:
        with self.lock:
            spans = [s for p in self.programs.values() for s in (p.program, p.request) if s is not None]
            spans += list(self.stages.values())
            self.programs.clear()
            self.stages.clear()
        for s in spans:
            s.end()


# ================================================================================================ the observer
class Observer:
    """Metrics, spans and event logs of one engine (and the AsyncEngine driving it, once attached)."""

    def __init__(self, engine: Any, *, metrics: bool = True, tracer_provider: Any = None, step_spans: bool = True):
        self.engine = engine
        self.async_engine: Any = None
        self.metrics: Metrics | None = None
        self.metrics_error: str | None = None
        if metrics:
            try:
                self.metrics = Metrics(self)
            except ImportError:
                self.metrics_error = METRICS_MISSING
        else:
            self.metrics_error = "metrics are off for this server"
        self.tracing: Tracing | None = None
        self.configure_tracing(tracer_provider, step_spans)
        self.opened: dict[str, float] = {}            # program id -> time.time() at submission (until its end)
        self._cuda: Any = "unknown"
        self._unsubscribe: list[Callable[[], None]] = []
        self.activate()

    def activate(self) -> None:
        """Listen to the engine's bus (again, after `close`)."""
        if not self._unsubscribe:
            self._unsubscribe.append(self.engine.subscribe(self.on_event))
        if self.on_program_open not in self.engine.bus.program_hooks:
            self.engine.bus.program_hooks.append(self.on_program_open)

    def configure_tracing(self, tracer_provider: Any = None, step_spans: bool = True) -> None:
        """Spans to `tracer_provider` (default: OpenTelemetry's global one); none without opentelemetry."""
        try:
            from opentelemetry import trace
        except ImportError:
            self.tracing = None
            return
        if self.tracing is not None:
            self.tracing.close()
        self.tracing = Tracing(tracer_provider or trace.get_tracer_provider(), step_spans)

    def cuda_device(self) -> Any:
        if self._cuda == "unknown":
            device = getattr(self.engine.model, "device", None)
            self._cuda = device if getattr(device, "type", str(device).split(":")[0]) == "cuda" else None
        return self._cuda

    def attach_async(self, async_engine: Any) -> None:
        self.activate()
        if self.async_engine is async_engine and len(self._unsubscribe) > 1:
            return
        self.async_engine = async_engine
        self._unsubscribe.append(async_engine.subscribe(self.on_program_event))

    def close(self) -> None:
        for undo in self._unsubscribe:
            undo()
        self._unsubscribe = []
        if self.on_program_open in self.engine.bus.program_hooks:
            self.engine.bus.program_hooks.remove(self.on_program_open)
        if self.tracing is not None:
            self.tracing.close()

    # ---- the submitting task
    def on_program_open(self, ctx: ProgramContext) -> ProgramContext | None:
        self.opened[ctx.program_id] = time.time()
        while len(self.opened) > MAX_TRACKED:   # programs whose end this observer never sees (no AsyncEngine)
            del self.opened[next(iter(self.opened))]
        if self.metrics is not None:
            self.metrics.submitted.inc()
        refined = self.tracing.open(ctx) if self.tracing is not None else None
        opened = _HTTP_PROGRAMS.get()
        if opened is not None and refined is not None:   # the response names the request span (`traceparent`)
            opened.append(refined)
        return refined

    # ---- the driver thread
    def on_event(self, ev: Event) -> None:
        kind, m = ev.kind, self.metrics
        if kind == "trace.step":
            d = ev.data
            batch = d.get("batch")
            if m is not None and (not batch or batch[0] == ev.request_id):   # a batch is measured once
                loop = str(d.get("loop"))
                m.child(m.step_seconds, loop, str(d.get("phase"))).observe(float(d.get("seconds", 0.0)))
                m.child(m.batch_size, loop).observe(int(d.get("batch_size", 1)))
        elif kind == "trace.cache":
            if m is not None:
                m.cache_op(str(ev.data.get("store")), str(ev.data.get("op")))
            return
        elif kind == "trace.batch_failed":
            if m is not None:
                m.child(m.batch_failures, str(ev.data.get("loop"))).inc()
        rid = ev.request_id
        if rid is not None and "/" in rid and self.tracing is not None:
            pid, _, stage = rid.rpartition("/")
            self.tracing.on_stage_event(ev, pid, stage)
        if event_log.isEnabledFor(logging.DEBUG) and kind != "trace.scheduler":
            event_log.debug("%s %s", kind, rid or "", extra={"fv": ev.fields()})

    # ---- the event loop
    def on_program_event(self, ev: Any) -> None:
        """A program's VideoEvent (AsyncEngine.subscribe, or VideoProgram.subscribe for a sync engine)."""
        if ev.kind not in TERMINAL_KINDS and ev.kind != "request.accepted":
            return
        pid = ev.request_id
        if event_log.isEnabledFor(logging.INFO):
            event_log.info("%s %s", ev.kind, pid, extra={"fv": self.program_fields(ev)})
        if ev.kind == "request.accepted":
            return
        status = ev.kind.split(".")[1]
        opened = self.opened.pop(pid, None)
        now = time.time()
        m = self.metrics
        if m is not None:
            m.child(m.requests, status).inc()
            if opened is not None:
                m.child(m.request_seconds, status).observe(max(0.0, now - opened))
            if status == "completed":
                for stage, seconds in (ev.data.get("timings") or {}).items():
                    if stage != "total" and isinstance(seconds, (int, float)):
                        m.child(m.stage_seconds, stage).observe(seconds)
        if self.tracing is not None:
            self.tracing.on_program_end(pid, status, ev.data.get("error"), getattr(ev, "wall_time", now))
        self.engine.bus.close_program(pid)

    def program_fields(self, ev: Any) -> dict:
        """The seed's fields for a program-level event (from the bus's program context and the engine)."""
        ctx = self.engine.bus.program_context(ev.request_id)
        base = self.engine.bus.source.engine_context()
        return {"event": ev.kind, "request_id": ev.request_id, "program_id": ev.request_id,
                "session_id": getattr(ctx, "session_id", None), "trace_id": getattr(ctx, "trace_id", None),
                "model_id": base.model_id, "instance_id": base.instance_id, "worker_id": base.worker_id,
                "role": base.role, "versions": dict(base.versions), "timestamp": getattr(ev, "wall_time", None),
                **({"error": ev.data["error"]} if ev.data.get("error") else {})}


# ================================================================================================ HTTP
_HTTP_PROGRAMS: ContextVar[list | None] = ContextVar("fv_http_programs", default=None)   # opened by this request


class _HttpObserver:
    """ASGI middleware: the caller's `traceparent` becomes the submission scope of whatever the route submits;
    HTTP requests counted by route template; a response that opened a program names its trace (`traceparent`)."""

    def __init__(self, app: Any, observer: Observer):
        self.app, self.observer = app, observer

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        header = None
        for k, v in scope.get("headers", ()):
            if k == b"traceparent":
                header = v.decode("latin-1")
                break
        if scope["type"] == "websocket":   # a realtime session's generations continue the handshake's trace
            with submission(traceparent=header):
                return await self.app(scope, receive, send)
        code, opened = [500], []
        token = _HTTP_PROGRAMS.set(opened)

        async def observed_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                code[0] = message["status"]
                if opened and opened[-1].parent_span_id:   # the trace this request's program joined
                    ctx = opened[-1]
                    message = {**message, "headers": [*message.get("headers", ()), (
                        b"traceparent", f"00-{ctx.trace_id}-{ctx.parent_span_id}-01".encode())]}
            await send(message)

        with submission(traceparent=header):
            try:
                await self.app(scope, receive, observed_send)
            finally:
                _HTTP_PROGRAMS.reset(token)
                m = self.observer.metrics
                if m is not None:
                    route = getattr(scope.get("route"), "path", None) or "unmatched"   # a template: few values
                    method = scope.get("method", "")
                    m.child(m.http, method if method in HTTP_METHODS else "other", route, str(code[0])).inc()


def install_observability(app: Any, engine: Any, *, tracer_provider: Any = None, metrics: bool = True,
                          step_spans: bool = True) -> Observer:
    """`/metrics`, spans and event logs for `app` serving `engine` (an Engine, or the AsyncEngine driving one).
    Installed once per app: a second call gives the same observer, sending spans to `tracer_provider` if given."""
    existing = getattr(app.state, "observability", None)
    if existing is not None:
        if tracer_provider is not None:
            existing.configure_tracing(tracer_provider, step_spans)
        return existing
    sync = getattr(engine, "engine", engine) if hasattr(engine, "queue_depth") else engine
    observer = Observer(sync, metrics=metrics, tracer_provider=tracer_provider, step_spans=step_spans)
    app.state.observability = observer
    if sync is not engine:
        observer.attach_async(engine)
    else:
        _attach_at_startup(app, observer)
    app.add_middleware(_HttpObserver, observer=observer)

    async def metrics_endpoint():
        from fastapi.responses import JSONResponse, Response
        if observer.metrics is None:
            return JSONResponse({"error": {"message": observer.metrics_error, "type": "not_implemented",
                                           "code": "metrics_unavailable", "param": None}}, status_code=501)
        body, content_type = observer.metrics.render()
        return Response(body, media_type=content_type)

    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    return observer


def _attach_at_startup(app: Any, observer: Observer) -> None:
    """The server makes its AsyncEngine in its lifespan: attach to it once that has started, detach at the end."""
    from contextlib import asynccontextmanager
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any):
        try:
            async with inner(a) as state:
                driver = observer.engine.__dict__.get("_async_driver")
                if driver is not None:
                    observer.attach_async(driver)
                yield state
        finally:
            observer.close()

    app.router.lifespan_context = lifespan


# ================================================================================================ logs
EVENT_FIELDS = ("event", "request_id", "session_id", "program_id", "model_id", "instance_id", "loop_id",
                "worker_id", "role", "trace_id", "versions", "tick", "error")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message, an event's fields (the seed's:
    request, session, program, model, instance, loop, worker, role, trace id, versions) and any exception."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                       + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        fv = getattr(record, "fv", None)
        if isinstance(fv, dict):
            out.update({k: fv[k] for k in EVENT_FIELDS if fv.get(k) is not None})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def _log_format(text: str) -> str:
    if text not in LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_FORMATS)} (from --log-format or "
                                         f"${LOG_FORMAT_ENV}), got {text!r}")
    return text


def add_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", type=_log_format, default=os.environ.get(LOG_FORMAT_ENV) or "text",
                        metavar="{text,json}",
                        help=f"text, or json: one JSON object per line on stderr (request lifecycle events at "
                             f"INFO with request, trace, model, instance, worker ids and versions); the default is "
                             f"${LOG_FORMAT_ENV} when set")


def configure_logging(log_format: str, stream: Any = None, level: int = logging.INFO) -> dict:
    """Logging for `log_format`; returns the uvicorn.Config keywords that go with it (json: uvicorn installs no
    handlers of its own, its records reach the JSON handler)."""
    if log_format != "json":
        return {}
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    return {"log_config": None}
