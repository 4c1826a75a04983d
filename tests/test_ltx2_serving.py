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


# ---------------------------------------------------------------------------------------------- upstream
def _upstream_pipeline(tmp: Path):
    """The tiny model as a real diffusers LTX2Pipeline (transformers Gemma 3 + GemmaTokenizer), same random weights
    as the hand-written root, saved with save_pretrained."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        GemmaTokenizerFast,
    )

    from manifests.ltx2.model import load_model_variant
    from optimized.models.ltx2.instance import component_key_shapes
    from tests.ltx2_pipeline_root import (
        gemma_transformers_config,
        random_state,
        write_tokenizer,
    )
    cfg = load_model_variant("tiny")
    shapes = component_key_shapes(cfg)
    mods = {"transformer": LTX2VideoTransformer3DModel(**cfg.transformer.to_dict()),
            "connectors": LTX2TextConnectors(**cfg.connectors.to_dict()),
            "vae": AutoencoderKLLTX2Video(**cfg.vae.to_dict()),
            "audio_vae": AutoencoderKLLTX2Audio(**cfg.audio_vae.to_dict()),
            "vocoder": LTX2Vocoder(**cfg.vocoder.to_dict())}
    text = gemma_transformers_config(cfg.text_encoder)["text_config"]
    te = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                         "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4))
    for i, name in enumerate(("transformer", "connectors", "text_encoder", "vae", "audio_vae", "vocoder")):
        state = random_state(shapes[name], i)
        if name == "text_encoder":
            missing, unexpected = te.load_state_dict({f"model.language_model.{k}": v for k, v in state.items()},
                                                     strict=False)
            assert not unexpected and not [k for k in missing if "language_model" in k]
        else:
            mods[name].load_state_dict(state, strict=True)
    write_tokenizer(tmp / "tok")
    tok = GemmaTokenizerFast(tokenizer_file=str(tmp / "tok" / "tokenizer.json"), pad_token="<pad>",
                             eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**cfg.scheduler.to_diffusers()),
                        text_encoder=te.eval(), tokenizer=tok, **{k: m.eval() for k, m in mods.items()})
    pipe.save_pretrained(tmp / "root")
    return pipe


@pytest.mark.upstream
def test_a_diffusers_saved_pipeline_converts_and_serves_what_diffusers_computes(tmp_path):
    """save_pretrained's own LTX2Pipeline root -> fvconvert -> the engine from the prompt (its tokenizer): latents,
    frames and waveform equal diffusers' LTX2Pipeline.__call__ on the same prompt (max_sequence_length 1024)."""
    from converters.cli import main
    from manifests.parity import load_parity_contract
    from optimized.serving.loading import load_engine
    from optimized.serving.requests import build_request
    from parity.report import tensor_check
    pipe = _upstream_pipeline(tmp_path)
    assert main(["ltx2", "--from", "diffusers", str(tmp_path / "root"), str(tmp_path / "out"), "--quiet"]) == 0
    engine = load_engine("ltx2", str(tmp_path / "out"), None)
    request, _ = build_request(engine, prompt="a cat runs", negative_prompt="rain", num_steps=3, seed=4)
    got = engine.generate_video(request)
    kw = {"prompt": "a cat runs", "negative_prompt": "rain", "height": 64, "width": 64, "num_frames": 9,
          "num_inference_steps": 3, "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
          "audio_modality_scale": 1.0, "return_dict": False}
    with torch.no_grad():
        video, audio = pipe(**kw, output_type="latent", generator=torch.Generator().manual_seed(4))
        frames, wave_up = pipe(**kw, output_type="pt", generator=torch.Generator().manual_seed(4))
    tol = load_parity_contract("ltx2").tolerance("C1", "float32", "cpu")
    for name, a, b in (("video", got.latents["vision"], video), ("audio", got.latents["sound"], audio),
                       ("waveform", got.audio, wave_up[0].clamp(-1, 1))):
        check = tensor_check(name, a, b, tol)
        assert check.passed, (name, check.metrics)
    want = (frames[0].permute(0, 2, 3, 1) * 255).round()          # [F, H, W, 3] from upstream's [0, 1] frames
    assert (got.frames.float() - want).abs().max() <= 1


