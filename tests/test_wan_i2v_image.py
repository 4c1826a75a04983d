"""Wan 2.1 image-to-video from an image, end to end (issue 25 item 3): the model's CLIP image encoder turns the
request's ORIGINAL image into image_embeds on both sides (reference/wan/pipeline.py `encode_image`, the optimized
instance through media.py / processor.py), the pipeline golden golden/wan/pipe_i2v_image (diffusers 0.42.1
WanImageToVideoPipeline with a transformers CLIPVisionModel + CLIPImageProcessor, given a PIL image), fvconvert of a
pipeline root keeping image_encoder/ + image_processor/ (refusing a 2.1 I2V root without them), and fvgen / the
request builder / Engine.generate(prompt=..., image=...) driving it."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from manifests import ManifestError
from manifests.wan.model import WanModelConfig, load_model_variant
from parity.golden import load_case, run_probe

ROOT = Path(__file__).resolve().parents[1]
CASE = ROOT / "golden" / "wan" / "pipe_i2v_image"
I2V = "tiny-2.1-i2v"


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    g = np.random.RandomState(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([128 + 100 * np.sin(xx / 4 + c) * np.cos(yy / 6 - c) for c in range(3)], -1)
    return np.clip(base + 25 * g.randn(h, w, 3), 0, 255).astype(np.uint8)


def _without_encoder(cfg: WanModelConfig) -> WanModelConfig:
    return WanModelConfig.from_dict({k: v for k, v in cfg.to_dict().items()
                                     if k not in ("image_encoder", "image_processor")})


# ------------------------------------------------------------------------------------------------ the golden

def _probe(case_dir: Path):
    from parity.families.wan.c1 import golden_generate_probe
    return {r.name: r for r in run_probe(golden_generate_probe, load_case(case_dir), ("reference", "optimized"))}


def test_golden_from_an_image_on_both_sides():
    rows = _probe(CASE)
    bad = [(n, r.detail) for n, r in rows.items() if not r.passed]
    assert not bad, bad
    for side in ("reference", "optimized"):   # the image embeddings each side computed were compared to upstream's
        for what in ("image_embeds", "model_input_0", "latents", "trajectory"):
            assert f"pipe_i2v_image/{side}:{what}" in rows


def test_golden_catches_clip_on_the_resized_image(monkeypatch):
    """Negative control: the optimized side encoding the VAE-resized image (height x width) instead of the original
    one upstream encodes: its image_embeds row and its latents fail; the reference side still passes."""
    from PIL import Image

    from optimized.models.wan.processor import WanProcessor
    real = WanProcessor.clip_source

    def resized_first(image, signed=None):
        return real(image, signed).resize((32, 32), Image.Resampling.LANCZOS)

    monkeypatch.setattr(WanProcessor, "clip_source", staticmethod(resized_first))
    rows = _probe(CASE)
    assert not rows["pipe_i2v_image/optimized:image_embeds"].passed
    assert rows["pipe_i2v_image/optimized:image_embeds"].divergence == "image_encoder"
    assert not rows["pipe_i2v_image/optimized:latents"].passed
    assert all(r.passed for n, r in rows.items() if "/reference:" in n)


def test_golden_case_without_upstream_image_encoder_fails_naming_it(tmp_path):
    case = tmp_path / "pipe_i2v_image"
    shutil.copytree(CASE, case)
    shutil.rmtree(case / "upstream" / "image_encoder")
    (row,) = _probe(case).values()
    assert not row.passed and "image_encoder/" in row.detail


# ------------------------------------------------------------------------------------------------ the model config

def test_model_config_carries_the_image_encoder():
    cfg = load_model_variant(I2V)
    assert cfg.has_image_encoder and cfg.image_encoder.hidden_size == cfg.dit.image_dim
    assert load_model_variant("wan2.1-i2v-14b").image_encoder.num_tokens == 257
    assert WanModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "image_encoder" not in load_model_variant("tiny-2.1-t2v").to_dict()   # absent: configs (hashes) unchanged
    d = cfg.to_dict()
    with pytest.raises(ManifestError, match="hidden_size 16 != DiT image_dim 8"):
        WanModelConfig.from_dict({**d, "image_encoder": {**d["image_encoder"], "hidden_size": 16,
                                                         "intermediate_size": 32}})
    with pytest.raises(ManifestError, match="come together"):
        WanModelConfig.from_dict({k: v for k, v in d.items() if k != "image_processor"})
    with pytest.raises(ManifestError, match="unknown image_encoder 'vit-g'"):
        WanModelConfig.from_dict({**d, "image_encoder": "vit-g"})
    with pytest.raises(ManifestError, match="needs a DiT with an image branch"):
        t2v = load_model_variant("tiny-2.2-t2v-a14b").to_dict()
        WanModelConfig.from_dict({**t2v, "image_encoder": "tiny", "image_processor": "tiny"})


# ------------------------------------------------------------------------------------------------ serving

def test_request_fields_with_an_image_compute_the_embeddings():
    """The plain-fields path (fvgen --prompt-ids / HTTP without a tokenizer): an uploaded image ([-1, 1], not at the
    request size) gets image_embeds from the model's encoder on the unresized image, equal to the reference
    pipeline's encode_image of the same 8-bit image with the same weights; twice: served from the CLIP cache."""
    import optimized
    import reference.wan as ref
    from optimized.serving.requests import build_request

    engine = optimized.Engine.from_variant(f"wan:{I2V}", seed=3)
    u8 = _image(44, 30)
    upload = torch.from_numpy(u8).permute(2, 0, 1).float() / 127.5 - 1.0     # what decode_image gives
    req, left = build_request(engine, prompt_ids="5,6,7", image=upload, num_steps=2)
    assert left is None and req.image.shape == (3, 32, 32)
    weights = type(engine.model).random_weights(engine.model.cfg, 3)
    want = ref.WanReferencePipeline(engine.model.cfg, weights).encode_image(u8)
    assert want.shape == (17, 8)
    assert torch.allclose(req.image_embeds, want, rtol=1e-5, atol=1e-5)
    calls = engine.model.image_encoder.forward_calls
    again, _ = build_request(engine, prompt_ids="5,6,7", image=upload, num_steps=2)
    assert engine.model.image_encoder.forward_calls == calls and torch.equal(again.image_embeds, req.image_embeds)
    assert engine.generate(req)["latents"]["vision"].shape == (1, 4, 2, 4, 4)


