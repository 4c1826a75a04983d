"""The OpenAI-style HTTP server against a live uvicorn process on 127.0.0.1 (a random free port) with httpx:
create / retrieve / content / delete / SSE events / health / models, bad fields -> 4xx naming the field, a full
queue -> 429, concurrent requests, cancellation mid-run. Needs the `serve` extra and httpx (skipped without them):

    pip install -e '.[serve-test]' && python -m pytest -q -p no:xdist tests/test_server.py
"""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("multipart")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path, *args: str, env: dict | None = None, headers: dict | None = None):
        self.port = free_port()
        self.out = tmp / "videos"
        self.log = open(tmp / "server.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "optimized.serving.server", *args, "--port",
                                      str(self.port), "--output-dir", str(self.out)], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=30, headers=headers)
        t0 = time.monotonic()
        while time.monotonic() - t0 < DEADLINE:
            if self.proc.poll() is not None:
                break
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not start: {(tmp / 'server.log').read_text()[-2000:]}")

    def wait(self, vid: str, statuses=("completed", "failed", "cancelled")) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < DEADLINE:
            obj = self.client.get(f"/v1/videos/{vid}").json()
            if obj["status"] in statuses:
                return obj
            time.sleep(0.05)
        raise AssertionError(f"{vid} still {obj['status']} after {DEADLINE}s")

    def kill9(self) -> None:
        """SIGKILL: nothing of the server's shutdown runs."""
        self.client.close()
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("wan"), "wan", "--variant", "tiny", "--max-queue", "3")
    yield s
    s.stop()


def error_of(r) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "code", "param"} <= set(body["error"]), body
    return body["error"]


def test_health_and_models(wan):
    h = wan.client.get("/health").json()
    assert h["status"] == "ok" and h["model"] == "wan-tiny-2.1-t2v" and h["max_queue"] == 3
    models = wan.client.get("/v1/models").json()
    card = models["data"][0]["deployment_card"]
    assert models["data"][0]["id"] == "wan-tiny-2.1-t2v" and card["family"] == "wan"
    assert card["weights_version"] == "random:wan:tiny-2.1-t2v:0"


def test_create_retrieve_content(wan):
    r = wan.client.post("/v1/videos", json={"prompt": "a red fox", "size": "32x32", "frames": 5, "steps": 3,
                                            "guidance": 4.0, "seed": 7})
    assert r.status_code == 200, r.text
    obj = r.json()
    assert obj["object"] == "video" and obj["status"] in ("queued", "in_progress", "completed")
    done = wan.wait(obj["id"])
    assert done["status"] == "completed" and done["url"] == f"/v1/videos/{obj['id']}/content"
    assert done["progress"] == 100 and done["seed"] == 7 and done["size"] == "32x32"
    mp4 = wan.client.get(done["url"])
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4" and mp4.content[4:8] == b"ftyp"
    side = wan.client.get(done["url"], params={"variant": "sidecar"}).json()
    assert side["seed"] == 7 and side["request"]["num_steps"] == 3 and side["request"]["guidance_scale"] == 4.0
    png = wan.client.get(done["url"], params={"variant": "thumbnail"})
    assert png.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in wan.out.iterdir() if p.name.startswith(".")]   # no temp files left
    gone = wan.client.delete(f"/v1/videos/{obj['id']}").json()
    assert gone == {"id": obj["id"], "object": "video.deleted", "deleted": True}
    assert wan.client.get(f"/v1/videos/{obj['id']}").status_code == 404
    assert not (wan.out / f"{obj['id']}.mp4").exists()


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "colour": "red"}, 400, "colour"),
    ({"prompt": "x", "size": "big"}, 400, "size"),
    ({"prompt": "x", "size": "30x32"}, 400, "size"),
    ({"prompt": "x", "height": 30}, 400, "height"),
    ({"prompt": "x", "frames": 6}, 400, "frames"),
    ({"prompt": "x", "steps": "many"}, 400, "steps"),
    ({"prompt": "x", "guidance": "high"}, 400, "guidance"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "image": "%%%"}, 400, "image"),
    ({"prompt_ids": [1, "a"]}, 400, "prompt_ids"),
    ({"size": "32x32"}, 400, "prompt"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
])
def test_bad_fields_get_a_4xx_naming_the_field(wan, body, status, param):
    r = wan.client.post("/v1/videos", json=body)
    assert r.status_code == status, r.text
    assert error_of(r)["param"] == param, r.text


