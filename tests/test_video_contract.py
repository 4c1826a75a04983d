"""The rest of the /v1/videos contract against a live server (tiny wan): no server path in any response or SSE
event, the error envelope (with `code`) on every error the app can give (framework 404 / 405 included), the list
cursor (after / limit / order, OpenAI's list shape), the API's four statuses only (a cancelled video is failed with
code cancelled), the start-up line, `fvgen serve --help`, and artifacts honouring the umask (in-process)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("multipart")
httpx = pytest.importorskip("httpx")

from tests.test_server import ROOT, Server, error_of  # noqa: E402

SMALL = {"prompt_ids": [3, 4], "size": "32x32", "num_frames": 5, "num_inference_steps": 1}


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("contract"), "wan", "--variant", "tiny")
    yield s
    s.stop()


def sse_text(wan, vid: str) -> str:
    with wan.client.stream("GET", f"/v1/videos/{vid}/events", timeout=60) as r:
        return "".join(r.iter_text())


def test_start_up_line_names_the_url(wan):
    log = (wan.out.parent / "server.log").read_text()
    assert f"serving wan-tiny-2.1-t2v on http://127.0.0.1:{wan.port}" in log, log[-500:]


def test_no_server_path_in_responses_or_events(wan):
    vid = wan.client.post("/v1/videos", json={**SMALL, "seed": 1}).json()["id"]
    events = sse_text(wan, vid)                       # replay + live, to the terminal event
    done = wan.wait(vid)
    completed = [json.loads(block.split("data: ", 1)[1]) for block in events.split("\n\n")
                 if block.startswith("event: request.completed")]
    assert completed and completed[0]["urls"]["video"] == f"/v1/videos/{vid}/content", events[-400:]
    assert "paths" not in completed[0]
    texts = [events, json.dumps(done), wan.client.get("/v1/videos").text, wan.client.get("/v1/models").text,
             sse_text(wan, vid)]                      # the ended video's stream too
    for root in {str(wan.out), str(wan.out.resolve()), str(wan.out.parent)}:
        for text in texts:
            assert root not in text, (root, text[:300])


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing", 404), ("PUT", "/v1/videos", 405), ("GET", "/v1/videos/nosuch", 404),
    ("GET", "/v1/videos?limit=abc", 400), ("GET", "/v1/videos?limit=0", 400), ("GET", "/v1/videos?order=up", 400),
    ("GET", "/v1/videos?after=video_nosuch", 400), ("GET", "/v1/models/nosuch", 404),
    ("GET", "/v1/videos/nosuch/content?variant=spritesheet", 400),
])
def test_every_error_is_the_envelope(wan, method, path, status):
    r = wan.client.request(method, path)
    assert r.status_code == status, r.text
    err = error_of(r)
    assert isinstance(err["code"], str) and err["code"] and isinstance(err["message"], str)


def test_list_cursor(wan):
    ids = [wan.client.post("/v1/videos", json={**SMALL, "seed": s}).json()["id"] for s in range(3)]
    for vid in ids:
        assert wan.wait(vid)["status"] == "completed"
    mine = set(ids)
    asc = [v["id"] for v in wan.client.get("/v1/videos", params={"order": "asc", "limit": 100}).json()["data"]]
    assert [v for v in asc if v in mine] == ids                      # creation order
    page = wan.client.get("/v1/videos", params={"limit": 2}).json()  # default order: newest first
    assert page["object"] == "list" and [v["id"] for v in page["data"]] == ids[::-1][:2]
    assert page["has_more"] is True and page["first_id"] == ids[2] and page["last_id"] == ids[1]
    rest = wan.client.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}).json()
    assert rest["data"][0]["id"] == ids[0]
    assert all(v["object"] == "video" and v["status"] in ("queued", "in_progress", "completed", "failed")
               for v in page["data"] + rest["data"])
    wan.client.delete(f"/v1/videos/{ids[1]}")                       # deleted: out of the list
    listed = [v["id"] for v in wan.client.get("/v1/videos", params={"limit": 100}).json()["data"]]
    assert ids[1] not in listed and ids[0] in listed and ids[2] in listed


def test_a_cancelled_video_is_failed_with_code_cancelled(tmp_path):
    """SIGTERM cancels in-flight work; after a restart the video is `failed` (code cancelled or interrupted),
    never a status outside the API's four."""
    s = Server(tmp_path, "wan", "--variant", "tiny")
    try:
        vid = s.client.post("/v1/videos", json={**SMALL, "num_inference_steps": 1000}).json()["id"]
        s.wait(vid, ("in_progress",))
    finally:
        s.stop()
    s = Server(tmp_path, "wan", "--variant", "tiny")
    try:
        obj = s.client.get(f"/v1/videos/{vid}").json()
        assert obj["status"] == "failed" and obj["error"]["code"] in ("cancelled", "interrupted"), obj
        assert {v["status"] for v in s.client.get("/v1/videos").json()["data"]} <= {"failed"}
    finally:
        s.stop()


def test_fvgen_serve_help_names_itself_and_every_default():
    p = subprocess.run([sys.executable, "-m", "optimized.serving.fvgen", "serve", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: fvgen serve")
    for option, default in (("--port", "8000"), ("--host", "127.0.0.1"), ("--output-dir", "fv_videos"),
                            ("--max-queue", "16"), ("--keep-videos", "1000"), ("--device", "cpu"),
                            ("--dtype", "fp32"), ("--seed-weights", "0"), ("--plan", "none")):
        block = p.stdout.split(f"  {option} ", 1)[1].split("\n  -", 1)[0]
        assert f"(default: {default})" in " ".join(block.split()), (option, block)
    assert "WIDTHxHEIGHT" in p.stdout


def test_artifacts_honour_the_umask(tmp_path):
    import torch

    from optimized.runtime import artifacts
    old = os.umask(0o027)
    try:
        written = artifacts._atomic_write_bytes(tmp_path / "a.json", b"{}")
        frames = artifacts.write_png_frames(torch.zeros(3, 1, 8, 8), tmp_path / "frames")
        wav = artifacts.write_wav(torch.zeros(1, 16), tmp_path / "a.wav", 16000)
    finally:
        os.umask(old)
    assert stat.S_IMODE(written.stat().st_mode) == 0o640          # tempfile's 0600 was kept before
    assert stat.S_IMODE(wav.stat().st_mode) == 0o640
    assert stat.S_IMODE(frames.stat().st_mode) == 0o750           # mkdtemp's 0700 was kept before