def test_a_model_without_image_encoder_refuses_an_image_naming_it():
    import optimized
    from optimized.serving.families import ServingError
    from optimized.serving.requests import build_request

    cfg = _without_encoder(load_model_variant(I2V))
    engine = optimized.Engine.from_weights(cfg, type(optimized.Engine.from_variant(f"wan:{I2V}").model)
                                           .random_weights(cfg, 0))
    with pytest.raises(ServingError, match="no image encoder.*reconvert"):
        build_request(engine, prompt_ids="5,6,7", image=torch.zeros(3, 32, 32))


def test_explicit_image_embeds_still_win():
    from optimized.models.wan.processor import WanProcessor

    tok = ROOT / "golden" / "wan" / "proc_umt5" / "upstream"
    given = torch.randn(3, 8)
    calls = []
    from PIL import Image
    req = WanProcessor(tok).build_request("a cat", None, Image.fromarray(_image(32, 32)), num_frames=5, height=32, width=32,
                                          image_embeds=given, encode_image=lambda ims: calls.append(ims))
    assert req.image_embeds is given and not calls


# ------------------------------------------------------------------------------------------------ fvconvert

def _root_from_test_pipeline(tmp_path: Path) -> Path:
    from tests.test_wan_dit_convert import make_pipeline
    root = tmp_path / "src"
    make_pipeline(root, I2V)
    return root


