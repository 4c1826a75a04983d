"""Write golden/ltx2_media/ from upstream: diffusers 0.42.1 `AutoencoderKLLTX2Video` on tiny configs with upstream's
own seeded init (latent statistics and the timestep multiplier set as a released checkpoint has them: random
per-channel mean / std, multiplier 1000), encode and decode each with every block output hooked, plus LTX2Pipeline's
latent (de)normalisation. CPU, fp32, one thread, deterministic: regenerating gives identical tensors.

    python tools/make_ltx2_media_goldens.py [OUT_ROOT]     # default: golden/ltx2_media

Probe `ltx2.video_vae` (parity/families/ltx2/media.py) reads: inputs `video`, `z`, [`timestep`]; outputs
`latent_mean`, `latent_std` (the posterior), `normalized` (= _normalize_latents(latent_mean)), `denormalized`
(= _denormalize_latents(z)), `video` (= decode(z, timestep)), and `latent_mean@<encoder module>` /
`video@<decoder module>` intermediates.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# tiny: non-causal reflect decoder, a residual and a plain upsampler; tc: the timestep-conditioned causal decoder,
# every stride kind. Channels <= 8 keeps each case well under 0.2 MB.
BASE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "patch_size": 2, "patch_size_t": 1,
        "resnet_norm_eps": 1e-6, "encoder_causal": True, "encoder_spatial_padding_mode": "zeros",
        "decoder_spatial_padding_mode": "reflect"}
CASES = {
    "video_vae_tiny": dict(
        BASE, block_out_channels=[8, 8], down_block_types=["LTX2VideoDownBlock3D"] * 2, layers_per_block=[1, 1, 1],
        spatio_temporal_scaling=[True, True], downsample_type=["spatiotemporal", "spatiotemporal"],
        decoder_block_out_channels=[4, 8], decoder_layers_per_block=[1, 1, 1],
        decoder_spatio_temporal_scaling=[True, True], decoder_inject_noise=[False] * 3,
        upsample_type=["spatiotemporal", "spatiotemporal"], upsample_residual=[False, True], upsample_factor=[2, 2],
        timestep_conditioning=False, decoder_causal=False, scaling_factor=0.5),
    "video_vae_tc": dict(
        BASE, block_out_channels=[8, 8, 8], down_block_types=["LTX2VideoDownBlock3D"] * 3,
        layers_per_block=[1, 1, 1, 1], spatio_temporal_scaling=[True, True, True],
        downsample_type=["spatial", "temporal", "spatiotemporal"], decoder_block_out_channels=[2, 4, 8],
        decoder_layers_per_block=[1, 1, 1, 1], decoder_spatio_temporal_scaling=[True, True, True],
        decoder_inject_noise=[False] * 4, upsample_type=["spatiotemporal", "temporal", "spatial"],
        upsample_residual=[False, True, True], upsample_factor=[1, 2, 2], timestep_conditioning=True,
        decoder_causal=True, scaling_factor=1.0),
}
# audio: LTX-2's structure (pixel norm, causal in time) with attention at the 8-resolution level and the middle,
# 8 channels wide; base_channels = latent_channels * mel_bins / 4 as released (the packed statistics' width)
AUDIO_CASES = {
    "audio_vae_attn": {"base_channels": 8, "output_channels": 2, "ch_mult": [1, 1, 1], "num_res_blocks": 1,
                       "attn_resolutions": [8], "in_channels": 2, "resolution": 16, "latent_channels": 2,
                       "norm_type": "pixel", "causality_axis": "height", "mid_block_add_attention": True,
                       "mel_bins": 16, "double_z": True},
}
# vocoder: LTX-2.0's HiFi-GAN (leaky ReLU) with an even and an odd resblock kernel and an odd upsample kernel
VOCODER_CASES = {
    "vocoder_tiny": {"in_channels": 32, "hidden_channels": 16, "out_channels": 2, "upsample_kernel_sizes": [4, 5],
                     "upsample_factors": [2, 2], "resnet_kernel_sizes": [3, 4], "resnet_dilations": [[1, 3], [1, 2]],
                     "act_fn": "leaky_relu", "leaky_relu_negative_slope": 0.1, "antialias": False,
                     "final_act_fn": "tanh", "final_bias": True, "output_sampling_rate": 24000},
}
SEED = 0


def make_case(out_root: Path, name: str, cfg: dict) -> Path:
    import diffusers
    import torch
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    vae = AutoencoderKLLTX2Video(**cfg).eval()
    g = torch.Generator().manual_seed(SEED + 7)
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn(vae.latents_mean.shape, generator=g) * 0.5)
        vae.latents_std.copy_(torch.rand(vae.latents_std.shape, generator=g) + 0.5)
        if cfg["timestep_conditioning"]:
            vae.decoder.timestep_scale_multiplier.fill_(1000.0)   # the released value (init: 1000 as well)
    g = torch.Generator().manual_seed(SEED + 1)
    spatial = cfg["patch_size"] * 4                 # both cases: two spatial halvings
    video = torch.rand(2, 3, 5, 2 * spatial, 2 * spatial, generator=g) * 2 - 1
    z = torch.randn(2, cfg["latent_channels"], 2, 2, 2, generator=g)
    inputs = {"video": video, "z": z}
    if cfg["timestep_conditioning"]:
        inputs["timestep"] = torch.tensor([0.05, 0.4])

    hooks, traced = [], {}
    modules = dict(vae.named_modules())
    enc_names = (["encoder.conv_in"] + [f"encoder.down_blocks.{i}" for i in range(len(vae.encoder.down_blocks))]
                 + ["encoder.mid_block", "encoder.conv_out"])
    dec_names = (["decoder.conv_in", "decoder.mid_block"]
                 + [f"decoder.up_blocks.{i}" for i in range(len(vae.decoder.up_blocks))] + ["decoder.conv_out"])
    for n in enc_names + dec_names:
        hooks.append(modules[n].register_forward_hook(
            lambda m, a, out, n=n: traced.__setitem__(n, out.detach().clone())))
    with torch.no_grad():
        posterior = vae.encode(video).latent_dist
        decoded = vae.decode(z, inputs.get("timestep")).sample
    for h in hooks:
        h.remove()
    outputs = {
        "latent_mean": posterior.mean, "latent_std": posterior.std, "video": decoded,
        "normalized": LTX2Pipeline._normalize_latents(posterior.mean, vae.latents_mean, vae.latents_std,
                                                      vae.config.scaling_factor),
        "denormalized": LTX2Pipeline._denormalize_latents(z, vae.latents_mean, vae.latents_std,
                                                          vae.config.scaling_factor),
        **{f"latent_mean@{n}": traced[n] for n in enc_names}, **{f"video@{n}": traced[n] for n in dec_names}}

    case = out_root / name
    tmp = Path(tempfile.mkdtemp(dir=out_root, prefix=f".{name}."))
    try:
        vae.save_pretrained(tmp / "upstream", safe_serialization=True)
        config = json.loads((tmp / "upstream" / "config.json").read_text())
        save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp / "inputs.safetensors"))
        save_file({k: v.contiguous() for k, v in outputs.items()}, str(tmp / "outputs.safetensors"))
        meta = {"family": "ltx2", "probe": "ltx2.video_vae",
                "upstream": {"package": "diffusers", "version": diffusers.__version__,
                             "class_name": "AutoencoderKLLTX2Video", "torch": torch.__version__},
                "upstream_format": "diffusers", "dtype": "float32", "seed": SEED, "tolerance": {"rel_l2": 1e-5},
                "config": config,
                "intermediates": [f"latent_mean@{n}" for n in enc_names] + [f"video@{n}" for n in dec_names],
                "description": f"AutoencoderKLLTX2Video {name}: encode (posterior) and decode"
                               + (" with the decode timestep" if cfg["timestep_conditioning"] else "")
                               + ", LTX2Pipeline latent (de)normalisation"}
        (tmp / "case.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if case.exists():
            shutil.rmtree(case)
        tmp.rename(case)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return case


def make_audio_case(out_root: Path, name: str, cfg: dict) -> Path:
    import diffusers
    import torch
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    torch.manual_seed(SEED)
    vae = AutoencoderKLLTX2Audio(**cfg).eval()
    g = torch.Generator().manual_seed(SEED + 7)
    with torch.no_grad():
        vae.latents_mean.copy_(torch.randn(vae.latents_mean.shape, generator=g) * 0.5)
        vae.latents_std.copy_(torch.rand(vae.latents_std.shape, generator=g) + 0.5)
    g = torch.Generator().manual_seed(SEED + 1)
    mel = torch.randn(2, cfg["in_channels"], 17, cfg["mel_bins"], generator=g)
    z = torch.randn(2, cfg["latent_channels"], 5, cfg["mel_bins"] // 4, generator=g)
    packed = LTX2Pipeline._pack_audio_latents(z)
    hooks, traced = [], {}
    modules = dict(vae.named_modules())
    n = len(cfg["ch_mult"])
    enc_names = ["encoder.conv_in"] + [f"encoder.down.{i}" for i in range(n)] + ["encoder.mid", "encoder.conv_out"]
    dec_names = (["decoder.conv_in", "decoder.mid"] + [f"decoder.up.{i}" for i in reversed(range(n))]
                 + ["decoder.conv_out"])
    # upstream's stages (down.<l>, up.<l>, mid) are containers without a forward: each is stored as the output
    # of its last module to run (the downsample / upsample, else its last block or attention)
    def last_module(stage: str) -> str:
        if stage.endswith(".mid"):
            return stage + ".block_2"
        for tail in (".downsample", ".upsample"):
            if stage + tail in modules:
                return stage + tail
        last_block = max(int(k.split(".")[-1]) for k in modules if k.startswith(stage + ".block.")
                         and k.count(".") == stage.count(".") + 2)
        attn = f"{stage}.attn.{last_block}"
        return attn if attn in modules else f"{stage}.block.{last_block}"

    for m in enc_names + dec_names:
        hooks.append(modules[last_module(m) if m.split(".")[1] in ("down", "up", "mid") else m].register_forward_hook(
            lambda mod, a, out, m=m: traced.__setitem__(m, out.detach().clone())))
    with torch.no_grad():
        posterior = vae.encode(mel).latent_dist
        decoded = vae.decode(z).sample
    for h in hooks:
        h.remove()
    outputs = {"latent_mean": posterior.mean, "latent_std": posterior.std, "mel": decoded,
               "normalized": LTX2Pipeline._normalize_audio_latents(packed, vae.latents_mean, vae.latents_std),
               "denormalized": LTX2Pipeline._denormalize_audio_latents(packed, vae.latents_mean, vae.latents_std),
               **{f"latent_mean@{m}": traced[m] for m in enc_names}, **{f"mel@{m}": traced[m] for m in dec_names}}
    return _write(out_root, name, vae, {"mel": mel, "z": z, "packed": packed}, outputs, {
        "probe": "ltx2.audio_vae", "class_name": "AutoencoderKLLTX2Audio", "diffusers": diffusers.__version__,
        "torch": torch.__version__,
        "intermediates": [f"latent_mean@{m}" for m in enc_names] + [f"mel@{m}" for m in dec_names],
        "description": f"AutoencoderKLLTX2Audio {name}: encode (posterior) and decode of mel spectrogram latents, "
                       "LTX2Pipeline packed audio latent (de)normalisation"})


def make_vocoder_case(out_root: Path, name: str, cfg: dict) -> Path:
    import diffusers
    import torch
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(SEED)
    vocoder = LTX2Vocoder(**cfg).eval()
    g = torch.Generator().manual_seed(SEED + 1)
    mel = torch.randn(2, 2, 9, cfg["in_channels"] // 2, generator=g)
    names = ["conv_in"] + [f"upsamplers.{i}" for i in range(len(cfg["upsample_factors"]))] + ["conv_out"]
    modules, traced = dict(vocoder.named_modules()), {}
    hooks = [modules[n].register_forward_hook(lambda mod, a, out, n=n: traced.__setitem__(n, out.detach().clone()))
             for n in names]
    with torch.no_grad():
        wav = vocoder(mel)
    for h in hooks:
        h.remove()
    return _write(out_root, name, vocoder, {"mel": mel},
                  {"waveform": wav, **{f"waveform@{n}": traced[n] for n in names}}, {
        "probe": "ltx2.vocoder", "class_name": "LTX2Vocoder", "diffusers": diffusers.__version__,
        "torch": torch.__version__, "intermediates": [f"waveform@{n}" for n in names],
        "description": f"LTX2Vocoder {name}: mel spectrogram -> waveform (HiFi-GAN, leaky ReLU)"})


def _write(out_root: Path, name: str, model, inputs: dict, outputs: dict, info: dict) -> Path:
    from safetensors.torch import save_file

    case = out_root / name
    tmp = Path(tempfile.mkdtemp(dir=out_root, prefix=f".{name}."))
    try:
        model.save_pretrained(tmp / "upstream", safe_serialization=True)
        config = json.loads((tmp / "upstream" / "config.json").read_text())
        save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp / "inputs.safetensors"))
        save_file({k: v.contiguous() for k, v in outputs.items()}, str(tmp / "outputs.safetensors"))
        meta = {"family": "ltx2", "probe": info["probe"],
                "upstream": {"package": "diffusers", "version": info["diffusers"], "class_name": info["class_name"],
                             "torch": info["torch"]},
                "upstream_format": "diffusers", "dtype": "float32", "seed": SEED, "tolerance": {"rel_l2": 1e-5},
                "config": config, "intermediates": info["intermediates"], "description": info["description"]}
        (tmp / "case.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if case.exists():
            shutil.rmtree(case)
        tmp.rename(case)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return case


def main(argv: list[str]) -> int:
    try:
        import diffusers  # noqa: F401
        import torch
    except ImportError as e:
        print(f"make_ltx2_media_goldens: needs diffusers 0.42.1 and torch ({e})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out_root = Path(argv[0]).resolve() if argv else ROOT / "golden" / "ltx2_media"
    out_root.mkdir(parents=True, exist_ok=True)
    for name, cfg in CASES.items():
        print(make_case(out_root, name, cfg))
    for name, cfg in AUDIO_CASES.items():
        print(make_audio_case(out_root, name, cfg))
    for name, cfg in VOCODER_CASES.items():
        print(make_vocoder_case(out_root, name, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