def test_requests_batch_in_one_dit_call_and_equal_each_alone():
    """Two requests of one shape (different seeds, scales, step counts) run as one batch per step on the engine;
    each equals itself run alone (and the reference loop) within the C1 tolerance."""
    from manifests.ltx2.request import Ltx2GenerateRequest
    from manifests.parity import load_parity_contract
    from optimized import Engine
    from parity.report import tensor_check
    engine = Engine.from_variant("ltx2:tiny", seed=3)
    reqs = [Ltx2GenerateRequest(torch.tensor([2, 5, 9]), num_frames=9, height=64, width=64, num_steps=3, seed=1,
                                guidance_scale=3.0),
            Ltx2GenerateRequest(torch.tensor([2, 7]), torch.tensor([2, 11]), num_frames=9, height=64, width=64,
                                num_steps=2, seed=2, guidance_scale=2.0, audio_guidance_scale=None,
                                guidance_rescale=0.0)]
    sizes: list[int] = []
    engine.subscribe(lambda ev: sizes.append(ev.data["batch_size"]) if ev.data.get("loop") == "ltx2.denoise"
                     else None, prefix="trace.step")
    handles = [engine.submit(r) for r in reqs]
    together = [h.result()["latents"] for h in handles]
    assert max(sizes) == 2
    tol = load_parity_contract("ltx2").tolerance("C1", "float32", "cpu")
    for r, got in zip(reqs, together):
        alone = engine.generate(r)["latents"]
        for k in ("vision", "sound"):
            check = tensor_check(k, got[k], alone[k], tol)
            assert check.passed, (k, check.metrics)


# ---------------------------------------------------------------------------------------------- --from original
def _original_vae_key(key: str) -> str:
    """A diffusers video VAE key in the Lightricks single-file spelling (the inverse of diffusers' renames; checked
    below against diffusers' own converter)."""
    m = re.match(r"^encoder\.down_blocks\.(\d)\.(resnets|downsamplers\.0)\.(.+)$", key)
    if m:
        i = int(m[1])
        return f"vae.encoder.down_blocks.{2 * i if m[2] == 'resnets' else 2 * i + 1}." + \
            (f"res_blocks.{m[3]}" if m[2] == "resnets" else m[3])
    m = re.match(r"^decoder\.up_blocks\.(\d)\.(resnets|upsamplers\.0)\.(.+)$", key)
    if m:
        i = int(m[1])
        return f"vae.decoder.up_blocks.{2 * i + 2 if m[2] == 'resnets' else 2 * i + 1}." + \
            (f"res_blocks.{m[3]}" if m[2] == "resnets" else m[3])
    key = key.replace("encoder.mid_block.resnets.", "encoder.down_blocks.8.res_blocks.")
    key = key.replace("decoder.mid_block.resnets.", "decoder.up_blocks.0.res_blocks.")
    key = {"latents_mean": "per_channel_statistics.mean-of-means",
           "latents_std": "per_channel_statistics.std-of-means"}.get(key, key)
    return "vae." + key


