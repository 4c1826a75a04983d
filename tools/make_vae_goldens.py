#!/usr/bin/env python
"""Make golden cases for probes ``wan.vae_encode``, ``wan.vae_decode`` (diffusers ``AutoencoderKLWan``, 2.1- and
2.2-like tiny configs) and ``cosmos3.sound_decode``, ``cosmos3.sound_encode`` (``Cosmos3AVAEAudioTokenizer``), all
with seeded random weights. Format: golden/README.md (case layout) and golden/wan/README.md (these probes).

    python tools/make_vae_goldens.py --out golden                 # every case below (golden/wan/*, golden/cosmos3_sound/*)
    python tools/make_vae_goldens.py --out golden --only tiny21_decode
    python tools/make_vae_goldens.py --verify golden/wan/* golden/cosmos3_sound/*   # re-run upstream, compare bitwise

Needs diffusers (0.42.1 was used), torch, safetensors; from_pretrained (--verify) needs accelerate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TESTED_DIFFUSERS = "0.42.1"
REL_L2_TOL = 1e-5

TINY21 = dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
              temperal_downsample=[False, True, True], latents_mean=[-0.3, 0.25, 0.1, -0.05],
              latents_std=[1.5, 0.8, 1.2, 2.0])                     # = manifests/wan/variants/tiny-2.1.json
TINY22 = dict(base_dim=4, decoder_base_dim=6, z_dim=6, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
              temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
              patch_size=2, scale_factor_spatial=16, latents_mean=[-0.2, 0.15, 0.05, -0.1, 0.3, 0.0],
              latents_std=[0.5, 1.1, 0.7, 0.9, 1.3, 0.6])           # = manifests/wan/variants/tiny-2.2.json
SOUND = dict(sampling_rate=150, vocoder_input_dim=8, dec_dim=4, dec_c_mults=[1, 2, 4], dec_strides=[2, 3, 5],
             dec_out_channels=2, enc_dim=4, enc_num_blocks=1, enc_n_fft=8, enc_hop_length=2, enc_latent_dim=16,
             enc_c_mults=[1, 2], enc_strides=[3, 5])                 # = manifests/cosmos3/sound/variants/tiny.json

CASES = {
    "tiny21_encode": dict(family="wan", probe="wan.vae_encode", cls="AutoencoderKLWan", config=TINY21, seed=210,
                          shape=[1, 3, 9, 16, 24], description="Wan2.1-like tiny VAE: encode 9 frames 16x24 "
                          "(chunks 1+4+4), posterior mean/logvar and a seeded sample"),
    "tiny21_decode": dict(family="wan", probe="wan.vae_decode", cls="AutoencoderKLWan", config=TINY21, seed=211,
                          shape=[1, 4, 3, 3, 2], description="Wan2.1-like tiny VAE: decode 3 latent frames 3x2 -> "
                          "9 frames 24x16 (temporal upsample 'Rep' cache, channel-halving up blocks)"),
    "tiny22_encode": dict(family="wan", probe="wan.vae_encode", cls="AutoencoderKLWan", config=TINY22, seed=220,
                          shape=[1, 3, 9, 32, 48], description="Wan2.2-like tiny VAE (patch 2, residual "
                          "AvgDown3D paths): encode 9 frames 32x48"),
    "tiny22_decode": dict(family="wan", probe="wan.vae_decode", cls="AutoencoderKLWan", config=TINY22, seed=221,
                          shape=[1, 6, 3, 2, 3], description="Wan2.2-like tiny VAE (DupUp3D first-chunk trim, "
                          "unpatchify): decode 3 latent frames 2x3 -> 9 frames 32x48"),
    "tiny_sound_decode": dict(family="cosmos3_sound", probe="cosmos3.sound_decode", cls="Cosmos3AVAEAudioTokenizer",
                              config={**SOUND, "encoder_enabled": False}, seed=300, shape=[1, 8, 7],
                              description="tiny AVAE decoder (strides 5,3,2 incl. odd output padding): 7 latent "
                              "frames -> [1, 2, 210] waveform, clamped"),
    "tiny_sound_encode": dict(family="cosmos3_sound", probe="cosmos3.sound_encode", cls="Cosmos3AVAEAudioTokenizer",
                              config=SOUND, seed=301, shape=[1, 2, 200],
                              description="tiny AVAE SpecConvNeXt encoder: 200 stereo samples (right-padded to "
                              "210) -> posterior over [1, 8, 7]"),
    # batch 2 at different loudness: normalize_volume divides by ONE peak over the whole batch (upstream), so
    # sample 0 (gain 0.25) is encoded at a quarter of the level a per-sample peak would give it
    "tiny_sound_encode_batch2": dict(family="cosmos3_sound", probe="cosmos3.sound_encode",
                                     cls="Cosmos3AVAEAudioTokenizer", config=SOUND, seed=304, shape=[2, 2, 200],
                                     gains=[0.25, 1.0],
                                     description="tiny AVAE encoder, batch 2 at per-sample gains 0.25 / 1.0: the "
                                     "volume is normalised by one peak over the whole batch -> posterior [2, 8, 7]"),
}


def _setup() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Every parameter, in state_dict order, from one generator: r = randn(shape).
    RMS/Layer norm scales 1 + 0.1r; biases 0.1r; Snake alpha/beta 0.3r; weight-norm g 0.5(1 + 0.1r) (2(1 + 0.1r)
    for the final sound conv); every other weight r / sqrt(fan_in) (0.5 r / sqrt(fan_in) for Wan decoder.conv_out,
    so fewer pixels hit the [-1, 1] clamp)."""
    g = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    new = {}
    for name, t in state.items():
        r = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if name.endswith(("gamma", "norm.weight")):
            x = 1 + 0.1 * r
        elif name.endswith((".alpha", ".beta")):
            x = 0.3 * r
        elif name.endswith("weight_g"):
            x = (2.0 if name == "decoder.conv2.weight_g" else 0.5) * (1 + 0.1 * r)
        elif t.ndim == 1:
            x = 0.1 * r
        else:
            x = r / (t[0].numel() ** 0.5)
            if name == "decoder.conv_out.weight":
                x = 0.5 * x
        new[name] = x
    model.load_state_dict(new, strict=True)


