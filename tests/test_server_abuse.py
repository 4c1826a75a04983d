"""The HTTP server held under abuse (issue 22), against live uvicorn processes on 127.0.0.1: malformed bodies are a
400 (non-UTF-8, 4300-digit integers, deep nesting, NaN, ids past int64), an image is refused from its header before
it is decoded, a huge request is a 400 before anything large is allocated, content racing a delete is 404 / 409,
the video index survives kill -9, retention evicts old videos with their files, SIGTERM with an SSE client connected
cancels and exits, API keys, and setup errors exit 2 with one message. Every wait is bounded."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("multipart")
httpx = pytest.importorskip("httpx")

import optimized.serving.server as server  # noqa: E402
from tests.test_server import ROOT, Server, error_of  # noqa: E402

SMALL = {"prompt_ids": [3, 4], "size": "32x32", "frames": 5, "steps": 2}
LONG = {"prompt_ids": [3, 4], "size": "64x64", "frames": 5, "steps": 1000}   # runs for seconds


def png_header(height: int, width: int) -> bytes:
    """A PNG that declares height x width and holds no pixel data (any decoder would fail on it)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("wan_abuse"), "wan", "--variant", "tiny", "--max-queue", "4")
    yield s
    s.stop()


# ------------------------------------------------------------------------------------------------ malformed bodies
@pytest.mark.parametrize("raw", [
    b'{"prompt": "\xff\xfe"}',                                   # not UTF-8
    b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",           # past Python's 4300-digit int conversion limit
    b"[" * 3000 + b"]" * 3000,                                  # nesting deeper than the recursion limit
    b'{"prompt": "x", "guidance": NaN}',                         # JSON has no NaN
], ids=["not-utf8", "4300-digits", "3000-deep", "nan"])
def test_malformed_json_bodies_are_400(wan, raw):
    r = wan.client.post("/v1/videos", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert error_of(r)["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"prompt_ids": [10 ** 30]}, "prompt_ids"),                  # past int64: torch's overflow names nothing
    ({"prompt_ids": [1 << 40]}, "prompt_ids"),                   # within int64, past the vocabulary
    ({"prompt": "x", "seed": 10 ** 30}, "seed"),
    ({"prompt": "x", "steps": "9" * 5000}, "steps"),
    ({"prompt": "x", "size": "9" * 5000 + "x32"}, "size"),
])
def test_out_of_range_numbers_are_400_naming_the_field(wan, body, param):
    r = wan.client.post("/v1/videos", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param, r.text


def test_a_number_that_parses_as_infinity_is_400_naming_the_field(wan):
    r = wan.client.post("/v1/videos", content=b'{"prompt": "x", "guidance": 1e400}',
                        headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["param"] == "guidance", r.text


def test_parse_json_body_refuses_each_malformation_with_badfield():
    for raw in (b"\xff", b"[" * 3000, b'{"a": ' + b"1" * 5000 + b"}", b"Infinity", b"[1]"):
        with pytest.raises(server.BadField):
            server.parse_json_body(raw)
    assert server.parse_json_body(b'{"prompt": "x"}') == {"prompt": "x"}


# ------------------------------------------------------------------------------------------------ images (F3)
def test_an_image_is_refused_from_its_header_before_decoding(monkeypatch):
    pytest.importorskip("PIL")
    import PIL.Image

    def no_decoding(*a, **k):
        raise AssertionError("the image was opened for decoding")

    monkeypatch.setattr(PIL.Image, "open", no_decoding)
    huge = png_header(8000, 8000)
    with pytest.raises(server.BadField, match="takes no image") as e:
        server.parse_fields({"prompt": "x"}, huge, server.ImageLimits(accepted=False))
    assert e.value.param == "image"
    with pytest.raises(server.BadField, match="declares 8000x8000") as e:
        server.parse_fields({"prompt": "x", "image": base64.b64encode(huge).decode()}, None, server.ImageLimits(True))
    assert e.value.param == "image"
    with pytest.raises(server.BadField, match="above the family limit"):
        server.parse_fields({"prompt": "x"}, png_header(5000, 16), server.ImageLimits(True, max_height=4096, max_width=4096))
    with pytest.raises(server.BadField, match="not a PNG or JPEG"):
        server.parse_fields({"prompt": "x"}, b"GIF89a" + b"\0" * 20, server.ImageLimits(True))


def test_an_image_for_a_text_only_model_is_400_over_http(wan):
    r = wan.client.post("/v1/videos", data={"prompt": "x"}, files={"image": ("big.png", png_header(8000, 8000))})
    assert r.status_code == 400 and error_of(r)["param"] == "image", r.text
    assert "takes no image" in error_of(r)["message"]


# ------------------------------------------------------------------------------------------------ huge requests (F1)
def test_a_huge_request_within_the_family_limits_is_400_before_allocating(wan):
    before = rss_mib(wan.proc.pid)
    for body in ({"prompt_ids": [1], "size": "8192x8192", "frames": 2049},
                 {"prompt_ids": [1], "size": "4096x4096", "frames": 1025},
                 {"prompt_ids": [1], "size": "16384x16384", "frames": 4093}):
        r = wan.client.post("/v1/videos", json=body)
        assert r.status_code == 400, r.text
        assert error_of(r)["param"] in ("size", "frames"), r.text
    assert rss_mib(wan.proc.pid) - before < 300, "the server allocated for a request it refused"
    assert wan.client.get("/health").json()["queue_depth"] == 0


# ------------------------------------------------------------------------------------------------ content vs delete
def test_content_whose_file_vanished_is_404_not_500(wan):
    vid = wan.client.post("/v1/videos", json=SMALL).json()["id"]
    assert wan.wait(vid)["status"] == "completed"
    (wan.out / f"{vid}.mp4").unlink()     # the worst point of a delete race: listed, file gone
    r = wan.client.get(f"/v1/videos/{vid}/content")
    assert r.status_code == 404 and error_of(r)["param"] == "id", r.text


def test_content_racing_delete_is_200_404_or_409_never_500(wan):
    for _ in range(3):
        vid = wan.client.post("/v1/videos", json=SMALL).json()["id"]
        assert wan.wait(vid)["status"] == "completed"
        size = (wan.out / f"{vid}.mp4").stat().st_size

        def get(_):
            with httpx.Client(base_url=wan.url, timeout=30) as c:
                r = c.get(f"/v1/videos/{vid}/content")
                return r.status_code, len(r.content)

        def delete():
            with httpx.Client(base_url=wan.url, timeout=30) as c:
                return c.delete(f"/v1/videos/{vid}").status_code

        with ThreadPoolExecutor(6) as pool:
            gets = [pool.submit(get, i) for i in range(8)]
            deleted = pool.submit(delete)
            results = [g.result() for g in gets]
        assert deleted.result() == 200
        for status, n in results:
            assert status in (200, 404, 409), results
            assert status != 200 or n == size, results   # a 200 is the whole file, never a truncated one
        assert wan.client.get(f"/v1/videos/{vid}/content").status_code == 404


# ------------------------------------------------------------------------------------------------ durability (F7 / F8)
@pytest.mark.slow   # a server of its own (> 20 s on a shared CPU)
def test_a_restart_after_kill9_loses_no_completed_video(tmp_path):
    s = Server(tmp_path, "wan", "--variant", "tiny")
    try:
        vid = s.client.post("/v1/videos", json=SMALL).json()["id"]
        assert s.wait(vid)["status"] == "completed"
        mp4 = s.client.get(f"/v1/videos/{vid}/content").content
        running = s.client.post("/v1/videos", json=LONG).json()["id"]
    finally:
        s.kill9()
    stale = s.out / f".{running}.mp4.abc123.tmp"     # what a kill mid-write leaves
    stale.write_bytes(b"partial")
    s = Server(tmp_path, "wan", "--variant", "tiny")
    try:
        obj = s.client.get(f"/v1/videos/{vid}").json()
        assert obj["status"] == "completed" and obj["url"] == f"/v1/videos/{vid}/content", obj
        assert s.client.get(obj["url"]).content == mp4
        png = s.client.get(obj["url"], params={"variant": "thumbnail"})
        assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
        interrupted = s.client.get(f"/v1/videos/{running}").json()
        assert interrupted["status"] == "failed" and "interrupted" in interrupted["error"]["message"]
        assert not stale.exists()
        assert not [p for p in s.out.iterdir() if p.name.startswith(".video_")]
    finally:
        s.stop()


@pytest.mark.slow   # a server of its own (> 20 s on a shared CPU)
def test_retention_evicts_the_oldest_videos_with_their_files(tmp_path):
    s = Server(tmp_path, "wan", "--variant", "tiny", "--keep-videos", "2")
    try:
        ids = []
        for seed in range(3):
            ids.append(s.client.post("/v1/videos", json={**SMALL, "seed": seed}).json()["id"])
            assert s.wait(ids[-1])["status"] == "completed"
        assert s.client.get(f"/v1/videos/{ids[0]}").status_code == 404
        assert not list(s.out.glob(f"{ids[0]}.*"))
        assert all(s.client.get(f"/v1/videos/{v}").json()["status"] == "completed" for v in ids[1:])
    finally:
        s.stop()


def test_video_store_evicts_by_bytes_and_age(tmp_path):
    now = 1_000_000.0
    store = server.VideoStore(tmp_path, server.Retention(max_videos=10, max_bytes=250, max_age_s=100))
    for i, (age, size) in enumerate([(500, 100), (50, 100), (40, 100), (30, 100)]):
        vid = f"video_{i:020x}"
        store.paths(vid)["video"].write_bytes(b"x" * size)
        store.save(server.VideoEntry(vid, "completed", int(now - age), completed_at=int(now - age), bytes=size))
    store.save(server.VideoEntry("video_" + "f" * 20, "in_progress", int(now - 900)))   # never evicted: in flight
    gone = store.evict(now)
    # the 500 s old one by age, then the oldest one left until 250 bytes hold
    assert gone == [f"video_{0:020x}", f"video_{1:020x}"]
    assert sorted(store.entries) == [f"video_{2:020x}", f"video_{3:020x}", "video_" + "f" * 20]
    assert not store.paths(gone[0])["video"].exists() and store.paths(f"video_{3:020x}")["video"].exists()
    store.close()
    again = server.VideoStore(tmp_path)          # the index is on disk
    assert sorted(again.entries) == sorted(store.entries)
    again.close()


# ------------------------------------------------------------------------------------------------ shutdown (F11)
@pytest.mark.slow   # a server of its own (> 20 s on a shared CPU)
def test_sigterm_with_an_sse_client_connected_cancels_and_exits(tmp_path):
    s = Server(tmp_path, "wan", "--variant", "tiny")
    vid = s.client.post("/v1/videos", json=LONG).json()["id"]
    kinds: list[str] = []
    progressed = threading.Event()

    def listen():
        try:
            with httpx.Client(base_url=s.url, timeout=60) as c, c.stream("GET", f"/v1/videos/{vid}/events") as st:
                for line in st.iter_lines():
                    if line.startswith("event: "):
                        kinds.append(line[7:])
                        if line == "event: progress":
                            progressed.set()
        except httpx.TransportError:
            kinds.append("dropped")

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    try:
        assert progressed.wait(30), "no progress event"
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(30)     # before the fix uvicorn waited on the open stream for ever
        reader.join(10)
        assert kinds[-1] == "request.cancelled", kinds[-5:]
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(5)
        s.client.close()
        s.log.close()


# ------------------------------------------------------------------------------------------------ API keys
@pytest.mark.slow   # a server of its own (> 20 s on a shared CPU)
def test_api_key_is_required_on_v1_when_set(tmp_path):
    s = Server(tmp_path, "wan", "--variant", "tiny", env={"FVGEN_API_KEY": "s3cret"})
    try:
        assert s.client.get("/health").status_code == 200          # liveness stays open
        for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "s3cre"}):
            r = s.client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and error_of(r)["type"] == "authentication_error", r.text
        r = s.client.post("/v1/videos", json=SMALL)
        assert r.status_code == 401
        assert s.client.get("/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert s.client.get("/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
    finally:
        s.stop()


def test_binding_beyond_loopback_without_a_key_warns():
    assert server.exposure_warning("0.0.0.0", None) and "API key" in server.exposure_warning("0.0.0.0", None)
    assert server.exposure_warning("192.168.1.4", None)
    assert server.exposure_warning("0.0.0.0", "k") is None
    assert server.exposure_warning("127.0.0.1", None) is None and server.exposure_warning("localhost", None) is None
    assert server.exposure_warning("::1", None) is None


# ------------------------------------------------------------------------------------------------ setup errors (F17)
def test_setup_errors_exit_2_with_one_message(tmp_path, capsys):
    """Checked before the model loads (in-process: main returns 2, argparse exits 2), one message each."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    base = ["wan", "--variant", "tiny", "--output-dir", str(tmp_path / "v")]
    try:
        for what, args in {"port -1": ["--port", "-1"], "port 70000": ["--port", "70000"],
                           "max-queue 0": ["--max-queue", "0"]}.items():
            with pytest.raises(SystemExit) as e:
                server.main(base + args)
            assert e.value.code == 2, what
            assert "error:" in capsys.readouterr().err, what
        for what, args in {"device tpu": ["--device", "tpu"],
                           "unwritable output dir": ["--output-dir", str(blocker / "videos")],
                           "port in use": ["--port", str(busy.getsockname()[1])],
                           "empty api key": ["--api-key", " "]}.items():
            assert server.main(base + args) == 2, what
            err = capsys.readouterr().err
            assert err.startswith("error: ") and err.count("\n") == 1, (what, err)
    finally:
        busy.close()


def test_the_server_command_exits_2_on_a_setup_error():
    r = subprocess.run([sys.executable, "-m", "optimized.serving.server", "wan", "--variant", "tiny", "--port", "-1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--port" in r.stderr, r.stderr[-2000:]
