"""LoRA over HTTP: `/v1/loras` (load by upload, list, merge / unmerge, unload) and the request field `lora`, on the
base model of golden/wan/lora_t2v. A request naming the adapter makes the same video as the engine run directly
with that adapter (whose latents equal diffusers', golden/wan/lora_t2v: `fvparity golden`); without the adapter the
video differs; bad adapters and names get 4xx naming the field."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from manifests.lora import LoraRef  # noqa: E402
from optimized.engine import Engine  # noqa: E402
from optimized.serving import server  # noqa: E402
from parity.families.wan.lora import base_case  # noqa: E402
from parity.golden import load_case  # noqa: E402

CASE = Path(__file__).resolve().parents[1] / "golden" / "wan" / "lora_t2v"
LORA = CASE / "upstream" / "pytorch_lora_weights.safetensors"


def wait_done(client: TestClient, vid: str, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = client.get(f"/v1/videos/{vid}").json()
        if obj.get("status") in ("completed", "failed"):
            return obj
        time.sleep(0.05)
    raise AssertionError(f"{vid} not done after {timeout}s")


def video(client: TestClient, body: dict) -> bytes:
    r = client.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    obj = wait_done(client, r.json()["id"])
    assert obj["status"] == "completed", obj
    return client.get(f"/v1/videos/{obj['id']}/content").content


def test_lora_over_http(tmp_path):
    cfg, weights, request, _ = base_case(load_case(CASE))
    body = {"prompt_ids": request.text_ids.tolist(), "negative_prompt_ids": request.negative_text_ids.tolist(),
            "num_frames": request.num_frames, "width": request.width, "height": request.height,
            "num_inference_steps": request.num_steps, "guidance_scale": request.guidance_scale,
            "seed": request.seed, "flow_shift": request.flow_shift}
    direct = Engine.from_weights(cfg, weights)
    direct.loras.load("style", LORA)
    want = direct.generate_video(dataclasses.replace(request, lora=(LoraRef("style", 0.7),)), tmp_path / "direct.mp4")
    golden = load_case(CASE)   # the direct run is diffusers' (load_lora_weights + set_adapters at 0.7)
    assert ((want.latents["vision"] - golden.outputs["latents"]).norm() / golden.outputs["latents"].norm()).item() \
        <= golden.tolerance.rel_l2
    engine = Engine.from_weights(cfg, weights)
    with TestClient(server.create_app(engine, output_dir=tmp_path / "videos")) as client:
        assert client.get("/v1/loras").json()["data"] == []
        r = client.post("/v1/videos", json=body | {"lora": "style"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text   # not loaded yet
        with LORA.open("rb") as f:
            r = client.post("/v1/loras", data={"name": "style"}, files={"file": ("style.safetensors", f)})
        assert r.status_code == 200 and r.json()["name"] == "style" and r.json()["merged"] is False, r.text
        bad = client.post("/v1/loras", data={"name": "junk"}, files={"file": ("junk.safetensors", b"not a file")})
        assert bad.status_code == 400 and "Traceback" not in bad.text
        assert [a["name"] for a in client.get("/v1/loras").json()["data"]] == ["style"]
        assert not list((tmp_path / "videos" / ".lora-uploads").glob("*"))   # nothing of the uploads left on disk

        styled = video(client, body | {"lora": {"name": "style", "scale": 0.7}})
        plain = video(client, body)
        assert styled == Path(want.paths["video"]).read_bytes()   # = the engine run with the adapter directly
        assert plain != styled
        r = client.post("/v1/videos", json=body | {"lora": [{"name": "style", "scale": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora"

        base_version = engine.model.weights_version
        r = client.post("/v1/loras/style/merge", json={"scale": 0.7})
        assert r.status_code == 200 and r.json()["weights_version"] != base_version, r.text
        merged_version = r.json()["weights_version"]
        assert client.delete("/v1/loras/style").status_code == 409          # merged: unmerge first
        merged = video(client, body)                                         # no lora field: the merged weights
        assert merged != plain
        r = client.post("/v1/loras/unmerge")
        assert r.status_code == 200 and r.json()["weights_version"] not in (None, merged_version)
        assert video(client, body) == plain                                  # the base weights are back
        assert client.delete("/v1/loras/style").json()["deleted"] is True
        assert client.delete("/v1/loras/style").status_code == 404
        assert client.get("/v1/loras").json()["data"] == []


def test_fvgen_lora_gives_the_golden(tmp_path, capsys):
    """`fvgen wan --model DIR --lora FILE:0.7` on the golden's base model: its frames are those of the engine run with
    the adapter, whose latents are diffusers' (golden/wan/lora_t2v, within its tolerance) - in one test."""
    import numpy as np
    from PIL import Image

    from optimized.serving.fvgen import main as fvgen
    from parity.families.wan.common import ModelUnderTest
    from parity.families.wan.parallel import write_model_dir

    case = load_case(CASE)
    cfg, weights, request, _ = base_case(case)
    model_dir = write_model_dir(ModelUnderTest("tiny-2.1-t2v", "model", cfg, weights), tmp_path / "model")
    direct = Engine.from_checkpoint(model_dir)
    direct.loras.load("style", LORA)
    styled = dataclasses.replace(request, lora=(LoraRef("style", 0.7),))
    latents = direct.generate(styled)["latents"]["vision"]
    want = case.outputs["latents"]
    assert ((latents - want).norm() / want.norm()).item() <= case.tolerance.rel_l2   # = diffusers' latents
    frames = direct.generate_video(styled).frames                                    # uint8 [F, H, W, 3]
    argv = ["wan", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, request.text_ids.tolist())),
            "--negative-prompt-ids", ",".join(map(str, request.negative_text_ids.tolist())),
            "--frames", str(request.num_frames), "--size", f"{request.width}x{request.height}",
            "--steps", str(request.num_steps), "--guidance", str(request.guidance_scale), "--seed", str(request.seed),
            "--lora", f"{LORA}:0.7", "--out", str(tmp_path / "frames"), "--quiet"]
    assert fvgen(argv) == 0, capsys.readouterr().err
    got = np.stack([np.asarray(Image.open(p)) for p in sorted((tmp_path / "frames").glob("frame_*.png"))])
    assert got.shape == tuple(frames.shape) and np.array_equal(got, frames.numpy())
    assert fvgen(argv[:-5] + ["--out", str(tmp_path / "plain"), "--quiet"]) == 0          # without the adapter
    plain = np.stack([np.asarray(Image.open(p)) for p in sorted((tmp_path / "plain").glob("frame_*.png"))])
    assert not np.array_equal(plain, got)
