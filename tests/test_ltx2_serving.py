"""LTX-2 serving and whole-pipeline conversion (issue 28, Done-when 2): a tiny diffusers LTX2Pipeline root ->
`fvconvert ltx2 --from diffusers ROOT OUT` -> `fvgen ltx2 --model OUT --prompt-ids ... --out a.mp4`: the MP4 has an
audio stream, and the engine's latents (and the waveform fvgen wrote) equal the reference pipeline's loaded from the
same OUT. Plus the strict refusals of the converter, the random-weight variant, the processor and HTTP."""

from __future__ import annotations

import json
import re
import subprocess
import wave
from pathlib import Path

import pytest
import torch

from tests.ltx2_pipeline_root import write_tiny_pipeline_root

IDS = "2,5,6,7,9"
STEPS = 3


def fvconvert(capsys, *args) -> tuple[int, str]:
    """fvconvert in this process: (exit code, stdout + stderr)."""
    from converters.cli import main
    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out + out.err


def fvgen(*args) -> int:
    from optimized.serving.fvgen import main
    return main([str(a) for a in args])


def streams(mp4: Path) -> list[str]:
    """The stream lines `ffmpeg -i` prints for a file (the binary imageio-ffmpeg ships)."""
    import imageio_ffmpeg
    proc = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(mp4)], capture_output=True, check=False,
                          text=True)
    return [line.strip() for line in proc.stderr.splitlines() if re.match(r"\s*Stream #", line)]


def read_wav(path: Path) -> tuple[torch.Tensor, int]:
    with wave.open(str(path), "rb") as w:
        n, ch, rate = w.getnframes(), w.getnchannels(), w.getframerate()
        pcm = torch.frombuffer(bytearray(w.readframes(n)), dtype=torch.int16).view(n, ch).T.float() / 32767
    return pcm, rate


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    from converters.cli import main
    root = write_tiny_pipeline_root(tmp_path_factory.mktemp("ltx2") / "root")
    out = root.parent / "out"
    assert main(["ltx2", "--from", "diffusers", str(root), str(out), "--quiet"]) == 0
    return out


def test_pipeline_root_converts_into_one_model_directory(converted):
    index = json.loads((converted / "model_index.json").read_text())
    assert index["family"] == "ltx2"
    assert set(index["components"]) == {"transformer", "connectors", "text_encoder", "vae", "audio_vae", "vocoder"}
    assert set(index["assets"]) == {"tokenizer", "scheduler"}
    report = json.loads((converted / "conversion_report.json").read_text())
    assert report["components"]["transformer"]["parity"]["status"] == "pass"
    gemma = json.loads((converted / "text_encoder" / "conversion_report.json").read_text())
    assert {d["key"] for d in gemma["dropped"]} == {"vision_tower.embeddings.patch_embedding.weight",
                                                    "multi_modal_projector.mm_input_projection_weight"}
    from manifests.checkpoint import read_checkpoint
    cfg = read_checkpoint(converted).typed_config()
    from dataclasses import replace

    from manifests.ltx2.model import load_model_variant
    # max_sequence_length is an LTX2Pipeline.__call__ argument, not in the pipeline's files: upstream's 1024
    assert cfg == replace(load_model_variant("tiny"), max_sequence_length=1024)


def test_fvgen_writes_mp4_with_audio_and_latents_equal_the_reference(converted, tmp_path):
    out = tmp_path / "a.mp4"
    assert fvgen("ltx2", "--model", converted, "--prompt-ids", IDS, "--steps", STEPS, "--out", out, "--quiet") == 0
    kinds = streams(out)
    assert any("Video: h264" in s for s in kinds) and any("Audio: aac" in s for s in kinds), kinds
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["sample_rate"] == 24000 and sidecar["request_type"] == "Ltx2GenerateRequest"

    # the same request on the engine (fvgen's loader and request builder) and on the reference from the same OUT
    from optimized.serving.loading import load_engine
    from optimized.serving.requests import build_request
    from reference.ltx2.generate import generate, load_model_dir
    engine = load_engine("ltx2", str(converted), None)
    request, _ = build_request(engine, prompt_ids=IDS, num_steps=STEPS)
    got = engine.generate_video(request)
    want = generate(load_model_dir(converted), request)
    from manifests.parity import load_parity_contract
    from parity.report import tensor_check
    tol = load_parity_contract("ltx2").tolerance("C1", "float32", "cpu")
    for name, a, b in (("video", got.latents["vision"], want["video_latents"]),
                       ("audio", got.latents["sound"], want["audio_latents"])):
        check = tensor_check(name, a, b, tol)
        assert check.passed, (name, check.metrics)
    wav, rate = read_wav(out.with_suffix(".wav"))               # what fvgen wrote, vs the reference's waveform
    ref = want["waveform"][0].clamp(-1, 1)
    assert rate == 24000 and wav.shape == ref.shape
    assert (wav - ref).abs().max() <= 1.0 / 32767 + 1e-5


