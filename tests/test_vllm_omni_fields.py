"""The vllm-omni / SGLang field names through plain HTTP (multipart, as their `curl -F` examples send them) against a
live server (tiny wan), `POST /v1/videos/sync` returning the MP4 itself, and where each extension field lands in the
engine's request (read back from the sidecar the engine wrote). The two-expert and cosmos3 cases (guidance_scale_2,
boundary_ratio, a request fps) are checked in-process on the request builder: no generation needed."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("multipart")
httpx = pytest.importorskip("httpx")

from tests.test_server import Server, error_of  # noqa: E402


def form(**fields) -> dict:
    """multipart/form-data parts (httpx sends `files=` as multipart even without a file)."""
    return {k: (None, str(v)) for k, v in fields.items()}


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("omni"), "wan", "--variant", "tiny")
    yield s
    s.stop()


def sidecar(wan, vid: str) -> dict:
    r = wan.client.get(f"/v1/videos/{vid}/content", params={"variant": "sidecar"})
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_omni_fields_via_sync_land_in_the_request(wan):
    r = wan.client.post("/v1/videos/sync", files=form(
        prompt="two cats boxing", negative_prompt="blurry", width=48, height=32, num_frames=5, fps=16,
        num_inference_steps=2, guidance_scale=4.0, flow_shift=3.0, seed=42))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4" and r.content[4:8] == b"ftyp"
    vid = r.headers["x-video-id"]
    req = sidecar(wan, vid)["request"]
    assert (req["width"], req["height"], req["num_frames"], req["num_steps"]) == (48, 32, 5, 2)
    assert (req["guidance_scale"], req["flow_shift"], req["seed"]) == (4.0, 3.0, 42)
    assert req["negative_text_ids"] == list(b"blurry")      # the byte-level ids of the negative prompt
    obj = wan.client.get(f"/v1/videos/{vid}").json()
    assert obj["status"] == "completed" and obj["size"] == "48x32" and obj["fps"] == 16.0 and obj["seconds"] == "0.25"


def test_async_create_with_omni_names_and_openai_size(wan):
    r = wan.client.post("/v1/videos", files=form(prompt="a lake", size="32x48", num_inference_steps=1, seed=3))
    assert r.status_code == 200, r.text
    done = wan.wait(r.json()["id"])
    assert done["status"] == "completed" and (done["width"], done["height"]) == (32, 48)
    req = sidecar(wan, done["id"])["request"]
    assert (req["width"], req["height"], req["num_steps"]) == (32, 48, 1)


@pytest.mark.parametrize("fields, param, needle", [
    ({"guidance_scale_2": 2.0}, "guidance_scale_2", "two-expert"),
    ({"boundary_ratio": 0.875}, "boundary_ratio", "one expert"),
    ({"fps": 24}, "fps", "16 fps"),
    ({"lora": "style-a"}, "lora", "is not loaded"),   # the server serves LoRA: an adapter nobody loaded
    ({"num_frames": 6}, "num_frames", "4k"),
    ({"seconds": 4, "num_frames": 65}, "seconds", "not both"),
    ({"size": "32x32", "width": 32}, "size", "not both"),
    ({"num_inference_steps": 2, "steps": 2}, "steps", "twice"),
])
def test_refusals_name_the_omni_field(wan, fields, param, needle):
    r = wan.client.post("/v1/videos", files=form(prompt="x", **fields))
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == param and needle in err["message"], err
    if param == "lora":
        assert err["code"] == "lora_not_found"


def test_an_image_for_a_text_only_model_names_input_reference(wan):
    r = wan.client.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("in.png", b"\x89PNG", "image/png")})
    assert r.status_code == 400 and error_of(r)["param"] == "input_reference", r.text


def test_sync_refusal_is_the_error_envelope(wan):
    r = wan.client.post("/v1/videos/sync", json={"prompt": "x", "num_frames": 6})
    assert r.status_code == 400 and error_of(r)["param"] == "num_frames", r.text


def test_extension_fields_on_two_expert_and_cosmos3_requests():
    import torch

    from optimized import Engine
    from optimized.serving.families import ServingError
    from optimized.serving.requests import build_request, default_fps

    a14b = Engine.from_variant("tiny-2.2-t2v-a14b", seed=0)
    own = a14b.model.cfg.boundary_ratio
    req, _ = build_request(a14b, prompt_ids=[1, 2], guidance_scale_2=2.5, boundary_ratio=own, flow_shift=4.0)
    assert (req.guidance_scale_2, req.flow_shift) == (2.5, 4.0)
    with pytest.raises(ServingError, match="boundary_ratio: this model switches experts at"):
        build_request(a14b, prompt_ids=[1, 2], boundary_ratio=own / 2)
    c3 = Engine.from_variant("tiny", seed=0, family="cosmos3")
    assert default_fps(c3) == 24.0                            # cosmos3's request default; wan's clips are 16 fps
    req, _ = build_request(c3, prompt_ids=torch.tensor([1, 2]).tolist(), fps=12.0)
    assert req.fps == 12.0
    with pytest.raises(ServingError, match="flow_shift: cosmos3 requests take no flow_shift"):
        build_request(c3, prompt_ids=[1, 2], flow_shift=3.0)