def test_malformed_bodies_and_unknown_ids(wan):
    r = wan.client.post("/v1/videos", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    assert wan.client.get("/v1/videos/nosuch").status_code == 404
    assert wan.client.delete("/v1/videos/nosuch").status_code == 404
    assert wan.client.get("/v1/videos/nosuch/content").status_code == 404


def test_concurrent_requests_all_complete(wan):
    def one(seed: int) -> dict:
        with httpx.Client(base_url=wan.url, timeout=30) as c:
            r = c.post("/v1/videos", json={"prompt_ids": [3, 4, seed], "steps": 2, "seed": seed})
            assert r.status_code == 200, r.text
            return r.json()

    with ThreadPoolExecutor(3) as pool:
        objs = list(pool.map(one, (1, 2, 3)))
    finals = [wan.wait(o["id"]) for o in objs]
    assert [f["status"] for f in finals] == ["completed"] * 3
    blobs = [wan.client.get(f["url"]).content for f in finals]
    assert len(set(blobs)) == 3


def test_full_queue_gets_429_and_cancel_mid_run(wan):
    ids = []
    for seed in range(3):  # max_queue 3: three long requests fill it
        r = wan.client.post("/v1/videos", json={"prompt_ids": [5], "steps": 500, "seed": seed})
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    r = wan.client.post("/v1/videos", json={"prompt_ids": [5], "steps": 2})
    assert r.status_code == 429 and error_of(r)["type"] == "rate_limit_error"
    # SSE: read the first one's events until a denoise step has run, then cancel it mid-run
    seen = []
    with wan.client.stream("GET", f"/v1/videos/{ids[0]}/events", timeout=30) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                seen.append((kind, json.loads(line[6:])))
                if kind == "progress" and seen[-1][1]["step"] >= 2:
                    break
    assert seen[0][0] == "request.accepted" and seen[-1][1]["stage"] == "denoise"
    for vid in ids:   # deleting an unfinished video cancels it; the answer is the API's deleted object
        obj = wan.client.delete(f"/v1/videos/{vid}").json()
        assert obj == {"id": vid, "object": "video.deleted", "deleted": True}, obj
    for path in ("", "/content", "/events"):  # gone for clients at once
        assert wan.client.get(f"/v1/videos/{ids[0]}{path}").status_code == 404
    assert not any((wan.out / f"{vid}.mp4").exists() for vid in ids)
    r = wan.client.post("/v1/videos", json={"prompt_ids": [5], "steps": 2})  # the queue has room again
    assert r.status_code == 200 and wan.wait(r.json()["id"])["status"] == "completed"


def png_bytes_of(h: int, w: int) -> bytes:
    from PIL import Image
    import numpy as np
    img = (np.indices((h, w)).sum(0) * 7 % 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(np.stack([img, img[::-1], img.T[:h, :w] if h == w else img], -1)).save(buf, "PNG")
    return buf.getvalue()


def test_image_upload_multipart_and_base64(tmp_path):
    pytest.importorskip("PIL")
    s = Server(tmp_path, "cosmos3", "--variant", "tiny")
    try:
        png = png_bytes_of(32, 32)
        r = s.client.post("/v1/videos", data={"prompt": "a robot arm", "size": "32x32", "frames": "5", "steps": "2"},
                          files={"image": ("in.png", png, "image/png")})
        assert r.status_code == 200, r.text
        b = s.client.post("/v1/videos", json={"prompt": "a robot arm", "size": "32x32", "steps": 2,
                                              "image": "data:image/png;base64," + base64.b64encode(png).decode()})
        assert b.status_code == 200, b.text
        for vid in (r.json()["id"], b.json()["id"]):
            assert s.wait(vid)["status"] == "completed"
            side = s.client.get(f"/v1/videos/{vid}/content", params={"variant": "sidecar"}).json()
            assert side["request"]["vision_condition_frames"] == [0]   # conditioned on the encoded upload
        bad = s.client.post("/v1/videos", data={"prompt": "x"}, files={"image": ("in.png", b"not an image")})
        assert bad.status_code == 400 and error_of(bad)["param"] == "image"
    finally:
        s.stop()