@pytest.mark.upstream
def test_fvconvert_from_the_original_single_file_media(tmp_path, capsys):
    """`fvconvert ltx2 --from original-vae` / `original-audio-vae` on a Lightricks-layout single file (LTX-2.0's
    4 down / 3 up video VAE blocks at tiny widths): diffusers' convert_ltx2_*_to_diffusers map the file to exactly the
    diffusers keys; ours to the same tensors, the other components' keys dropped, a stray key refused by name."""
    from diffusers.loaders.single_file_utils import (
        convert_ltx2_audio_vae_to_diffusers,
        convert_ltx2_vae_to_diffusers,
    )
    from safetensors.torch import load_file, save_file

    from converters.cli import main
    from manifests.ltx2.audio_vae import audio_vae_key_shapes, load_audio_vae_variant
    from manifests.ltx2.video_vae import Ltx2VideoVaeConfig, video_vae_key_shapes
    from tests.ltx2_pipeline_root import random_state
    vcfg = Ltx2VideoVaeConfig(latent_channels=8, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
                              layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                              spatial_compression_ratio=32, temporal_compression_ratio=8).validate()
    acfg = load_audio_vae_variant("tiny")
    vae, avae = random_state(video_vae_key_shapes(vcfg), 1), random_state(audio_vae_key_shapes(acfg), 2)
    original = {_original_vae_key(k): v for k, v in vae.items()}
    original["vae.per_channel_statistics.channel"] = torch.arange(8.0)
    original["vae.per_channel_statistics.mean-of-stds"] = torch.ones(8)
    assert set(convert_ltx2_vae_to_diffusers({k: v for k, v in original.items() if k.startswith("vae.")})) == set(vae)
    audio = {"audio_vae." + {"latents_mean": "per_channel_statistics.mean-of-means",
                             "latents_std": "per_channel_statistics.std-of-means"}.get(k, k): v for k, v in avae.items()}
    assert set(convert_ltx2_audio_vae_to_diffusers(dict(audio))) == set(avae)
    original.update(audio)
    original["model.diffusion_model.proj_in.weight"] = torch.zeros(4, 4)      # the single file's other parts
    src = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file(original, str(src))
    for fmt, name, cfg, want in (("original-vae", "vae", vcfg, vae), ("original-audio-vae", "audio_vae", acfg, avae)):
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg.to_dict()))
        assert main(["ltx2", "--from", fmt, str(src), str(tmp_path / name), "--config", str(tmp_path / f"{name}.json"),
                     "--quiet"]) == 0   # the post-check (C0 of the converted component) passes
        got = load_file(str(tmp_path / name / "model.safetensors"))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
    save_file({**original, "vae.decoder.up_blocks.7.conv.weight": torch.zeros(1)}, str(src))
    capsys.readouterr()
    assert main(["ltx2", "--from", "original-vae", str(src), str(tmp_path / "bad"), "--config",
                 str(tmp_path / "vae.json"), "--quiet"]) == 2
    assert "up_blocks.7" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_a_bf16_engine_runs_and_stays_close_to_fp32():
    """The bf16 engine (DiT, connectors, Gemma in bf16; the loop and the media in fp32) runs end to end."""
    from manifests.ltx2.request import Ltx2GenerateRequest
    from optimized import Engine
    from parity.metrics import compare
    req = Ltx2GenerateRequest(torch.tensor([2, 5, 7]), num_frames=9, height=64, width=64, num_steps=2)
    half = Engine.from_variant("ltx2:tiny", dtype=torch.bfloat16).generate_video(req)
    full = Engine.from_variant("ltx2:tiny").generate_video(req)
    for k in ("vision", "sound"):
        assert compare(half.latents[k], full.latents[k]).rel_l2 < 3e-2, k
    assert half.audio is not None and torch.isfinite(half.audio).all()


def test_a_request_that_can_never_fit_is_refused_before_anything_runs():
    from manifests.ltx2.request import Ltx2GenerateRequest
    from optimized import Engine, RequestRejected
    engine = Engine.from_variant("ltx2:tiny", memory_budget_bytes=64 << 20)
    small = Ltx2GenerateRequest(torch.tensor([2, 5]), num_frames=9, height=64, width=64, num_steps=2)
    cost = engine.family.request_cost(engine, small, ("denoise", "decode", "artifact"))
    assert cost is not None and 0 < cost.peak[1] < 64 << 20
    big = Ltx2GenerateRequest(torch.tensor([2, 5]), num_frames=257, height=1024, width=1024, num_steps=2)
    with pytest.raises(RequestRejected, match=r"ltx2 request: needs about .* GiB at its peak \((decode|artifact)\)"):
        engine.start_video(big)
    engine.generate_video(small)          # the small one still runs under that budget


def test_prompts_are_encoded_once_and_a_cache_hit_is_bitwise_a_miss():
    from manifests.ltx2.request import Ltx2GenerateRequest
    from optimized import Engine
    engine = Engine.from_variant("ltx2:tiny")
    req = Ltx2GenerateRequest(torch.tensor([2, 5, 9]), num_frames=9, height=64, width=64, num_steps=2)
    events: list[str] = []
    engine.subscribe(lambda ev: events.append(ev.data["op"]), prefix="trace.cache")
    first = engine.generate(req)["latents"]
    cache = engine.model.text_cache
    assert (cache.hits, cache.misses) == (0, 2)                  # the prompt and the empty negative prompt
    again = engine.generate(req)["latents"]
    assert (cache.hits, cache.misses) == (2, 2) and "hit" in events
    assert all(torch.equal(first[k], again[k]) for k in first)


