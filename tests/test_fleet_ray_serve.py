"""`fvgen serve --fleet deployment.yaml` (python -m optimized.serving.fvgen serve --fleet ..., a subprocess) with 1
encoder, 2 denoisers and 1 decoder as actors on a local Ray cluster: /v1/videos answers bitwise the co-located
server's video; a denoiser actor's process SIGKILLed while it runs a request's denoise stage: the request completes
on the other denoiser with the same video, written once. Slow (Ray start-up, five model loads)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("yaml")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from fastapi.testclient import TestClient

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 300.0
FAST = {"prompt": "a red fox", "size": "32x32", "frames": 5, "steps": 3, "guidance": 4.0, "seed": 7}
LONG = {**FAST, "prompt": "a slow heron", "steps": 120, "seed": 11}
YAML = """
version: 1
name: ray-test
model: {family: wan, variant: tiny-2.1-t2v}
transport: ray_object_store
placement: {backend: ray, address: local, num_cpus: 2, strategy: PACK}
roles:
  encoder:  {replicas: 1, num_cpus: 0.25}
  denoiser: {replicas: 2, num_cpus: 0.25}
  decoder:  {replicas: 1, num_cpus: 0.25}
routing: {health_interval_s: 0.1, health_timeout_s: 30, stage_timeout_s: 300}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(client, vid):
    t0 = time.monotonic()
    while time.monotonic() - t0 < DEADLINE:
        obj = client.get(f"/v1/videos/{vid}").json()
        if obj["status"] in ("completed", "failed"):
            return obj
        time.sleep(0.05)
    raise AssertionError(f"{vid} still {obj['status']}")


def contents(client, vid):
    return {v: client.get(f"/v1/videos/{vid}/content", params={"variant": v}).content
            for v in ("video", "thumbnail")}


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    from optimized.serving.loading import load_engine
    from optimized.serving.server import create_app
    app = create_app(load_engine("wan", None, "tiny-2.1-t2v"), output_dir=tmp_path_factory.mktemp("co"))
    out = {}
    with TestClient(app) as client:
        for name, body in (("fast", FAST), ("long", LONG)):
            vid = client.post("/v1/videos", json=body).json()["id"]
            assert wait(client, vid)["status"] == "completed"
            out[name] = contents(client, vid)
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    (tmp / "deployment.yaml").write_text(YAML)
    port = free_port()
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "optimized.serving.fvgen", "serve", "--fleet",
                             str(tmp / "deployment.yaml"), "--port", str(port), "--output-dir", str(tmp / "videos")],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < DEADLINE:
            assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        yield client, tmp
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_fleet_on_ray_serves_the_colocated_video(fleet, colocated):
    client, tmp = fleet
    status = client.get("/v1/fleet").json()
    pids = {r["replica_id"]: r["pid"] for reps in status["roles"].values() for r in reps}
    assert sorted(pids) == ["decoder-0", "denoiser-0", "denoiser-1", "encoder-0"]
    assert len(set(pids.values())) == 4 and os.getpid() not in pids.values()   # one process per replica
    vid = client.post("/v1/videos", json=FAST).json()["id"]
    assert wait(client, vid)["status"] == "completed"
    assert contents(client, vid) == colocated["fast"]


def test_killing_a_denoiser_mid_stage_completes_on_the_other(fleet, colocated):
    client, tmp = fleet
    vid = client.post("/v1/videos", json=LONG).json()["id"]
    killed = None
    t0 = time.monotonic()
    while killed is None and time.monotonic() - t0 < DEADLINE:
        for r in client.get("/v1/fleet").json()["roles"]["denoiser"]:
            if r["running"].startswith(f"{vid}/denoiser"):
                os.kill(r["pid"], signal.SIGKILL)
                killed = r["replica_id"]
                break
        time.sleep(0.02)
    assert killed is not None, "the denoise stage was never seen running"
    done = wait(client, vid)
    assert done["status"] == "completed", done
    assert contents(client, vid) == colocated["long"]              # the same video, from the surviving replica
    events = client.get(f"/v1/videos/{vid}/events").text
    assert events.count("event: request.completed") == 1
    files = sorted(p.name for p in (tmp / "videos").iterdir() if p.name.startswith(vid))
    assert files == [f"{vid}.json", f"{vid}.mp4", f"{vid}.png"]  # written once, nothing left over
    health = {r["replica_id"]: r["status"] for r in client.get("/v1/fleet").json()["roles"]["denoiser"]}
    assert health[killed] == "dead" and list(health.values()).count("healthy") == 1