def test_a_stray_or_missing_key_fails_the_whole_conversion_leaving_nothing(tmp_path, capsys):
    root = write_tiny_pipeline_root(tmp_path / "root", extra_key=("vae", "decoder.not_a_layer.weight"))
    code, text = fvconvert(capsys, "ltx2", "--from", "diffusers", root, tmp_path / "out")
    assert code == 2 and "decoder.not_a_layer.weight" in text, text
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    root2 = write_tiny_pipeline_root(tmp_path / "root2", drop_key=("audio_vae", "latents_std"))
    code, text = fvconvert(capsys, "ltx2", "--from", "diffusers", root2, tmp_path / "out2")
    assert code == 2 and "latents_std" in text, text
    assert not (tmp_path / "out2").exists()


def test_components_that_do_not_fit_are_one_error(tmp_path, capsys):
    root = write_tiny_pipeline_root(tmp_path / "root")
    cfg = json.loads((root / "vocoder" / "config.json").read_text())
    cfg["in_channels"] = 16
    (root / "vocoder" / "config.json").write_text(json.dumps(cfg))
    import safetensors.torch as st
    w = st.load_file(str(root / "vocoder" / "diffusion_pytorch_model.safetensors"))
    w["conv_in.weight"] = w["conv_in.weight"][:, :16].contiguous()
    st.save_file(w, str(root / "vocoder" / "diffusion_pytorch_model.safetensors"))
    code, text = fvconvert(capsys, "ltx2", "--from", "diffusers", root, tmp_path / "out")
    assert code == 2 and "vocoder.in_channels 16" in text, text
    assert not (tmp_path / "out").exists()


def test_the_processor_tokenizes_as_gemma_and_the_prompt_runs(converted, tmp_path):
    from optimized.models.ltx2.processor import Ltx2Processor
    proc = Ltx2Processor(converted / "tokenizer", max_sequence_length=4)
    assert proc.encode("  a cat runs ").tolist() == [2, 4, 5, 7]          # <bos> first, stripped
    assert proc.encode("a cat runs on the grass").tolist() == [2, 4, 5, 7]   # truncated to max_sequence_length
    out = tmp_path / "p.mp4"
    assert fvgen("ltx2", "--model", converted, "--prompt", "a dog jumps", "--steps", 2, "--out", out, "--quiet") == 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["request"]["text_ids"] == [2, 4, 6, 8] and sidecar["request"]["negative_text_ids"] == [2]


def test_variant_tiny_serves_with_random_weights(tmp_path):
    out = tmp_path / "v.mp4"
    assert fvgen("ltx2", "--variant", "tiny", "--prompt-ids", "3,4", "--steps", 2, "--out", out, "--quiet") == 0
    assert any("Audio:" in s for s in streams(out))
    from optimized import Engine
    engine = Engine.from_variant("ltx2:tiny")
    card = engine.deployment_card()
    assert card["family"] == "ltx2" and "sound" in card["capabilities"]["modalities"]


def test_bad_requests_are_one_message(converted, tmp_path):
    out = tmp_path / "x.mp4"
    assert fvgen("ltx2", "--model", converted, "--prompt-ids", ",".join(["3"] * 1025), "--out", out) == 2
    assert fvgen("ltx2", "--model", converted, "--prompt-ids", "3,64", "--out", out) == 2     # vocabulary 64
    assert fvgen("ltx2", "--model", converted, "--prompt-ids", "3", "--frames", 8, "--out", out) == 2
    assert fvgen("ltx2", "--model", converted, "--prompt-ids", "3", "--steps", 1, "--out", out) == 2   # 0 / 0
    assert fvgen("ltx2", "--model", converted, "--prompt-ids", "3", "--size", "60x64", "--out", out) == 2
    assert not out.exists()


def test_http_server_serves_ltx2(converted, tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from optimized.serving.loading import load_engine
    from optimized.serving.server import create_app
    engine = load_engine("ltx2", str(converted), None)
    with TestClient(create_app(engine, output_dir=tmp_path / "videos")) as client:
        r = client.post("/v1/videos", json={"prompt": "a cat", "seconds": None, "num_inference_steps": 2})
        assert r.status_code in (200, 201, 202), r.text
        vid = r.json()["id"]
        for _ in range(600):
            body = client.get(f"/v1/videos/{vid}").json()
            if body["status"] in ("completed", "failed"):
                break
            import time
            time.sleep(0.05)
        assert body["status"] == "completed", body
        mp4 = client.get(f"/v1/videos/{vid}/content")
        assert mp4.status_code == 200
        (tmp_path / "h.mp4").write_bytes(mp4.content)
        assert any("Audio:" in s for s in streams(tmp_path / "h.mp4"))
