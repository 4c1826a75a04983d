"""Video programs end to end on the engine: [encode] -> denoise -> decode as scheduled work, artifacts written
atomically, and frames equal to the reference program's (reference generate + reference VAE decode of the same
request) within the family's C4 tolerance. Negative control: a reference run of a different request fails it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from manifests.parity import load_parity_contract
from manifests.wan import WanGenerateRequest
from optimized import Engine
from optimized.programs import VideoResult
from optimized.runtime.artifacts import to_uint8_frames
from parity.artifacts import read_png_frames, video_similarity

_ENGINES: dict = {}


def engine(variant: str) -> Engine:
    if variant not in _ENGINES:
        _ENGINES[variant] = Engine.from_variant("cosmos3:tiny" if variant == "tiny" else variant, seed=0)
    return _ENGINES[variant]


def c4_ok(family: str, want_uint8: np.ndarray, got_uint8: np.ndarray) -> tuple[bool, dict]:
    tol = load_parity_contract(family).tolerance("C4", "float32", "cpu")
    m = video_similarity(want_uint8.astype(np.float64) / 255, got_uint8.astype(np.float64) / 255, 1.0)
    return m["ssim_min"] >= tol.min_ssim and m["psnr_db"] >= tol.min_psnr, m


def no_temp_left(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.startswith(".")]


def wan_request(seed: int = 3, steps: int = 3) -> WanGenerateRequest:
    return WanGenerateRequest(text_ids=torch.tensor([5, 9, 2, 77]), negative_text_ids=torch.tensor([1, 4]),
                              num_frames=5, height=32, width=32, num_steps=steps, guidance_scale=5.0, seed=seed)


def wan_reference_frames(eng: Engine, req: WanGenerateRequest) -> np.ndarray:
    from reference.wan.pipeline import WanReferencePipeline
    weights = eng.family.random_weights(eng.model.cfg, 0)   # the engine's own seeded weights
    ref = WanReferencePipeline(eng.model.cfg, weights)
    with torch.no_grad():
        video = ref.decode(ref.generate(req).latents)
    return to_uint8_frames(video).numpy()


def test_wan_t2v_generate_video_writes_frames_and_sidecar_equal_to_reference(tmp_path):
    eng = engine("tiny-2.1-t2v")
    req = wan_request()
    res = eng.generate_video(req, tmp_path / "clip")
    assert isinstance(res, VideoResult) and res.frames.dtype == torch.uint8
    assert tuple(res.frames.shape) == (5, 32, 32, 3) and res.audio is None
    assert set(res.timings) >= {"denoise", "decode", "total"} and res.seed == 3
    # the PNGs on disk are the returned frames; the sidecar says what made them; no temp dir left behind
    assert np.array_equal(read_png_frames(tmp_path / "clip"), res.frames.numpy())
    side = json.loads((tmp_path / "clip" / "video.json").read_text())
    assert side["seed"] == 3 and side["weights_version"] == "random:wan:tiny-2.1-t2v:0"
    assert side["request"]["text_ids"] == [5, 9, 2, 77] and side["request"]["num_steps"] == 3
    assert side["timings"]["decode"] > 0 and side["frames"] == [5, 32, 32, 3]
    assert no_temp_left(tmp_path)
    ok, m = c4_ok("wan", wan_reference_frames(eng, req), res.frames.numpy())
    assert ok, m
    # negative control: the reference program of another request is not within tolerance
    bad, m_bad = c4_ok("wan", wan_reference_frames(eng, wan_request(seed=4)), res.frames.numpy())
    assert not bad, m_bad


def cosmos3_reference_frames(eng: Engine, req, image: torch.Tensor | None = None) -> tuple[np.ndarray, torch.Tensor]:
    import reference.cosmos3 as ref
    from reference.cosmos3.sound import decode_cosmos3_outputs
    from reference.wan import load_vae, normalize_latents
    from optimized.models.cosmos3.media import cosmos3_media_vae_config, random_wan_vae_state
    cfg = eng.model.cfg
    vcfg = cosmos3_media_vae_config(cfg)
    vae = load_vae(vcfg, random_wan_vae_state(vcfg, 1))
    model = ref.load_transformer(cfg, eng.family.random_weights(cfg, 0)["transformer"])
    cond = None
    if image is not None:
        clip = image[None, :, None].expand(1, 3, 4 * (req.latent_frames - 1) + 1, *image.shape[1:]).contiguous()
        with torch.no_grad():
            cond = normalize_latents(vcfg, vae.encode(clip).mean)
        from dataclasses import replace
        req = replace(req, vision_condition_frames=(0,), condition_latents=cond)
    with torch.no_grad():
        video, _ = decode_cosmos3_outputs(vae, None, ref.generate(model, req).vision)
    return to_uint8_frames(video).numpy(), cond


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_cosmos3_generate_video_equal_to_reference(tmp_path, i2v):
    eng = engine("tiny")
    req = eng.build("video", num_frames=5, height=32, width=48, text_ids=torch.tensor([3, 1, 4, 1, 5]),
                    negative_text_ids=torch.tensor([0, 2]), num_steps=3, guidance_scale=4.0, seed=11)
    image = torch.linspace(-1, 1, 3 * 32 * 48).reshape(3, 32, 48) if i2v else None
    prog = eng.start_video(req, tmp_path / "out", image=image)
    kinds = []
    prog.subscribe(lambda ev: kinds.append((ev.kind, ev.data.get("stage"))))
    res = prog.result()
    stages = [s for k, s in kinds if k == "request.stage"]
    assert stages == (["encode"] if i2v else []) + ["denoise", "decode"]
    assert sum(1 for k, s in kinds if k == "progress" and s == "denoise") == 3
    assert sum(1 for k, s in kinds if k == "progress" and s == "decode") == 2  # one per latent chunk
    assert kinds[-1][0] == "request.completed" and no_temp_left(tmp_path)
    assert np.array_equal(read_png_frames(tmp_path / "out"), res.frames.numpy())
    side = json.loads((tmp_path / "out" / "video.json").read_text())
    assert side["media_weights_version"].startswith("random:") and side["seed"] == 11
    want, cond = cosmos3_reference_frames(eng, req, image)
    ok, m = c4_ok("cosmos3", want, res.frames.numpy())
    assert ok, m
    if i2v:  # the engine conditioned on the encoded image the reference also encodes
        assert torch.allclose(res.request.condition_latents, cond, atol=1e-5, rtol=1e-4)


def test_decode_chunks_of_concurrent_programs_are_batched_work_units():
    eng = engine("tiny-2.1-t2v")
    steps = []
    unsub = eng.subscribe(lambda ev: steps.append(ev) if ev.kind == "trace.step" else None)
    try:
        progs = [eng.start_video(wan_request(seed=s)) for s in (1, 2)]
        results = [p.result() for p in progs]
    finally:
        unsub()
    decode = [e for e in steps if e.data.get("phase") == "vae_decode_chunk"]
    assert decode and all(e.data["batch_size"] == 2 for e in decode)
    assert len({e.request_id for e in decode}) == 2 and all("/decode" in e.request_id for e in decode)
    assert not torch.equal(results[0].frames, results[1].frames)


def test_cancel_mid_denoise_writes_nothing(tmp_path):
    eng = engine("tiny-2.1-t2v")
    prog = eng.start_video(wan_request(steps=50), tmp_path / "never.mp4")
    prog.subscribe(lambda ev: prog.cancel() if ev.kind == "progress" and ev.data["step"] == 2 else None)
    with pytest.raises(RuntimeError, match="cancelled"):
        prog.result()
    assert prog.status == "cancelled" and prog.stage == "denoise"
    assert list(tmp_path.iterdir()) == []
    assert eng.scheduler.idle


def test_mp4_without_the_video_extra_fails_before_any_compute(tmp_path, monkeypatch):
    import optimized.runtime.artifacts as artifacts
    monkeypatch.setattr(artifacts, "ffmpeg_exe", lambda: None)
    eng = engine("tiny-2.1-t2v")
    before = eng.scheduler.tick_count
    with pytest.raises(ValueError, match=r"video.*extra.*imageio-ffmpeg"):
        eng.start_video(wan_request(), tmp_path / "clip.mp4")
    assert eng.scheduler.tick_count == before and list(tmp_path.iterdir()) == []
    (tmp_path / "taken").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        eng.start_video(wan_request(), tmp_path / "taken")


def test_mp4_and_sidecar(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    res = engine("tiny-2.1-t2v").generate_video(wan_request(), tmp_path / "clip.mp4")
    assert (tmp_path / "clip.mp4").stat().st_size > 0 and res.paths["video"].endswith("clip.mp4")
    assert json.loads((tmp_path / "clip.json").read_text())["request_id"] == res.request_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.json", "clip.mp4"]


def test_prompt_without_processor_or_tokenizer_is_a_clear_error():
    eng = engine("tiny-2.1-t2v")   # random weights: no tokenizer files for the family's processor
    with pytest.raises(ValueError, match=r"prompt: .*(no tokenizer files|no processor).*token ids"):
        eng.generate(prompt="a cat")


def test_deployment_card_is_json_and_says_what_is_served():
    card = engine("tiny-2.1-t2v").deployment_card()
    assert json.loads(json.dumps(card)) == card
    assert card["family"] == "wan" and card["variant"] == "tiny-2.1-t2v"
    assert card["weights_version"] == "random:wan:tiny-2.1-t2v:0" and "video" in card["programs"]
    assert card["buckets_captured"] == [] and card["parallel_plan"] == {}
    assert card["dtypes"]["model"] == "float32" and card["memory"]["parameter_bytes"] > 0
    assert card["memory"]["budget_bytes"] == engine("tiny-2.1-t2v").scheduler.memory_budget_bytes


def test_deployment_card_lists_the_captured_buckets():
    """After a run whose step bodies were captured (emulated CUDA-graph replay on CPU), the card names each
    bucket, per wan expert's cache; an eager engine lists none."""
    from optimized.runtime.compile import CompileCache

    eng = Engine.from_variant("tiny-2.1-t2v", seed=0)
    assert eng.deployment_card()["buckets_captured"] == []
    eng.model.configure_graph("cuda")
    eng.model.dit.graph_cache = CompileCache(emulate_capture=True)
    eng.generate(wan_request())
    card = eng.deployment_card()
    assert card["buckets_captured"] and {b["mode"] for b in card["buckets_captured"]} == {"cuda"}
    assert all(b["bucket"] and b["batch_size"] >= 1 for b in card["buckets_captured"])


