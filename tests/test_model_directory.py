"""From a diffusers pipeline root to a video file: `fvconvert <family> --from diffusers <root> OUT` writes one canonical
model directory, `fvgen <family> --model OUT --prompt ...` (a subprocess) writes frames, and the frames equal the
reference program's (reference processor -> reference pipeline / sampler -> reference VAE decode, every weight
loaded from the same OUT through manifests.checkpoint.load_state) within the family's C4 tolerance. A reference run
of another prompt is the negative control. Pipeline roots are written by hand (no upstream package): diffusers
config.json + safetensors per component, model_index.json, scheduler config, the golden tiny tokenizers.

Also: optimized/serving names no family (every family-specific serving hook lives in the family's entry)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from manifests.checkpoint import load_state, read_checkpoint
from manifests.parity import load_parity_contract
from optimized.runtime.artifacts import to_uint8_frames
from parity.artifacts import read_png_frames, read_wav, snr_db, video_similarity

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a cat on a mat"
OTHER_PROMPT = "a red dog runs"
FRAMES, SIZE, STEPS = 5, (32, 32), 2
WAN_VARIANT = "tiny-2.1-t2v"


def run(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def c4_ok(family: str, want_uint8: np.ndarray, got_uint8: np.ndarray) -> tuple[bool, dict]:
    tol = load_parity_contract(family).tolerance("C4", "float32", "cpu")
    m = video_similarity(want_uint8.astype(np.float64) / 255, got_uint8.astype(np.float64) / 255, 1.0)
    return m["ssim_min"] >= tol.min_ssim and m["psnr_db"] >= tol.min_psnr, m


def _write(d: Path, config: dict, weights: dict, name: str = "diffusion_pytorch_model.safetensors") -> None:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(d / name))


def _tokenizer(dst: Path, golden_case: str) -> None:
    src = ROOT / "golden" / golden_case / "upstream"
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dst / name)


def write_wan_root(root: Path, seed: int = 0) -> None:
    """A WanPipeline (t2v) root at the tiny-2.1-t2v shapes, weights seeded as the engine's random variant."""
    from manifests.wan import load_model_variant
    from optimized.registry import family
    cfg = load_model_variant(WAN_VARIANT)
    w = family("wan").random_weights(cfg, seed)
    te = dict(w["text_encoder"], **{"encoder.embed_tokens.weight": w["text_encoder"]["shared.weight"].clone()})
    _write(root / "transformer", cfg.dit.to_diffusers_config(), w["transformer"])
    _write(root / "text_encoder", cfg.text_encoder.to_transformers_config(), te, "model.safetensors")  # tied (upstream)
    _write(root / "vae", {"_class_name": "AutoencoderKLWan", **cfg.vae.to_diffusers_config()}, w["vae"])
    _tokenizer(root / "tokenizer", "wan/proc_umt5")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": cfg.num_train_timesteps,
         "flow_shift": cfg.flow_shift, "use_flow_sigmas": True, "prediction_type": "flow_prediction"}))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"], "transformer_2": [None, None], "boundary_ratio": None,
        "expand_timesteps": False}))


COSMOS3_FLOW_SHIFT = 3.0     # not UniPCConfig's default (10.0): the request must take the model's own scheduler


def write_cosmos3_root(root: Path, seed: int = 0) -> None:
    """A Cosmos3OmniPipeline root at the tiny shapes: transformer (diffusers names), a Wan2.2-geometry VAE, the tiny
    AVAE sound tokenizer, the word-level tiny tokenizer as text_tokenizer, a UniPC scheduler config."""
    from manifests.cosmos3 import load_variant
    from manifests.cosmos3.sound import canonical_key_shapes as sound_shapes, load_variant as sound_variant
    from optimized.models.cosmos3.media import cosmos3_media_vae_config, random_wan_vae_state
    from optimized.registry import family
    from optimized.runtime.family import seeded_random_state
    from tests.test_converters import DIFFUSERS_CONFIGS, to_diffusers_key
    cfg = load_variant("tiny")
    canon = family("cosmos3").random_weights(cfg, seed)["transformer"]
    _write(root / "transformer", DIFFUSERS_CONFIGS["tiny"], {to_diffusers_key(k): v for k, v in canon.items()})
    vcfg = cosmos3_media_vae_config(cfg)
    _write(root / "vae", {"_class_name": "AutoencoderKLWan", **vcfg.to_diffusers_config()},
           random_wan_vae_state(vcfg, seed + 1))
    scfg = sound_variant("tiny")
    _write(root / "sound_tokenizer", {"_class_name": "Cosmos3AVAEAudioTokenizer", **scfg.to_diffusers_config()},
           seeded_random_state(sound_shapes(scfg), seed + 2, ones=("alpha",), scale=0.3))   # small gains: no clipping
    _tokenizer(root / "text_tokenizer", "cosmos3/proc_wordlevel_tiny")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "solver_order": 2,
         "solver_type": "bh2", "lower_order_final": True, "flow_shift": COSMOS3_FLOW_SHIFT, "use_flow_sigmas": True,
         "prediction_type": "flow_prediction", "use_karras_sigmas": False}))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "Cosmos3OmniPipeline", "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "Cosmos3OmniTransformer"], "vae": ["diffusers", "AutoencoderKLWan"],
        "text_tokenizer": ["transformers", "Qwen2TokenizerFast"], "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "sound_tokenizer": ["diffusers", "Cosmos3AVAEAudioTokenizer"], "safety_checker": [None, None],
        "enable_safety_checker": False, "default_use_system_prompt": True, "use_native_flow_schedule": False}))


