"""Prometheus `/metrics` of the server (in-process: fastapi's TestClient, the app's own lifespan): it parses with
prometheus_client's text parser and moves as requests run (requests by status, HTTP requests, latency per stage,
step time and batch sizes per loop, cache hit ratio per cache, queue depth and memory reserved while a request runs);
a batch is counted once, not once per member; without prometheus-client the server still serves and /metrics says
why it has nothing (501)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("multipart")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import optimized.serving.server as server  # noqa: E402
from manifests.wan import WanGenerateRequest  # noqa: E402
from optimized import Engine  # noqa: E402
from optimized.serving.observability import Observer  # noqa: E402

TIMEOUT = 60
SMALL = {"prompt_ids": [3, 4], "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
LONG = {"prompt_ids": [5, 6], "size": "64x64", "num_frames": 5, "num_inference_steps": 1000}   # runs for seconds


def scrape(client: TestClient) -> dict[tuple[str, tuple], float]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_status(client: TestClient, vid: str, want=("completed", "failed")) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        obj = client.get(f"/v1/videos/{vid}").json()
        if obj.get("status") in want:
            return obj
        time.sleep(0.05)
    raise AssertionError(f"{vid} still {obj.get('status')}")


def wait_for(check, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"never saw {what}")


def test_metrics_parse_and_move_as_requests_run(tmp_path):
    sync = Engine.from_variant("tiny-2.1-t2v", seed=0)
    with TestClient(server.create_app(sync, output_dir=tmp_path / "videos")) as client:
        before = scrape(client)
        assert value(before, "fv_requests_total", status="completed") == 0
        ids = [client.post("/v1/videos", json={**SMALL, "seed": s}).json()["id"] for s in (1, 2)]  # same prompt
        for vid in ids:
            assert wait_status(client, vid)["status"] == "completed"
        wait_for(lambda: value(scrape(client), "fv_requests_total", status="completed") == 2, "2 completed")
        after = scrape(client)
        # the server's own latency and request counts
        assert value(after, "fv_request_duration_seconds_count", status="completed") == 2
        assert value(after, "fv_requests_submitted_total") == 2
        assert value(after, "fv_http_requests_total", method="POST", route="/v1/videos", code="200") == 2
        assert value(after, "fv_http_requests_total", method="GET", route="/v1/videos/{vid}", code="200") >= 2
        for stage in ("denoise", "decode"):
            assert value(after, "fv_stage_duration_seconds_count", stage=stage) == 2, stage
            assert value(after, "fv_stage_duration_seconds_sum", stage=stage) > 0, stage
        # per loop: every denoise step of both requests was timed (whether they batched or not)
        denoise = ("fv_step_duration_seconds_count", {"loop": "wan.denoise", "phase": "denoise_step"})
        steps_batched = value(after, "fv_batch_size_sum", loop="wan.denoise")
        assert steps_batched == 2 * SMALL["num_inference_steps"], steps_batched
        assert 2 <= value(after, denoise[0], **denoise[1]) <= 4
        # the same prompt (and default negative prompt) twice: each text embedding missed once, then hit once
        assert value(after, "fv_cache_operations_total", cache="wan.text_embeds", op="miss") == 2
        assert value(after, "fv_cache_operations_total", cache="wan.text_embeds", op="hit") == 2
        assert value(after, "fv_cache_hit_ratio", cache="wan.text_embeds") == pytest.approx(0.5)
        assert value(after, "fv_memory_budget_bytes") == sync.scheduler.memory_budget_bytes
        assert value(after, "fv_queue_depth") == 0 and value(after, "fv_memory_reserved_bytes") == 0

        running = client.post("/v1/videos", json=LONG).json()["id"]
        wait_for(lambda: value(scrape(client), "fv_scheduler_requests", state="running") == 1, "a running request")
        during = scrape(client)
        assert value(during, "fv_queue_depth") == 1
        assert value(during, "fv_memory_reserved_bytes") > 0
        assert client.delete(f"/v1/videos/{running}").status_code == 200
        wait_for(lambda: value(scrape(client), "fv_requests_total", status="cancelled") == 1, "the cancel counted")
        assert value(scrape(client), "fv_queue_depth") == 0
        client.request("BREW", "/v1/videos")                  # a made-up method is one bounded label
        assert value(scrape(client), "fv_http_requests_total", method="other", route="/v1/videos", code="405") == 1
        # nothing of the ended requests is held by the observer or the bus
        observer = client.app.state.observability
        tracing = observer.tracing
        assert not observer.opened and not sync.bus._requests and not sync.bus._programs
        assert tracing is None or not (tracing.programs or tracing.stages)


def test_a_batched_step_is_counted_once_not_once_per_member():
    eng = Engine.from_variant("tiny-2.1-t2v", seed=0, batching="greedy")
    observer = Observer(eng, tracer_provider=None)
    reqs = [WanGenerateRequest(text_ids=torch.arange(1, 6), num_frames=5, height=32, width=32, num_steps=3,
                               guidance_scale=1.0, seed=s) for s in range(3)]
    handles = [eng.submit(r) for r in reqs]
    eng.run_until_idle()
    assert all(h.status == "completed" for h in handles)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(observer.metrics.render()[0].decode()) for s in fam.samples}
    assert value(samples, "fv_batch_size_count", loop="wan.denoise") == 3          # 3 steps, each one batch of 3
    assert value(samples, "fv_batch_size_sum", loop="wan.denoise") == 9
    assert value(samples, "fv_step_duration_seconds_count", loop="wan.denoise", phase="denoise_step") == 3


def test_without_prometheus_client_the_server_serves_and_metrics_says_why(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "prometheus_client" or m.startswith("prometheus_client.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)     # `import prometheus_client` now fails
    sync = Engine.from_variant("tiny-2.1-t2v", seed=0)
    with TestClient(server.create_app(sync, output_dir=tmp_path / "videos")) as client:
        r = client.get("/metrics")
        assert r.status_code == 501
        assert "prometheus-client is not installed" in r.json()["error"]["message"]
        vid = client.post("/v1/videos", json=SMALL).json()["id"]
        assert wait_status(client, vid)["status"] == "completed"


@pytest.mark.slow
def test_the_metrics_benchmark_runs_and_prints_its_ratios():
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "tools/bench_metrics.py", "--rounds", "1", "--programs", "1", "--steps",
                           "1"], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "median / off" in done.stdout and "observer: metrics + spans" in done.stdout, done.stdout
