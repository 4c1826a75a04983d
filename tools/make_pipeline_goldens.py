#!/usr/bin/env python
"""Make golden cases for probe ``cosmos3.pipeline`` from upstream diffusers code: decoded frames and waveform.

One golden case = one end-to-end run of diffusers' ``Cosmos3OmniPipeline(..., output_type="pt")`` on tiny components
(CPU, fp32, one thread) with explicit noise and explicit token ids, keeping every component whose weights reach the
outputs:

  * ``upstream/``: a tiny ``Cosmos3OmniTransformer`` (C 48, p 2, P 192), weights ``make_goldens.randomize_weights``;
  * ``upstream_vae/``: a tiny ``AutoencoderKLWan`` with the Wan2.2 geometry (z 48, patch 2, residual, 16x / 4x) and
    non-trivial ``latents_mean`` / ``latents_std``, weights from ``make_vae_goldens.randomize_weights``. It decodes the
    final latents (after ``z / inv_std + mean``) and, in the i2v case, encodes the conditioning clip;
  * ``upstream_sound/`` (sound case): a tiny decoder-only ``Cosmos3AVAEAudioTokenizer`` (150 Hz, hop 6 = 25 latent
    Hz = the transformer's ``sound_latent_fps``), same weight recipe;
  * scheduler / tokenizer: as ``make_generate_goldens.py`` (stub tokenizer, ``tokenize_prompt`` replaced so the
    transformer gets exactly the stored ids; checked by a forward pre-hook).

Noise: the t2v+sound case passes the stored ``noise_vision`` / ``noise_sound`` as the pipeline's ``latents`` /
``sound_latents``. The i2v case cannot (explicit ``latents`` skip the conditioning mix, so the encoded image would
never reach the output): it passes ``generator=torch.Generator().manual_seed(params.noise_seed)`` and stores that
generator's draw as ``noise_vision`` (pure noise); the build checks that the pipeline's initial latents are exactly
``mask * x0 + (1 - mask) * noise_vision`` with x0 its own encoding of the clip (stored as ``condition_latents``).

Format: golden/README.md, section "Probe cosmos3.pipeline".

    python tools/make_pipeline_goldens.py --out golden/cosmos3               # both cases
    python tools/make_pipeline_goldens.py --out golden/cosmos3 --only pipe_i2v
    python tools/make_pipeline_goldens.py --verify golden/cosmos3/pipe_*     # re-run upstream from the files

Needs diffusers (0.42.1 was used), torch, safetensors, numpy, accelerate (for --verify: from_pretrained).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import make_vae_goldens  # noqa: E402
from golden_verify import judge  # noqa: E402
from make_generate_goldens import (_BASE, UNIPC_FIELDS, VAE_S, VAE_T, _dumps, _import_upstream, _realloc,  # noqa: E402
                                   _setup_determinism, _StubTokenizer, full_scheduler, make_scheduler)
from make_goldens import randomize_weights as randomize_transformer  # noqa: E402

FAMILY = "cosmos3"
PROBE = "cosmos3.pipeline"
UPSTREAM_CLASS = "Cosmos3OmniPipeline"
REL_L2_TOL = 1e-5
MAX_CASE_BYTES = 480 * 1024

Z = 48
VAE_CONFIG = dict(  # Wan2.2 geometry, narrow (dim_mult all 1) so the weights stay < 200 KB
    base_dim=4, decoder_base_dim=4, z_dim=Z, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_spatial=VAE_S, scale_factor_temporal=VAE_T,
    # = parity/families/cosmos3_c4.py:c4_vae_config (mean in [-0.3, 0.3], std in [0.5, 1.5])
    latents_mean=[round(0.3 * math.sin(1.7 * i + 0.3), 4) for i in range(Z)],
    latents_std=[round(1.0 + 0.5 * math.cos(2.3 * i), 4) for i in range(Z)],
)
SOUND_CONFIG = dict(sampling_rate=150, dec_dim=4, dec_c_mults=[1, 2], dec_strides=[2, 3], dec_out_channels=2,
                    encoder_enabled=False)   # hop 6 -> 25 latent Hz

CASES: dict[str, dict[str, Any]] = {
    "pipe_t2v_sound": dict(
        seed=7101,
        transformer=dict(_BASE, intermediate_size=16, sound_gen=True, sound_dim=8),
        pipeline=dict(num_frames=5, height=32, width=32, fps=16.0, num_inference_steps=3, guidance_scale=4.0,
                      scheduler=dict(flow_shift=10.0), enable_sound=True, image=False),
        text_len=10, negative_text_len=7,
        description="text-to-video + sound, decoded: 5 frames 32x32 at fps 16 (vision [1,48,2,2,2], sound [8,8] -> "
                    "waveform [2,48] at 150 Hz), 3 steps, CFG 4.0, flow_shift 10; output_type pt",
    ),
    "pipe_i2v": dict(
        seed=7102,
        transformer=dict(_BASE, intermediate_size=16, rope_theta=1e6),
        pipeline=dict(num_frames=5, height=32, width=32, fps=24.0, num_inference_steps=3, guidance_scale=5.0,
                      scheduler=dict(flow_shift=10.0), enable_sound=False, image=True),
        text_len=9, negative_text_len=11,
        description="image-to-video, decoded: a synthetic 32x32 picture repeat-padded to 5 frames and VAE-encoded "
                    "by the pipeline (latent frame 0 conditioned), generator noise, 3 steps, CFG 5.0; output_type pt",
    ),
}


def synthetic_image_uint8(h: int, w: int) -> np.ndarray:
    """The picture of parity/families/cosmos3_c4.py:synthetic_image as uint8 [H, W, 3]."""
    from parity.families.cosmos3.c4_setup import synthetic_image
    x = synthetic_image(h, w)                                    # [3, H, W] on the uint8 grid, in [-1, 1]
    return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def resolve(spec: dict[str, Any]) -> dict[str, Any]:
    p = spec["pipeline"]
    n = int(p["num_frames"])
    sound_frames = 0
    if p["enable_sound"]:
        hop = math.prod(SOUND_CONFIG["dec_strides"])
        sound_frames = (int(n / float(p["fps"]) * SOUND_CONFIG["sampling_rate"]) + hop - 1) // hop
    return {
        "num_frames": n, "height": int(p["height"]), "width": int(p["width"]), "fps": float(p["fps"]),
        "num_inference_steps": int(p["num_inference_steps"]), "guidance_scale": float(p["guidance_scale"]),
        "scheduler": full_scheduler(p["scheduler"]),
        "latent_frames": (n - 1) // VAE_T + 1, "latent_height": int(p["height"]) // VAE_S,
        "latent_width": int(p["width"]) // VAE_S, "sound_frames": sound_frames,
        "vision_condition_frames": [0] if p["image"] else [], "noise_seed": int(spec["seed"]) + 3,
    }


def make_inputs(spec: dict[str, Any], tcfg: dict[str, Any], params: dict[str, Any]) -> dict[str, torch.Tensor]:
    """input_ids, negative_input_ids (randint), then the vision noise, then the sound noise, from
    torch.Generator().manual_seed(seed + 1); i2v: the vision noise is the pipeline generator's draw instead."""
    g = torch.Generator().manual_seed(int(spec["seed"]) + 1)
    V = tcfg["vocab_size"]
    t = {"input_ids": torch.randint(0, V, (spec["text_len"],), generator=g, dtype=torch.int64),
         "negative_input_ids": torch.randint(0, V, (spec["negative_text_len"],), generator=g, dtype=torch.int64)}
    shape = (1, tcfg["latent_channel"], params["latent_frames"], params["latent_height"], params["latent_width"])
    if params["vision_condition_frames"]:
        t["noise_vision"] = torch.randn(shape, generator=torch.Generator().manual_seed(params["noise_seed"]))
        h, w = params["height"], params["width"]
        t["image"] = torch.from_numpy(synthetic_image_uint8(h, w)).permute(2, 0, 1).float() / 127.5 - 1.0
    else:
        t["noise_vision"] = torch.randn(shape, generator=g, dtype=torch.float32)
    if params["sound_frames"]:
        t["noise_sound"] = torch.randn((tcfg["sound_dim"], params["sound_frames"]), generator=g, dtype=torch.float32)
    return t