# ---------------------------------------------------------------------------------------------- reference programs

def wan_reference(out: Path, prompt: str, seed: int = 0) -> np.ndarray:
    from reference.wan.pipeline import WanReferencePipeline
    from reference.wan.processor import WanProcessor
    ckpt = read_checkpoint(out)
    cfg = ckpt.typed_config()
    req = WanProcessor(ckpt.assets["tokenizer"]).build_request(
        prompt, None, None, num_frames=FRAMES, height=SIZE[0], width=SIZE[1], steps=STEPS, guidance=5.0, seed=seed)
    ref = WanReferencePipeline(cfg, {n: load_state(ckpt, component=n) for n in ckpt.components})
    with torch.no_grad():
        video = ref.decode(ref.generate(req).latents)
    return to_uint8_frames(video).numpy()


def cosmos3_reference(out: Path, prompt: str, seed: int = 0) -> tuple[np.ndarray, torch.Tensor | None]:
    import reference.cosmos3 as ref
    from reference.cosmos3.processor import Cosmos3Processor
    from reference.cosmos3.sound import decode_cosmos3_outputs, load_sound_tokenizer
    from reference.wan import load_vae
    ckpt = read_checkpoint(out)
    cfg = ckpt.typed_config()
    req = Cosmos3Processor(ckpt.assets["tokenizer"]).build_request(
        prompt, None, None, num_frames=FRAMES, height=SIZE[0], width=SIZE[1], steps=STEPS, guidance=5.0, seed=seed,
        scheduler=cfg.scheduler, sound=(cfg.sound.sampling_rate, cfg.sound.hop))
    assert req.scheduler.flow_shift == COSMOS3_FLOW_SHIFT and req.sound_frames > 0
    model = ref.load_transformer(cfg.transformer, load_state(ckpt, component="transformer"))
    vae = load_vae(cfg.vae, load_state(ckpt, component="vae"))
    sound = load_sound_tokenizer(cfg.sound, load_state(ckpt, component="sound_tokenizer"))
    with torch.no_grad():
        res = ref.generate(model, req)
    video, audio = decode_cosmos3_outputs(vae, sound, res.vision, res.sound)
    return to_uint8_frames(video).numpy(), None if audio is None else audio[0] if audio.ndim == 3 else audio


# ---------------------------------------------------------------------------------------------- the Done-when test

def convert(family: str, src: Path, out: Path, *extra: str) -> str:
    p = run("converters", family, "--from", "diffusers", src, out, "--skip-parity", "-q", *extra)
    assert p.returncode == 0, p.stderr
    return p.stdout


def fvgen(family: str, out: Path, dest: Path, prompt: str = PROMPT) -> dict:
    p = run("optimized.serving.fvgen", family, "--model", out, "--prompt", prompt, "--frames", FRAMES, "--size",
            f"{SIZE[0]}x{SIZE[1]}", "--steps", STEPS, "--seed", 0, "--out", dest)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def check_mp4(family: str, out: Path, tmp: Path, want_frames: np.ndarray) -> None:
    """A playable file: the MP4 decodes (ffmpeg) to the request's frame count and size, close to the PNG frames."""
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg", reason="MP4 output needs the optional `video` extra")
    clip = tmp / "clip.mp4"
    fvgen(family, out, clip)
    reader = imageio_ffmpeg.read_frames(str(clip), pix_fmt="rgb24")
    meta = next(reader)
    frames = np.stack([np.frombuffer(f, dtype=np.uint8).reshape(SIZE[0], SIZE[1], 3) for f in reader])
    assert tuple(meta["size"]) == (SIZE[1], SIZE[0]) and frames.shape == want_frames.shape
    assert video_similarity(want_frames / 255.0, frames / 255.0, 1.0)["psnr_db"] > 10   # lossy codec on noise-like tiny frames
    assert json.loads(clip.with_suffix(".json").read_text())["frames"] == list(want_frames.shape)