def build_model(spec: dict):
    import diffusers
    torch.manual_seed(spec["seed"])
    model = getattr(diffusers, spec["cls"])(**spec["config"]).eval()
    randomize_weights(model, spec["seed"])
    return model


def make_inputs(spec: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    shape = spec["shape"]
    if spec["probe"] in ("wan.vae_encode", "cosmos3.sound_encode"):
        name = "video" if spec["probe"] == "wan.vae_encode" else "audio"
        x = torch.rand(shape, generator=g) * 2 - 1
        if "gains" in spec:  # per-sample loudness (batch cases)
            x = x * torch.tensor(spec["gains"]).view(-1, *([1] * (x.ndim - 1)))
        return {name: x}
    return {"latents": torch.randn(shape, generator=g)}


def run_probe(model, probe: str, inputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        if probe == "wan.vae_decode":
            return {"video": model.decode(inputs["latents"]).sample}
        if probe == "cosmos3.sound_decode":
            return {"audio": model.decode(inputs["latents"])}
        if probe == "wan.vae_encode":
            dist = model.encode(inputs["video"]).latent_dist
        else:
            dist = model.encode(inputs["audio"]).latent_dist
        sample = dist.sample(generator=torch.Generator().manual_seed(seed + 2))
        return {"posterior_mean": dist.mean, "posterior_std": dist.std, "posterior_sample": sample}


def build_case(name: str, out_root: Path) -> Path:
    import diffusers
    spec = CASES[name]
    _setup()
    model = build_model(spec)
    inputs = make_inputs(spec)
    outputs = {k: v.contiguous() for k, v in run_probe(model, spec["probe"], inputs, spec["seed"]).items()}
    for k, v in outputs.items():
        if not torch.isfinite(v).all():
            raise RuntimeError(f"{name}: non-finite {k}")
    case = out_root / spec["family"] / name
    if case.exists():
        shutil.rmtree(case)
    (case / "upstream").mkdir(parents=True)
    model.save_pretrained(case / "upstream", safe_serialization=True)
    save_file(inputs, str(case / "inputs.safetensors"))
    save_file(outputs, str(case / "outputs.safetensors"))
    meta = {
        "family": spec["family"], "probe": spec["probe"],
        "upstream": {"package": "diffusers", "version": diffusers.__version__, "class": spec["cls"],
                     "torch": torch.__version__},
        "upstream_format": "diffusers", "dtype": "float32", "seed": spec["seed"],
        "tolerance": {"rel_l2": REL_L2_TOL},
        "params": ({"sample_seed": spec["seed"] + 2} | ({"gains": spec["gains"]} if "gains" in spec else {})
                   if spec["probe"].endswith("encode") else {}),
        "description": spec["description"],
    }
    (case / "case.json").write_text(json.dumps(meta, indent=2) + "\n")
    stats = {k: f"{list(v.shape)} std {v.std():.3f}" for k, v in outputs.items()}
    print(f"{case}: {stats}")
    return case


def verify_case(case: Path) -> bool:
    import diffusers
    _setup()
    meta = json.loads((case / "case.json").read_text())
    model = getattr(diffusers, meta["upstream"]["class"]).from_pretrained(case / "upstream").eval()
    got = run_probe(model, meta["probe"], load_file(str(case / "inputs.safetensors")), meta["seed"])
    want = load_file(str(case / "outputs.safetensors"))
    ok = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    print(f"{case}: {'bit-exact' if ok else 'DIFFERS'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="golden root (cases go to OUT/<family>/<name>)")
    ap.add_argument("--only", action="append", choices=sorted(CASES), help="make only this case (repeatable)")
    ap.add_argument("--verify", type=Path, nargs="+", metavar="CASE_DIR")
    a = ap.parse_args(argv)
    if a.verify:
        return 0 if all([verify_case(d) for d in a.verify]) else 1
    if a.out is None:
        ap.error("--out is required (or use --verify)")
    for name in a.only or CASES:
        build_case(name, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
