"""ltx2 media components (video VAE, audio VAE, vocoder) at C0: reference vs optimized on the
same random canonical weights, first divergent module named, planted faults (one weight scaled on the optimized
side) that C0 must catch and localise.

One `PortedSides` per forward (decode; decode with the timestep conditioning; encode). `MEDIA_LEVELS` /
`MEDIA_FAULTS` are what the ltx2 `FAMILY` (parity/families/ltx2/__init__.py, owned by ltxpipe) wires in; until
then tests and `run_media_c0` call them directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import optimized.models.ltx2.audio_vae as opt_avae
import optimized.models.ltx2.video_vae as opt_vae
import optimized.models.ltx2.vocoder as opt_voc
import reference.ltx2.audio_vae as ref_avae
import reference.ltx2.video_vae as ref_vae
import reference.ltx2.vocoder as ref_voc
from manifests.errors import ManifestError
from manifests.ltx2.audio_vae import (
    AUDIO_VAE_GAINS,
    Ltx2AudioVaeConfig,
    audio_vae_key_shapes,
    load_audio_vae_variant,
)
from manifests.ltx2.video_vae import (
    VIDEO_VAE_GAINS,
    Ltx2VideoVaeConfig,
    load_video_vae_variant,
    video_vae_key_shapes,
)
from manifests.ltx2.vocoder import (
    VOCODER_GAINS,
    Ltx2VocoderConfig,
    load_vocoder_variant,
    vocoder_key_shapes,
)
from parity.errors import SetupError
from parity.family import golden_probe
from parity.golden import intermediate_checks, read_diffusers_dir
from parity.localise import TraceRecorder
from parity.port.kit import PortedSides
from parity.report import Report, exceptions_fail, tensor_check


def video_decode_inputs(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Latents of 2 frames at 2 x 2 (decodes to r_t + 1 frames), two requests with different decode timesteps
    (the timestep-conditioned decoder's per-request path)."""
    g = torch.Generator().manual_seed(seed + 101)
    out = {"z": torch.randn(2, cfg.latent_channels, 2, 2, 2, generator=g)}
    if cfg.timestep_conditioning:
        out["timestep"] = torch.tensor([0.05, 0.3])
    return out


def video_encode_inputs(cfg, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 202)
    s = cfg.spatial_ratio
    return {"video": torch.rand(2, cfg.in_channels, cfg.temporal_ratio + 1, 2 * s, 2 * s, generator=g) * 2 - 1}