# the renames of diffusers' scripts/convert_ltx2_to_diffusers.py (LTX_2_0_VOCODER_RENAME_DICT, LTX_2_0_TEXT_ENCODER_
# RENAME_DICT + get_text_encoder_keys_from_combined_ckpt), applied as that script applies them (str.replace in order)
SCRIPT_RENAMES = {"vocoder": {"ups": "upsamplers", "resblocks": "resnets", "conv_pre": "conv_in",
                              "conv_post": "conv_out"},
                  "connectors": {"video_embeddings_connector": "video_connector",
                                 "audio_embeddings_connector": "audio_connector",
                                 "transformer_1d_blocks": "transformer_blocks", "q_norm": "norm_q", "k_norm": "norm_k"}}


def _script_forward(kind: str, key: str) -> str:
    if kind == "connectors" and key == "text_embedding_projection.aggregate_embed.weight":
        return "text_proj_in.weight"
    key = key.removeprefix("vocoder." if kind == "vocoder" else "model.diffusion_model.")
    for old, new in SCRIPT_RENAMES[kind].items():
        key = key.replace(old, new)
    return key


def _original_name(kind: str, key: str) -> str:
    if kind == "vocoder":
        for new, old in (("upsamplers", "ups"), ("resnets", "resblocks"), ("conv_in", "conv_pre"),
                         ("conv_out", "conv_post")):
            key = key.replace(new, old)
        return "vocoder." + key
    if key == "text_proj_in.weight":
        return "text_embedding_projection.aggregate_embed.weight"
    for new, old in (("video_connector", "video_embeddings_connector"), ("audio_connector", "audio_embeddings_connector"),
                     ("transformer_blocks", "transformer_1d_blocks"), ("norm_q", "q_norm"), ("norm_k", "k_norm")):
        key = key.replace(new, old)
    return "model.diffusion_model." + key


@pytest.mark.parametrize("kind, fmt", [("vocoder", "original-vocoder"), ("connectors", "original-connectors")])
def test_fvconvert_from_the_original_single_file_connectors_and_vocoder(tmp_path, capsys, kind, fmt):
    """The single file's vocoder / connectors (names as diffusers' conversion script reads them: the script's
    renames map our synthetic original names back to exactly the canonical keys) convert to the same tensors, the
    rest of the file dropped, a stray key refused by name."""
    from safetensors.torch import load_file, save_file

    from converters.cli import main
    from manifests.ltx2.model import load_model_variant
    from optimized.models.ltx2.instance import component_key_shapes
    from tests.ltx2_pipeline_root import random_state
    model = load_model_variant("tiny")
    cfg = getattr(model, kind)
    want = random_state(component_key_shapes(model)[kind], 5)
    original = {_original_name(kind, k): v for k, v in want.items()}
    assert {_script_forward(kind, k) for k in original} == set(want)
    original.update({"vae.encoder.conv_in.conv.weight": torch.zeros(1), "audio_vae.decoder.x": torch.zeros(1),
                     "model.diffusion_model.proj_in.weight": torch.zeros(1)})
    original["vocoder.conv_pre.weight" if kind == "connectors" else
             "model.diffusion_model.video_embeddings_connector.learnable_registers"] = torch.zeros(1)
    src = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file(original, str(src))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    args = ["ltx2", "--from", fmt, str(src), str(tmp_path / "out"), "--config", str(tmp_path / "cfg.json"), "--quiet"]
    assert main(args) == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    stray = "vocoder.resblocks.0.convs3.0.weight" if kind == "vocoder" else \
        "model.diffusion_model.audio_embeddings_connector.transformer_1d_blocks.0.attn1.bogus.weight"
    save_file({**original, stray: torch.zeros(1)}, str(src))
    capsys.readouterr()
    assert main([*args[:4], str(tmp_path / "out2"), *args[5:]]) == 2
    assert stray.split(".", 1)[1] in capsys.readouterr().err and not (tmp_path / "out2").exists()