def build_components(up, spec: dict[str, Any]):
    seed = int(spec["seed"])
    torch.manual_seed(seed)
    transformer = up["Transformer"](**spec["transformer"])
    randomize_transformer(transformer, seed)
    torch.manual_seed(seed + 10)
    vae = up["VAE"](**VAE_CONFIG)
    make_vae_goldens.randomize_weights(vae, seed + 10)
    sound = None
    if spec["pipeline"]["enable_sound"]:
        torch.manual_seed(seed + 20)
        sound = up["AVAE"](vocoder_input_dim=spec["transformer"]["sound_dim"], **SOUND_CONFIG)
        make_vae_goldens.randomize_weights(sound, seed + 20)
    return transformer.eval(), vae.eval(), None if sound is None else sound.eval()


@torch.no_grad()
def run_probe(up, transformer, vae, sound, params: dict[str, Any], inputs: dict[str, torch.Tensor]):
    pipe = up["pmod"].Cosmos3OmniPipeline(
        transformer=transformer, text_tokenizer=_StubTokenizer(), vae=vae,
        scheduler=make_scheduler(up, params["scheduler"]), sound_tokenizer=sound, enable_safety_checker=False,
        use_native_flow_schedule=bool(params["scheduler"]["use_native_flow_schedule"]))
    pipe.set_progress_bar_config(disable=True)
    ids = ([int(i) for i in inputs["input_ids"].tolist()], [int(i) for i in inputs["negative_input_ids"].tolist()])
    log: dict[str, Any] = {"encode": [], "prepare": None, "calls": [], "decode_sound": []}
    pipe.tokenize_prompt = lambda *a, **k: (list(ids[0]), list(ids[1]))

    orig_encode = pipe._encode_video

    def encode_video(x):
        z = orig_encode(x)
        log["encode"].append((x.detach().clone(), z.detach().clone()))
        return z
    pipe._encode_video = encode_video

    orig_prepare = pipe.prepare_latents

    def prepare_latents(*a, **k):
        r = orig_prepare(*a, **k)
        log["prepare"] = {"latents": r[0].clone(), "vision_mask": r[5].clone()}
        return r
    pipe.prepare_latents = prepare_latents

    orig_decode = pipe.decode_sound

    def decode_sound(latent):
        log["decode_sound"].append(latent.detach().clone())
        return orig_decode(latent)
    pipe.decode_sound = decode_sound

    def pre_hook(module, args, kwargs):
        log["calls"].append({"input_ids": kwargs["input_ids"].clone(), "t": kwargs["vision_timesteps"].clone()})
    handle = transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    traj: list[torch.Tensor] = []

    def on_step_end(p, i, t, kw):
        traj.append(kw["latents"].detach().clone())
        return {}

    kw: dict[str, Any] = dict(
        prompt="(ids bypassed)", negative_prompt=None, num_frames=params["num_frames"], height=params["height"],
        width=params["width"], fps=params["fps"], num_inference_steps=params["num_inference_steps"],
        guidance_scale=params["guidance_scale"], output_type="pt", return_dict=True,
        callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"], enable_safety_check=False)
    if params["vision_condition_frames"]:
        kw.update(image=synthetic_image_uint8(params["height"], params["width"]),
                  generator=torch.Generator().manual_seed(params["noise_seed"]))
    else:
        kw.update(latents=inputs["noise_vision"].clone(), generator=None)
    if params["sound_frames"]:
        kw.update(enable_sound=True, sound_latents=inputs["noise_sound"].clone())
    try:
        out = pipe(**kw)
    finally:
        handle.remove()

    N = params["num_inference_steps"]
    per_step = 2 if params["guidance_scale"] != 1.0 else 1
    calls = log["calls"]
    assert len(calls) == N * per_step, (len(calls), N)
    for k, c in enumerate(calls):
        assert torch.equal(c["input_ids"], inputs["input_ids" if k % per_step == 0 else "negative_input_ids"])
    res = {
        "video": out.video.detach().clone(),                         # [T, 3, H, W] in [0, 1] (output_type "pt")
        "latents_vision": traj[-1].clone(),
        "trajectory_vision": torch.stack(traj),
        "timesteps": pipe.scheduler.timesteps.clone().to(torch.int64),
        "model_timesteps": torch.tensor([int(c["t"][0]) for c in calls[::per_step]], dtype=torch.int64),
    }
    if params["sound_frames"]:
        assert len(log["decode_sound"]) == 1
        res["latents_sound"] = log["decode_sound"][0]
        res["audio"] = out.sound.detach().clone()                   # [2, T_s * hop] in [-1, 1]
    if params["vision_condition_frames"]:
        (clip, x0), = log["encode"]
        T = params["num_frames"]
        assert clip.shape == (1, 3, T, params["height"], params["width"])
        assert torch.equal(clip[0, :, 0], inputs["image"]), "the pipeline's preprocessed image differs from `image`"
        assert all(torch.equal(clip[:, :, f], clip[:, :, 0]) for f in range(T)), "clip is not the image repeated"
        mask = log["prepare"]["vision_mask"]
        assert mask[:, 0, 0].nonzero().flatten().tolist() == params["vision_condition_frames"]
        want = mask * x0 + (1 - mask) * inputs["noise_vision"]
        assert torch.equal(log["prepare"]["latents"], want), "initial latents != mask * x0 + (1 - mask) * noise"
        res["condition_latents"] = x0.float()
    return {k: v.contiguous() for k, v in res.items()}


def _case_json(up, spec: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {
        "family": FAMILY, "probe": PROBE,
        "upstream": {"package": "diffusers", "version": up["diffusers"].__version__, "class": UPSTREAM_CLASS,
                     "torch": torch.__version__},
        "upstream_format": "diffusers", "dtype": "float32", "seed": int(spec["seed"]),
        "tolerance": {"rel_l2": REL_L2_TOL},
        "params": params,
        "description": spec["description"],
        "upstream_run": {"components": {"upstream": "Cosmos3OmniTransformer", "upstream_vae": "AutoencoderKLWan",
                                        "upstream_sound": "Cosmos3AVAEAudioTokenizer" if params["sound_frames"]
                                        else None},
                         "output_type": "pt",
                         "noise": "generator" if params["vision_condition_frames"] else "explicit latents",
                         "scheduler": {"class": "UniPCMultistepScheduler",
                                       "extra": {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}}},
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    return bad + [k for k in sorted(set(a) & set(b)) if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def build_case(name: str, spec: dict[str, Any], out_root: Path) -> Path:
    up = _import_upstream()
    _setup_determinism()
    transformer, vae, sound = build_components(up, spec)
    params = resolve(spec)
    inputs = make_inputs(spec, dict(spec["transformer"]), params)
    out = run_probe(up, transformer, vae, sound, params, inputs)
    torch.manual_seed(999)  # the global RNG must not matter
    again = run_probe(up, transformer, vae, sound, params, inputs)
    assert not _same(out, again), f"{name}: second run differs in {_same(out, again)}"
    for k, v in out.items():
        assert not v.is_floating_point() or torch.isfinite(v).all(), f"{k} not finite"
    case_dir, tmp = out_root / name, out_root / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    transformer.save_pretrained(tmp / "upstream", safe_serialization=True)
    vae.save_pretrained(tmp / "upstream_vae", safe_serialization=True)
    if sound is not None:
        sound.save_pretrained(tmp / "upstream_sound", safe_serialization=True)
    save_file(inputs, str(tmp / "inputs.safetensors"), metadata={"format": "pt"})
    save_file(out, str(tmp / "outputs.safetensors"), metadata={"format": "pt"})
    (tmp / "case.json").write_text(_dumps(_case_json(up, spec, params)) + "\n")
    for f in tmp.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    assert size < MAX_CASE_BYTES, f"{name}: {size / 1024:.0f} KiB >= {MAX_CASE_BYTES // 1024} KiB"
    if case_dir.exists():
        shutil.rmtree(case_dir)
    tmp.rename(case_dir)
    v = out["video"]
    print(f"{name}: video {list(v.shape)} mean {v.mean():.3f} std {v.std():.3f} "
          f"clamped {(v == 0).float().mean() + (v == 1).float().mean():.1%}"
          + (f"; audio {list(out['audio'].shape)} rms {out['audio'].pow(2).mean().sqrt():.3f}"
             if "audio" in out else "")
          + f"; t={out['timesteps'].tolist()}; {size / 1024:.0f} KiB -> {case_dir}")
    return case_dir


def verify_case(case_dir: Path) -> bool:
    """Re-run upstream from the case files alone and compare every output exactly."""
    up = _import_upstream()
    _setup_determinism()
    meta = json.loads((case_dir / "case.json").read_text())
    load = lambda cls, sub: _realloc_ret(up[cls].from_pretrained(str(case_dir / sub), torch_dtype=torch.float32).eval())
    transformer, vae = load("Transformer", "upstream"), load("VAE", "upstream_vae")
    sound = load("AVAE", "upstream_sound") if (case_dir / "upstream_sound").is_dir() else None
    out = run_probe(up, transformer, vae, sound, meta["params"], load_file(str(case_dir / "inputs.safetensors")))
    ok, verdict = judge(out, load_file(str(case_dir / "outputs.safetensors")))
    print(f"{'OK  ' if ok else 'FAIL'} {case_dir}: {verdict}")
    return ok


def _realloc_ret(model):
    _realloc(model)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="output root, e.g. golden/cosmos3")
    ap.add_argument("--only", choices=sorted(CASES), help="build one case")
    ap.add_argument("--verify", type=Path, nargs="+", metavar="CASE_DIR")
    a = ap.parse_args(argv)
    if a.verify:
        return 0 if all([verify_case(d) for d in a.verify]) else 1
    if a.out is None:
        ap.error("--out is required (or use --verify)")
    for n in [a.only] if a.only else list(CASES):
        build_case(n, CASES[n], a.out)
    return 0


if __name__ == "__main__":
    assert set(UNIPC_FIELDS)  # the scheduler dict of a case = manifests/cosmos3/sampling.py:UniPCConfig fields
    sys.exit(main())