def audio_decode_inputs(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Latents [2, L, 5 frames, mel_bins / 4] (decodes to 17 spectrogram frames)."""
    g = torch.Generator().manual_seed(seed + 303)
    return {"z": torch.randn(2, cfg.latent_channels, 5, max((cfg.mel_bins or 16) // 4, 1), generator=g)}


def audio_encode_inputs(cfg, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 404)
    return {"mel": torch.randn(2, cfg.in_channels, 17, cfg.mel_bins or 16, generator=g)}


def vocoder_inputs(cfg, seed: int) -> dict[str, torch.Tensor]:
    """A mel spectrogram [2, C, 9 frames, F] with C * F = in_channels (C = 2: LTX-2's stereo)."""
    g = torch.Generator().manual_seed(seed + 505)
    return {"mel": torch.randn(2, 2, 9, cfg.in_channels // 2, generator=g)}


COMPONENTS = {"video": (load_video_vae_variant, video_vae_key_shapes, VIDEO_VAE_GAINS),
              "audio": (load_audio_vae_variant, audio_vae_key_shapes, AUDIO_VAE_GAINS),
              "vocoder": (load_vocoder_variant, vocoder_key_shapes, VOCODER_GAINS)}


def _sides(make_inputs, reference, optimized, variants, fault_key, fault_layer, extra=(),
           component: str = "video") -> PortedSides:
    load, shapes, gains = COMPONENTS[component]
    return PortedSides(family="ltx2", load_variant=load, key_shapes=shapes, gains=gains, make_inputs=make_inputs,
                       reference=reference, optimized=optimized, default_variants=variants, fault_key=fault_key,
                       fault_layer=fault_layer, extra_faults=extra)


VIDEO_DECODE = _sides(video_decode_inputs, ref_vae.load_video_vae, opt_vae.load_video_vae, ("tiny", "tiny-tc"),
                      "decoder.up_blocks.1.resnets.0.conv2.conv.weight", "decoder.up_blocks.1",
                      extra=(("decoder.mid_block.resnets.0.conv1.conv.weight", "decoder.mid_block"),
                             ("decoder.up_blocks.0.upsamplers.0.conv.conv.bias", "decoder.up_blocks.0"),
                             ("decoder.conv_in.conv.weight", "decoder.conv_in")))
# faults only the timestep-conditioned decoder has: a block's timestep embedder, the output scale/shift table
VIDEO_DECODE_TC = _sides(video_decode_inputs, ref_vae.load_video_vae, opt_vae.load_video_vae, ("tiny-tc",),
                         "decoder.up_blocks.0.time_embedder.timestep_embedder.linear_2.weight", "decoder.up_blocks.0",
                         extra=(("decoder.scale_shift_table", "decoder.conv_out"),
                                ("decoder.mid_block.resnets.0.scale_shift_table", "decoder.mid_block")))
VIDEO_ENCODE = _sides(video_encode_inputs, ref_vae.load_video_encoder, opt_vae.load_video_encoder, ("tiny", "tiny-tc"),
                      "encoder.down_blocks.1.downsamplers.0.conv.conv.weight", "encoder.down_blocks.1",
                      extra=(("encoder.conv_out.conv.bias", "encoder.conv_out"),
                             ("encoder.down_blocks.0.resnets.0.conv1.conv.weight", "encoder.down_blocks.0")))

AUDIO_DECODE = _sides(audio_decode_inputs, ref_avae.load_audio_vae, opt_avae.load_audio_vae, ("tiny", "tiny-attn"),
                      "decoder.up.1.block.0.conv2.conv.weight", "decoder.up.1",
                      extra=(("decoder.mid.block_2.conv1.conv.weight", "decoder.mid"),
                             ("decoder.up.0.block.0.nin_shortcut.conv.weight", "decoder.up.0")),
                      component="audio")
AUDIO_DECODE_ATTN = _sides(audio_decode_inputs, ref_avae.load_audio_vae, opt_avae.load_audio_vae, ("tiny-attn",),
                           "decoder.up.1.attn.0.k.weight", "decoder.up.1",
                           extra=(("decoder.mid.attn_1.v.weight", "decoder.mid"),), component="audio")
AUDIO_ENCODE = _sides(audio_encode_inputs, ref_avae.load_audio_encoder, opt_avae.load_audio_encoder,
                      ("tiny", "tiny-attn"), "encoder.down.1.downsample.conv.weight", "encoder.down.1",
                      extra=(("encoder.conv_out.conv.bias", "encoder.conv_out"),), component="audio")

VOCODER = _sides(vocoder_inputs, ref_voc.load_vocoder, opt_voc.load_vocoder, ("tiny",), "upsamplers.1.weight",
                 "upsamplers.1", extra=(("resnets.1.convs1.1.weight", "resnets.1"),   # stage 0's second resblock
                                        ("conv_out.weight", "conv_out")), component="vocoder")

MEDIA_SIDES: dict[str, PortedSides] = {"video_vae.decode": VIDEO_DECODE, "video_vae.decode_tc": VIDEO_DECODE_TC,
                                       "video_vae.encode": VIDEO_ENCODE, "audio_vae.decode": AUDIO_DECODE,
                                       "audio_vae.decode_attn": AUDIO_DECODE_ATTN, "audio_vae.encode": AUDIO_ENCODE,
                                       "vocoder": VOCODER}
# fault name (unique across the media forwards) -> (forward, weight scaled, module C0 must name)
MEDIA_FAULTS: dict[str, tuple[str, str, str]] = {
    f"{forward}:{name}": (forward, key, layer)
    for forward, sides in MEDIA_SIDES.items() for name, (key, layer) in sides.faults.items()}


def run_media_c0(variants: list[str] | None, checkpoint: str | None, device: str, dtypes: list[str], seed: int,
                 fault: str | None, progress: Callable[[str], None], **_: Any) -> Report:
    """C0 of every media forward (each on its own default variants unless `variants` are named and fit it); a
    `fault` names an entry of MEDIA_FAULTS and plants it in its forward only."""
    report = Report("ltx2", "C0", {"components": sorted(MEDIA_SIDES), "device": device, "dtypes": dtypes,
                                   "seed": seed, "fault": fault})
    for forward, sides in MEDIA_SIDES.items():
        planted = None
        if fault is not None:
            if fault not in MEDIA_FAULTS:
                raise SetupError(f"unknown ltx2 media fault {fault!r}; faults: {', '.join(sorted(MEDIA_FAULTS))}")
            if MEDIA_FAULTS[fault][0] != forward:
                continue
            planted = fault.split(":", 1)[1]
        sub = sides.run_c0(list(variants or sides.default_variants), checkpoint, device, dtypes, seed, planted,
                           progress)
        for check in sub.checks:
            check.name = f"{forward}/{check.name}"
            report.checks.append(check)
    return report


# ---- golden ----

VIDEO_VAE_LOADERS = {"reference": ref_vae.load_video_vae, "optimized": opt_vae.load_video_vae}


@golden_probe(required=("latent_mean", "latent_std", "video", "normalized", "denormalized"),
              optional=("latent_mean@*", "video@*"))
def video_vae_probe(case, sides: tuple[str, ...]):
    """A case of tools/make_ltx2_media_goldens.py: the case's own AutoencoderKLLTX2Video config and weights
    (diffusers names = canonical), the posterior of `video`, the decode of `z` [at `timestep`], and the pipeline's
    latent (de)normalisation; every encoder / decoder block output against upstream's."""
    config, state = read_diffusers_dir(case)
    try:
        cfg = Ltx2VideoVaeConfig.from_diffusers_config(config)
    except ManifestError as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    tol = case.tolerance
    checks = []
    for side in sides:
        with exceptions_fail(checks, f"{case.name}/{side}:video"):
            vae = VIDEO_VAE_LOADERS[side](cfg, state)
            enc_trace, dec_trace = TraceRecorder(), TraceRecorder()
            moments = vae.encode(case.inputs["video"], trace=enc_trace)
            mean = vae.latent_mean(moments)
            logvar = moments[:, cfg.latent_channels:].clamp(-30.0, 20.0)   # DiagonalGaussianDistribution's clamp
            video = vae.decode(case.inputs["z"], case.inputs.get("timestep"), trace=dec_trace)
            for name, got in (("latent_mean", mean), ("latent_std", torch.exp(0.5 * logvar)), ("video", video),
                              ("normalized", vae.normalize(mean)),
                              ("denormalized", vae.denormalize(case.inputs["z"]))):
                checks.append(tensor_check(f"{case.name}/{side}:{name}", got, case.outputs[name], tol))
            checks += intermediate_checks(case, side, "latent_mean", enc_trace.records, tol)
            checks += intermediate_checks(case, side, "video", dec_trace.records, tol)
    return checks


AUDIO_VAE_LOADERS = {"reference": ref_avae.load_audio_vae, "optimized": opt_avae.load_audio_vae}


@golden_probe(required=("latent_mean", "latent_std", "mel", "normalized", "denormalized"),
              optional=("latent_mean@*", "mel@*"))
def audio_vae_probe(case, sides: tuple[str, ...]):
    """A case of tools/make_ltx2_media_goldens.py: AutoencoderKLLTX2Audio's posterior of `mel`, its decode of `z`,
    and LTX2Pipeline's (de)normalisation of the packed latents `packed`; every stage output against upstream's."""
    config, state = read_diffusers_dir(case)
    try:
        cfg = Ltx2AudioVaeConfig.from_diffusers_config(config)
    except ManifestError as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    tol = case.tolerance
    checks = []
    for side in sides:
        with exceptions_fail(checks, f"{case.name}/{side}:mel"):
            vae = AUDIO_VAE_LOADERS[side](cfg, state)
            enc_trace, dec_trace = TraceRecorder(), TraceRecorder()
            moments = vae.encode(case.inputs["mel"], trace=enc_trace)
            logvar = moments[:, cfg.latent_channels:].clamp(-30.0, 20.0)   # DiagonalGaussianDistribution's clamp
            packed = case.inputs["packed"]
            for name, got in (("latent_mean", vae.latent_mean(moments)), ("latent_std", torch.exp(0.5 * logvar)),
                              ("mel", vae.decode(case.inputs["z"], trace=dec_trace)),
                              ("normalized", vae.normalize(packed)), ("denormalized", vae.denormalize(packed))):
                checks.append(tensor_check(f"{case.name}/{side}:{name}", got, case.outputs[name], tol))
            checks += intermediate_checks(case, side, "latent_mean", enc_trace.records, tol)
            checks += intermediate_checks(case, side, "mel", dec_trace.records, tol)
    return checks


VOCODER_LOADERS = {"reference": ref_voc.load_vocoder, "optimized": opt_voc.load_vocoder}


@golden_probe(required=("waveform",), optional=("waveform@*",))
def vocoder_probe(case, sides: tuple[str, ...]):
    """A case of tools/make_ltx2_media_goldens.py: LTX2Vocoder's waveform of `mel`, every stage against upstream's."""
    config, state = read_diffusers_dir(case)
    try:
        cfg = Ltx2VocoderConfig.from_diffusers_config(config)
    except ManifestError as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    checks = []
    for side in sides:
        with exceptions_fail(checks, f"{case.name}/{side}:waveform"):
            trace = TraceRecorder()
            wav = VOCODER_LOADERS[side](cfg, state).vocode(case.inputs["mel"], trace=trace)
            checks.append(tensor_check(f"{case.name}/{side}:waveform", wav, case.outputs["waveform"], case.tolerance))
            checks += intermediate_checks(case, side, "waveform", trace.records, case.tolerance)
    return checks


MEDIA_GOLDEN_PROBES = {"ltx2.video_vae": video_vae_probe, "ltx2.audio_vae": audio_vae_probe,
                       "ltx2.vocoder": vocoder_probe}
