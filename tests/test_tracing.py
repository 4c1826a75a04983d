"""OpenTelemetry spans of the server (in-process app, an InMemorySpanExporter): one video request exports the tree
fv.request -> fv.program -> fv.stage (denoise, decode) -> fv.step with parent links, continuing the caller's W3C
`traceparent` (trace id and parent span; the response names the request span); without one a new trace starts, and
the engine's events and the JSON log lines carry the span tree's trace id."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("multipart")
pytest.importorskip("opentelemetry.sdk")

from fastapi.testclient import TestClient  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

import optimized.serving.server as server  # noqa: E402
from optimized import Engine  # noqa: E402
from optimized.serving.observability import configure_logging, install_observability  # noqa: E402

TIMEOUT = 60
SMALL = {"prompt_ids": [3, 4], "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
LONG = {"prompt_ids": [5, 6], "size": "64x64", "num_frames": 5, "num_inference_steps": 1000}
CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def served(tmp_path):
    sync = Engine.from_variant("tiny-2.1-t2v", seed=0)
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = server.create_app(sync, output_dir=tmp_path / "videos")
    install_observability(app, sync, tracer_provider=provider)    # the app's observer: spans to this provider
    events: list = []
    sync.subscribe(events.append)
    return app, exporter, events


def wait_until(check, what: str):
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"never saw {what}")


def finished(client: TestClient, vid: str) -> str:
    return wait_until(lambda: (s := client.get(f"/v1/videos/{vid}").json()["status"]) in
                      ("completed", "failed", "cancelled") and s, f"{vid} ending")


def the_request_span(exporter: InMemorySpanExporter, vid: str):
    return wait_until(lambda: next((s for s in exporter.get_finished_spans() if s.name == "fv.request"
                                    and s.attributes.get("fv.request_id") == vid), None), f"{vid}'s request span")


def test_one_request_exports_the_span_tree_continuing_the_callers_traceparent(tmp_path):
    app, exporter, events = served(tmp_path)
    with TestClient(app) as client:
        r = client.post("/v1/videos", json=SMALL, headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
        assert r.status_code == 200, r.text
        vid = r.json()["id"]
        assert finished(client, vid) == "completed"
        request_span = the_request_span(exporter, vid)
        tracing = app.state.observability.tracing
        wait_until(lambda: not (tracing.programs or tracing.stages), "the ended request's spans forgotten")
    spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == int(CALLER_TRACE, 16)]
    names = sorted(s.name for s in spans)
    assert names.count("fv.request") == names.count("fv.program") == 1, names
    assert {"fv.stage denoise", "fv.stage decode"} <= set(names), names
    by_id = {s.context.span_id: s for s in spans}
    program = next(s for s in spans if s.name == "fv.program")
    # the caller's span is the request span's (remote) parent
    assert request_span.parent is not None and request_span.parent.span_id == int(CALLER_SPAN, 16)
    assert request_span.parent.is_remote
    assert program.parent.span_id == request_span.context.span_id
    stages = {s.name.split()[1]: s for s in spans if s.name.startswith("fv.stage")}
    assert all(s.parent.span_id == program.context.span_id for s in stages.values())
    steps = [s for s in spans if s.name == "fv.step"]
    assert all(by_id[s.parent.span_id].name.startswith("fv.stage") for s in steps), "a step outside any stage"
    denoise_steps = sorted(s.attributes["fv.step"] for s in steps if s.parent.span_id == stages["denoise"].context.span_id)
    assert denoise_steps == list(range(SMALL["num_inference_steps"])), denoise_steps
    assert any(s.parent.span_id == stages["decode"].context.span_id for s in steps), "no decode step span"
    for s in steps:   # a step lies within its stage (the scheduler's clock: start = end - the batch's seconds)
        parent = by_id[s.parent.span_id]
        assert parent.start_time - 2_000_000 <= s.start_time <= s.end_time <= parent.end_time + 2_000_000
    assert request_span.attributes["fv.status"] == "completed"
    # the response names the request span; the engine's events of this program carry the caller's trace id
    assert r.headers["traceparent"] == f"00-{CALLER_TRACE}-{request_span.context.span_id:016x}-01"
    mine = [ev for ev in events if ev.request_id and ev.request_id.startswith(vid + "/")]
    assert mine and {ev.trace_id for ev in mine} == {CALLER_TRACE}


def test_without_a_traceparent_a_new_trace_starts_and_logs_carry_its_id(tmp_path):
    app, exporter, events = served(tmp_path)
    stream, root = io.StringIO(), logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging("json", stream=stream)
        with TestClient(app) as client:
            vid = client.post("/v1/videos", json=SMALL).json()["id"]
            assert finished(client, vid) == "completed"
            span = the_request_span(exporter, vid)
            cancelled = client.post("/v1/videos", json=LONG).json()["id"]
            wait_until(lambda: any(ev.request_id == f"{cancelled}/denoise" and ev.kind == "trace.step"
                                   for ev in list(events)), "the long request stepping")
            assert client.delete(f"/v1/videos/{cancelled}").status_code == 200
            cancelled_span = the_request_span(exporter, cancelled)
    finally:
        root.handlers = saved[0]
        root.setLevel(saved[1])
    assert span.parent is None, "a request without a traceparent is not a root span"
    trace_id = f"{span.context.trace_id:032x}"
    assert {ev.trace_id for ev in events if ev.request_id and ev.request_id.startswith(vid + "/")} == {trace_id}
    assert cancelled_span.attributes["fv.status"] == "cancelled" and cancelled_span.context.trace_id != span.context.trace_id
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    done = [d for d in lines if d.get("event") == "request.completed" and d.get("request_id") == vid]
    assert done, f"no JSON line for {vid}'s completion: {lines[:5]}"
    line = done[0]
    assert line["trace_id"] == trace_id and line["level"] == "info" and line["logger"] == "optimized.events"
    assert line["model_id"] and line["worker_id"] and line["versions"]["weights"]


def test_without_opentelemetry_the_server_serves_and_still_counts(tmp_path, monkeypatch):
    import sys
    for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)        # `import opentelemetry` now fails
    sync = Engine.from_variant("tiny-2.1-t2v", seed=0)
    app = server.create_app(sync, output_dir=tmp_path / "videos")
    assert app.state.observability.tracing is None
    with TestClient(app) as client:
        vid = client.post("/v1/videos", json=SMALL,
                          headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}).json()["id"]
        assert finished(client, vid) == "completed"
        assert 'fv_requests_total{status="completed"} 1.0' in client.get("/metrics").text


@pytest.mark.parametrize("argv, env, want", [([], None, "text"), (["--log-format", "json"], None, "json"),
                                             ([], "json", "json"), (["--log-format", "text"], "json", "text")])
def test_log_format_comes_from_the_option_or_the_environment(argv, env, want, monkeypatch):
    if env is None:
        monkeypatch.delenv("FVGEN_LOG_FORMAT", raising=False)
    else:
        monkeypatch.setenv("FVGEN_LOG_FORMAT", env)
    assert server.build_parser().parse_args(argv).log_format == want


@pytest.mark.parametrize("argv, env", [(["--log-format", "xml"], None), ([], "yaml")])
def test_a_bad_log_format_is_a_usage_error(argv, env, monkeypatch, capsys):
    if env is not None:
        monkeypatch.setenv("FVGEN_LOG_FORMAT", env)
    with pytest.raises(SystemExit) as stop:
        server.build_parser().parse_args(argv)
    assert stop.value.code == 2 and "must be one of text, json" in capsys.readouterr().err


def test_a_failing_step_fails_its_spans_and_counts_as_failed(tmp_path):
    app, exporter, events = served(tmp_path)
    sync = app.state.observability.engine
    kernel = sync.loop("denoise")

    def planted(states, plans):
        raise RuntimeError("planted step failure")

    kernel.run_step = planted      # every denoise step raises: the request fails at its first step
    with TestClient(app) as client:
        vid = client.post("/v1/videos", json=SMALL).json()["id"]
        assert finished(client, vid) == "failed"
        request_span = the_request_span(exporter, vid)
        metrics = client.get("/metrics").text
    assert 'fv_requests_total{status="failed"} 1.0' in metrics
    spans = {s.name: s for s in exporter.get_finished_spans() if s.context.trace_id == request_span.context.trace_id}
    for name in ("fv.request", "fv.program", "fv.stage denoise"):
        assert spans[name].status.status_code.name == "ERROR", (name, spans[name].status)
        assert spans[name].attributes["fv.status"] == "failed"
    assert "planted step failure" in spans["fv.stage denoise"].status.description
    assert "fv.stage decode" not in spans and "fv.step" not in spans, sorted(spans)