@pytest.mark.parametrize("variant, tokenizer", [("tiny-2.1-t2v", "golden/wan/proc_umt5/upstream"),
                                                ("tiny", "golden/cosmos3/proc_wordlevel_tiny/upstream")])
def test_generate_from_a_prompt_through_the_family_processor(tmp_path, variant, tokenizer):
    pytest.importorskip("tokenizers")
    root = Path(__file__).resolve().parents[1]
    eng = Engine.from_variant("cosmos3:tiny" if variant == "tiny" else variant, seed=0)
    eng.tokenizer_dir = root / tokenizer
    image = torch.linspace(-1, 1, 3 * 32 * 32).reshape(3, 32, 32) if variant == "tiny" else None
    res = eng.generate(prompt="a cat on a mat", negative_prompt="blurry", num_steps=2, seed=5, image=image,
                       out=tmp_path / "f")
    proc = eng.family.processor(root / tokenizer)
    want = proc.build_request("a cat on a mat", "blurry", None, num_frames=5, height=32, width=32, steps=2,
                              guidance=5.0, seed=5)
    assert torch.equal(res.request.text_ids, want.text_ids) and res.seed == 5
    assert res.frames.shape == (5, 32, 32, 3) and (tmp_path / "f" / "video.json").exists()
    if image is not None:  # the processor's conditioning pixels went through the media chain's VAE encoder
        assert res.request.vision_condition_frames == (0,) and res.request.condition_latents is not None