def test_wan_pipeline_root_to_video_equals_reference(tmp_path):
    pytest.importorskip("tokenizers")
    write_wan_root(tmp_path / "src")
    out = tmp_path / "OUT"
    assert "weights_version: sha256:" in convert("wan", tmp_path / "src", out, "--variant", WAN_VARIANT)
    ckpt = read_checkpoint(out)
    assert set(ckpt.components) == {"transformer", "text_encoder", "vae"} and set(ckpt.assets) == {"tokenizer",
                                                                                                    "scheduler"}
    summary = fvgen("wan", out, tmp_path / "frames")
    assert summary["weights_version"] == ckpt.weights_version and summary["frames"] == [FRAMES, *SIZE, 3]
    got = read_png_frames(tmp_path / "frames")
    ok, m = c4_ok("wan", wan_reference(out, PROMPT), got)
    assert ok, m
    bad, m_bad = c4_ok("wan", wan_reference(out, OTHER_PROMPT), got)   # negative control: another prompt
    assert not bad, m_bad
    check_mp4("wan", out, tmp_path, got)


def test_cosmos3_pipeline_root_to_video_and_sound_equal_reference(tmp_path):
    pytest.importorskip("tokenizers")
    write_cosmos3_root(tmp_path / "src")
    out = tmp_path / "OUT"
    assert "sound_tokenizer:" in convert("cosmos3", tmp_path / "src", out, "--variant", "tiny")
    index = json.loads((out / "model_index.json").read_text())
    assert index["family"] == "cosmos3" and index["format_version"] == 1
    assert index["components"] == {"transformer": "transformer", "vae": "vae", "sound_tokenizer": "sound_tokenizer"}
    assert index["assets"] == {"tokenizer": "tokenizer", "scheduler": "scheduler"}   # text_tokenizer -> tokenizer
    ckpt = read_checkpoint(out)
    assert ckpt.components["vae"].family == "wan" and ckpt.components["sound_tokenizer"].kind == "sound"
    assert ckpt.typed_config().scheduler.flow_shift == COSMOS3_FLOW_SHIFT
    # the engine loads it all: the transformer as the instance, VAE + sound decoder as its media chain
    from optimized import Engine
    from optimized.serving.families import media_chain
    eng = Engine.from_checkpoint(out)
    chain = eng.__dict__["_media_chain"]
    assert chain is media_chain(eng) and chain.sound is not None and chain.weights_version is None
    assert chain.vae.cfg == ckpt.typed_config().vae and eng.model.cfg == ckpt.typed_config().transformer
    summary = fvgen("cosmos3", out, tmp_path / "frames")
    assert summary["weights_version"] == ckpt.weights_version and summary["frames"] == [FRAMES, *SIZE, 3]
    assert summary["audio"] is not None
    got = read_png_frames(tmp_path / "frames")
    want, want_audio = cosmos3_reference(out, PROMPT)
    ok, m = c4_ok("cosmos3", want, got)
    assert ok, m
    pcm, rate = read_wav(tmp_path / "frames" / "audio.wav")
    assert rate == read_checkpoint(out).typed_config().sound.sampling_rate and pcm.shape == tuple(want_audio.shape)
    snr = snr_db(want_audio.clamp(-1, 1).double(), torch.from_numpy(pcm.astype(np.float64) / 32767))
    assert snr >= 20.0, snr     # the sound decode of the same sound latents (16-bit PCM, C4-close latents)
    bad, m_bad = c4_ok("cosmos3", cosmos3_reference(out, OTHER_PROMPT)[0], got)   # negative control
    assert not bad, m_bad
    check_mp4("cosmos3", out, tmp_path, got)


def test_transformer_only_cosmos3_checkpoint_names_the_whole_pipeline_conversion(tmp_path):
    from optimized import Engine
    from optimized.serving.families import ServingError, media_chain
    from tests.test_converters import make_diffusers_ckpt
    src, _ = make_diffusers_ckpt(tmp_path / "transformer")
    assert "pipeline" not in convert("cosmos3", src, tmp_path / "T")   # a component folder: one component
    eng = Engine.from_checkpoint(tmp_path / "T")
    with pytest.raises(ServingError, match="fvconvert cosmos3 --from diffusers <pipeline root>"):
        media_chain(eng)


def test_serving_names_no_family():
    from optimized.registry import families
    names = set(families())
    for path in sorted((ROOT / "optimized" / "serving").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for m in mods:
                assert not (set(m.split(".")) & names), f"{path.name} imports {m}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in names, f"{path.name} names family {node.value!r}"
    code = "import sys, optimized.serving.families, optimized.serving.requests, optimized.serving.fvgen; " \
           "print(sorted(m for m in sys.modules if m.startswith('optimized.models')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() in ("[]", "['optimized.models']")   # importing serving loads no family module