@pytest.mark.parametrize("how", ["unlisted", "folder-missing", "processor-missing"])
def test_i2v_root_without_image_encoder_refused(tmp_path, capsys, how):
    from converters.cli import main

    root = _root_from_test_pipeline(tmp_path)
    index = json.loads((root / "model_index.json").read_text())
    if how == "unlisted":
        index.pop("image_encoder")
        shutil.rmtree(root / "image_encoder")
    elif how == "folder-missing":
        shutil.rmtree(root / "image_encoder")
    else:
        shutil.rmtree(root / "image_processor")
    (root / "model_index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    rc = main(["wan", "--from", "diffusers", str(root), str(out), "--skip-parity", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "Wan 2.1 I2V pipeline" in err and ("image_processor/" if how == "processor-missing" else "image_encoder/") \
        in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_converted_model_directory_holds_encoder_and_processor(tmp_path):
    from converters.cli import main
    from manifests.checkpoint import read_checkpoint

    root = _root_from_test_pipeline(tmp_path)
    out = tmp_path / "out"
    assert main(["wan", "--from", "diffusers", str(root), str(out), "-q"]) == 0
    ckpt = read_checkpoint(out)
    assert set(ckpt.components) == {"transformer", "text_encoder", "vae", "image_encoder"}
    assert set(ckpt.assets) == {"tokenizer", "scheduler", "image_processor"}
    assert (out / "image_processor" / "preprocessor_config.json").read_bytes() == \
        (root / "image_processor" / "preprocessor_config.json").read_bytes()
    assert ckpt.typed_config() == load_model_variant(I2V)
    rep = json.loads((out / "conversion_report.json").read_text())
    assert rep["components"]["image_encoder"]["format"] == "transformers-clip"
    assert rep["components"]["image_encoder"]["parity"]["status"] == "pass"   # the wan.image_encoder C0 post-check


# ------------------------------------------------------------------------------------------------ upstream end to end

def _diffusers_root(tmp_path: Path):
    """A real WanImageToVideoPipeline root written by diffusers' save_pretrained: the golden's upstream components,
    the golden tiny UMT5 tokenizer, the CLIP image encoder and its processor."""
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, CLIPVisionModel, UMT5EncoderModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    up = CASE / "upstream"
    pipe = WanImageToVideoPipeline(
        tokenizer=AutoTokenizer.from_pretrained(ROOT / "golden" / "wan" / "proc_umt5" / "upstream"),
        text_encoder=UMT5EncoderModel.from_pretrained(up / "text_encoder"),
        vae=AutoencoderKLWan.from_pretrained(up / "vae"),
        scheduler=UniPCMultistepScheduler.from_pretrained(up / "scheduler"),
        transformer=WanTransformer3DModel.from_pretrained(up / "transformer"),
        image_encoder=CLIPVisionModel.from_pretrained(up / "image_encoder"),
        image_processor=CLIPImageProcessorPil.from_pretrained(up / "image_processor"))
    root = tmp_path / "root"
    pipe.save_pretrained(root, safe_serialization=True)
    if not hasattr(i2v_module, "ftfy"):  # upstream's basic_clean calls ftfy unguarded; identity on ASCII prompts
        from types import SimpleNamespace
        i2v_module.ftfy = SimpleNamespace(fix_text=lambda text: text)
    return root, pipe


RUN = dict(num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=5.0)
PROMPT, SEED = "a cat on a mat", 11


def _diffusers_run(pipe, image, output_type):
    with torch.no_grad():
        return pipe(prompt=PROMPT, negative_prompt="", image=image, generator=torch.Generator().manual_seed(SEED),
                    output_type=output_type, max_sequence_length=512, **RUN).frames


@pytest.mark.upstream
def test_fvconvert_then_fvgen_and_sdk_match_diffusers(tmp_path, capsys):
    """`fvconvert wan --from diffusers ROOT OUT`, then (1) Engine.generate(prompt=, image=PIL 44x30) and the
    reference processor + pipeline from the same OUT give diffusers' latents on the same PIL image, and (2)
    `fvgen wan --model OUT --image in.png --prompt ...` (an image at the request size) writes diffusers' frames."""
    pytest.importorskip("diffusers")
    from PIL import Image

    import optimized
    import reference.wan as ref
    from converters.cli import main as fvconvert
    from manifests.checkpoint import load_state, read_checkpoint
    from optimized.serving.fvgen import main as fvgen
    from parity.artifacts import read_png_frames
    from reference.wan.processor import WanProcessor as RefProcessor

    torch.set_num_threads(1)
    root, pipe = _diffusers_root(tmp_path)
    out = tmp_path / "model"
    assert fvconvert(["wan", "--from", "diffusers", str(root), str(out), "--skip-parity", "-q"]) == 0
    assert "image_encoder" in read_checkpoint(out).components

    image = Image.fromarray(_image(44, 30, seed=5))
    want = _diffusers_run(pipe, image, "latent")
    engine = optimized.Engine.from_checkpoint(out)
    got = engine.generate(prompt=PROMPT, image=image, num_frames=5, height=32, width=32, num_steps=3,
                          guidance_scale=5.0, seed=SEED).latents["vision"]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(got, want) < 1e-5, rel(got, want)
    ckpt = read_checkpoint(out)
    pipe_ref = ref.WanReferencePipeline(ckpt.typed_config(), {n: load_state(ckpt, component=n) for n in ckpt.components})
    req = RefProcessor(out / "tokenizer").build_request(PROMPT, None, image, num_frames=5, height=32, width=32,
                                                        steps=3, guidance=5.0, seed=SEED,
                                                        image_encoder=pipe_ref.encode_image)
    assert rel(pipe_ref.generate(req).latents, want) < 1e-5

    png = tmp_path / "in.png"
    Image.fromarray(_image(32, 32, seed=6)).save(png)
    frames_dir = tmp_path / "frames"
    rc = fvgen(["wan", "--model", str(out), "--image", str(png), "--prompt", PROMPT, "--frames", "5", "--size",
                "32x32", "--steps", "3", "--guidance", "5", "--seed", str(SEED), "--out", str(frames_dir), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    ours = read_png_frames(frames_dir).astype(np.int16)
    theirs = np.round(np.asarray(_diffusers_run(pipe, Image.open(png), "np")[0]) * 255).astype(np.int16)
    assert ours.shape == theirs.shape == (5, 32, 32, 3)
    assert np.abs(ours - theirs).max() <= 1   # one 8-bit level: float rounding at the quantisation boundary


# ------------------------------------------------------------------------------------------------ HTTP

@pytest.mark.slow   # a live server process (~15 s on 2 cores); the default run covers its builder (build_request) above
def test_http_image_upload_drives_wan21_i2v(tmp_path):
    """A live server on the tiny 2.1 I2V variant: a multipart PNG upload (not at the request size) completes (the
    image embeddings come from the model's encoder; before, the request failed on image_embeds); without an image
    the request is refused naming the image."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("multipart")
    pytest.importorskip("httpx")
    import io

    from PIL import Image

    from tests.test_server import Server, error_of

    buf = io.BytesIO()
    Image.fromarray(_image(40, 36)).save(buf, "PNG")
    s = Server(tmp_path, "wan", "--variant", I2V)
    try:
        r = s.client.post("/v1/videos", data={"prompt": "a cat", "size": "32x32", "frames": "5", "steps": "2"},
                          files={"image": ("in.png", buf.getvalue(), "image/png")})
        assert r.status_code == 200, r.text
        assert s.wait(r.json()["id"])["status"] == "completed"
        bad = s.client.post("/v1/videos", data={"prompt": "a cat", "size": "32x32", "frames": "5", "steps": "2"})
        assert bad.status_code == 400 and error_of(bad)["param"] == "image", bad.text
    finally:
        s.stop()
