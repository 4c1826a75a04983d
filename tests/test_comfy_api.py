"""The ComfyUI-compatible endpoints against a live server (uvicorn on 127.0.0.1, a free port) serving the tiny wan
t2v model directory: POST /prompt -> prompt_id / number / node_errors, /history once finished (frames bitwise equal
to the direct request's), /api/ aliases, /object_info input order, /queue and /interrupt, and an invalid workflow ->
400 with node_errors naming the node and input, before anything runs."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
API_FILE = ROOT / "examples" / "workflows" / "wan_t2v_tiny_api.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    def __init__(self, tmp: Path, model: Path):
        self.port, self.out = _free_port(), tmp / "videos"
        self.log = open(tmp / "server.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "optimized.serving.server", "--model", str(model),
                                      "--port", str(self.port), "--output-dir", str(self.out)], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90:
            if self.proc.poll() is not None:
                break
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start: {(tmp / 'server.log').read_text()[-2000:]}")

    def history(self, prompt_id: str, deadline: float = 120.0) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < deadline:
            h = self.client.get(f"/history/{prompt_id}").json()
            if h:
                return h[prompt_id]
            time.sleep(0.1)
        raise AssertionError(f"prompt {prompt_id} did not finish")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.client.close()
        self.log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from parity.workflow_checks import write_tiny_models
    tmp = tmp_path_factory.mktemp("comfy")
    model = write_tiny_models(tmp / "models")
    server = ComfyServer(tmp, model)
    yield server, model
    server.stop()


def _api_prompt() -> dict:
    return json.loads(API_FILE.read_text())


@pytest.fixture(scope="module")
def direct_frames(served):
    from optimized import Engine
    from parity.workflow_checks import CASES, direct_request
    engine = Engine.from_checkpoint(served[1])
    return engine.generate_video(direct_request(engine, CASES[0].settings)).frames.numpy()


@pytest.mark.parametrize("name", ["wan_t2v_tiny_api.json", "wan_t2v_tiny_ui.json"])
def test_post_prompt_runs_and_history_holds_frames_equal_to_the_direct_request(served, direct_frames, name):
    import numpy as np
    from PIL import Image
    server, _ = served
    prompt = json.loads((API_FILE.parent / name).read_text())   # a UI export is accepted as well
    r = server.client.post("/prompt", json={"prompt": prompt, "client_id": "test"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["node_errors"] == {} and isinstance(body["number"], int) and body["prompt_id"]
    item = server.history(body["prompt_id"])
    assert item["status"]["status_str"] == "success" and item["status"]["completed"] is True
    assert item["prompt"][1] == body["prompt_id"] and item["prompt"][4] == ["28"]
    images = item["outputs"]["28"]["images"]
    assert [i["filename"] for i in images] == [f"frame_{k:05d}.png" for k in range(5)]
    got = np.stack([np.asarray(Image.open(io_bytes(server.client.get("/view", params=i).content)))
                    for i in images])
    assert got.shape == direct_frames.shape and (got == direct_frames).all()


def io_bytes(data: bytes):
    import io
    return io.BytesIO(data)


def test_api_aliases_object_info_and_queue(served):
    server, _ = served
    info = server.client.get("/api/object_info").json()
    assert info["KSampler"]["input_order"]["required"] == ["model", "seed", "steps", "cfg", "sampler_name",
                                                          "scheduler", "positive", "negative", "latent_image",
                                                          "denoise"]
    assert info["KSampler"]["input"]["required"]["seed"][1]["control_after_generate"] is True
    assert "uni_pc" in info["KSampler"]["input"]["required"]["sampler_name"][0]
    assert server.client.get("/object_info/EmptyHunyuanLatentVideo").json()["EmptyHunyuanLatentVideo"][
        "input_order"]["required"] == ["width", "height", "length", "batch_size"]
    q = server.client.get("/api/queue").json()
    assert set(q) == {"queue_running", "queue_pending"}
    first = server.client.post("/api/prompt", json={"prompt": _api_prompt()}).json()["prompt_id"]
    assert server.history(first)["status"]["status_str"] == "success"
    reseeded = _api_prompt()
    reseeded["3"]["inputs"]["seed"] = 1234
    r = server.client.post("/api/prompt", json={"prompt": reseeded})
    assert r.status_code == 200
    item = server.history(r.json()["prompt_id"])
    assert item["status"]["status_str"] == "success"
    cached = next(m[1]["nodes"] for m in item["status"]["messages"] if m[0] == "execution_cached")
    assert cached == ["6", "7"]   # the text nodes: their keys hold no seed
    assert server.client.get("/api/history/no-such-id").json() == {}


def test_interrupt_cancels_the_running_prompt(served):
    server, _ = served
    prompt = _api_prompt()
    prompt["3"]["inputs"]["steps"] = 60     # long enough to be interrupted mid-run
    pid = server.client.post("/prompt", json={"prompt": prompt}).json()["prompt_id"]
    t0 = time.monotonic()
    while not server.client.get("/queue").json()["queue_running"] and time.monotonic() - t0 < 30:
        time.sleep(0.02)
    assert server.client.post("/interrupt").status_code == 200
    item = server.history(pid)
    assert item["status"]["status_str"] == "error" and item["outputs"] == {}
    assert any(m[0] == "execution_interrupted" for m in item["status"]["messages"])


def _broken(kind: str) -> dict:
    p = copy.deepcopy(_api_prompt())
    if kind == "unknown-on-model-path":
        p["60"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["37", 0], "lora_name": "x.safetensors",
                                                                 "strength_model": 1.0}}
        p["48"]["inputs"]["model"] = ["60", 0]
    elif kind == "dangling":
        p["3"]["inputs"]["latent_image"] = ["99", 0]
    elif kind == "wrong-type":
        p["3"]["inputs"]["positive"] = ["40", 0]
    elif kind == "cycle":
        p["48"]["inputs"]["model"] = ["3", 0]
    elif kind == "sampler":
        p["3"]["inputs"]["sampler_name"] = "dpmpp_2m"
    elif kind == "not-served":
        p["37"]["inputs"]["unet_name"] = "wan2.1_t2v_14B_fp16.safetensors"
    return p


@pytest.mark.parametrize("kind, node, input_name", [
    ("unknown-on-model-path", "60", None), ("dangling", "3", "latent_image"), ("wrong-type", "3", "positive"),
    ("cycle", "3", None), ("sampler", "3", "sampler_name"), ("not-served", "37", "unet_name")])
def test_an_invalid_workflow_is_400_with_node_errors(served, kind, node, input_name):
    server, _ = served
    before = server.client.get("/history").json()
    r = server.client.post("/prompt", json={"prompt": _broken(kind)})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert node in body["node_errors"], body
    errors = body["node_errors"][node]["errors"]
    if input_name is not None:
        assert any(e["extra_info"].get("input_name") == input_name for e in errors), errors
    assert server.client.get("/history").json().keys() == before.keys()   # nothing ran


def test_a_body_without_a_prompt_is_400(served):
    server, _ = served
    r = server.client.post("/prompt", json={"nodes": 3})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_prompt"


def test_the_comfy_routes_need_the_api_key_and_a_variant_server_takes_its_variant_name(tmp_path):
    """In-process (TestClient runs the app's lifespan): a random-weight server serves its variant by name."""
    from fastapi.testclient import TestClient

    from optimized import Engine
    from optimized.serving.server import create_app
    engine = Engine.from_variant("tiny-2.1-t2v", seed=0)
    engine.__dict__["variant"] = "tiny-2.1-t2v"
    prompt = _api_prompt()
    for nid, name in (("37", "unet_name"), ("38", "clip_name"), ("39", "vae_name")):
        prompt[nid]["inputs"][name] = "tiny-2.1-t2v"
    with TestClient(create_app(engine, output_dir=tmp_path, api_key="sekret")) as client:
        assert client.post("/prompt", json={"prompt": prompt}).status_code == 401
        assert client.get("/api/object_info").status_code == 401
        r = client.post("/api/prompt", json={"prompt": prompt}, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200, r.text
        pid, t0 = r.json()["prompt_id"], time.monotonic()
        while time.monotonic() - t0 < 60:
            h = client.get(f"/history/{pid}", headers={"X-API-Key": "sekret"}).json()
            if h:
                break
            time.sleep(0.05)
        assert h[pid]["status"]["status_str"] == "success", h
        assert len(h[pid]["outputs"]["28"]["images"]) == 5
