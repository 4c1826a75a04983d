"""ltx2 C4: decoded artifacts end to end, reference vs optimized, on tiny components (seeded random weights).

Each side runs its own whole chain, LTX2Pipeline's text-to-video+audio after the text encoder: the loop (connectors
-> noise -> guided Euler steps -> de-normalised latents; reference one request at a time, optimized both requests in
one batch), then the video VAE decode (at the decode timestep where the decoder is timestep-conditioned; decode noise
scale 0), the audio VAE decode (mel spectrogram) and the vocoder (waveform), each side with its own modules
(reference/ltx2/{pipeline,video_vae,audio_vae,vocoder}.py vs optimized/models/ltx2/...). The latents and mel are
compared at the C1 tolerance (where a failure is localised: denoise loop / VAE decode / vocoder), the frames by SSIM
and PSNR (scikit-image, [0, 1], data_range 1.0), the waveform by SNR (dB); then both sides' frames and audio are
written with the runtime's atomic writers (PNG, 16-bit WAV at the vocoder's rate), read back and compared again,
each read-back checked against the tensor it came from.

Cases: `t2va` (the tiny video VAE, no timestep conditioning) and `t2va_tc` (the timestep-conditioned decoder at
decode_timestep 0.05, its timestep multiplier at the released 1000; with the attention audio VAE), both from
text-encoder states; and `engine-tiny/.../t2va`: the whole tiny model from token ids
(Gemma 3 included), reference/ltx2/generate.py against the served `optimized.Engine` (its denoise loop kernel, two
requests submitted together, its media chain's uint8 frames and waveform). Planted faults (optimized side only): `c4-rgb-as-bgr` (the decoded frames' colour channels
reversed) and `c4-swapped-stereo` (the vocoder's left / right channels exchanged).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import optimized.models.ltx2 as opt
import optimized.models.ltx2.audio_vae as opt_avae
import optimized.models.ltx2.video_vae as opt_vae
import optimized.models.ltx2.vocoder as opt_voc
import reference.ltx2 as ref
import reference.ltx2.audio_vae as ref_avae
import reference.ltx2.video_vae as ref_vae
import reference.ltx2.vocoder as ref_voc
from manifests.errors import ManifestError
from manifests.ltx2 import key_shapes, load_variant
from manifests.ltx2.audio_vae import (
    AUDIO_VAE_GAINS,
    audio_vae_key_shapes,
    load_audio_vae_variant,
)
from manifests.ltx2.connectors import (
    connector_gains,
    connector_key_shapes,
    load_connectors_variant,
)
from manifests.ltx2.keys import GAINS
from manifests.ltx2.sampling import Ltx2Media, Ltx2Request, Ltx2SchedulerConfig
from manifests.ltx2.video_vae import (
    VIDEO_VAE_GAINS,
    load_video_vae_variant,
    video_vae_key_shapes,
)
from manifests.ltx2.vocoder import (
    VOCODER_GAINS,
    load_vocoder_variant,
    vocoder_key_shapes,
)
from manifests.parity import Tolerance, load_parity_contract
from optimized.models.ltx2.connectors import load_connectors as fast_connectors
from optimized.models.ltx2.pipeline import Ltx2Prompt
from optimized.models.ltx2.pipeline import generate_latents as fast_generate
from parity.artifacts import (
    fmt_db,
    frames01,
    png_frames_check,
    snr_db,
    video_similarity,
    write_and_read_back,
)
from parity.errors import SetupError
from parity.families.ltx2 import c1
from parity.family import Fault
from parity.metrics import compare, within
from parity.patching import patched
from parity.port.kit import gain_init
from parity.report import CheckResult, Report, exceptions_fail, raised_check
from parity.weights import random_state_dict
from reference.ltx2.connectors import load_connectors as ref_connectors
from reference.ltx2.pipeline import generate_latents as ref_generate

DEFAULT_BOUNDS = {"min_ssim": 0.999, "min_psnr": 60.0, "min_snr_db": 60.0}   # while the contract's C4 row lacks one


@dataclass(frozen=True)
class C4Case:
    name: str
    video_vae: str
    audio_vae: str = "tiny"
    decode_timestep: float | None = None


CASES = (C4Case("t2va", "tiny"), C4Case("t2va_tc", "tiny-tc", "tiny-attn", decode_timestep=0.05))
TRANSFORMER, CONNECTORS, VOCODER = "tiny", "tiny", "tiny"
# The 8-bit PNG / 16-bit WAV read-backs: quantisation alone moves a value by up to half a level, so they are bounded
# as every family's C4 default (the float rows use the contract's tighter, measured row).
QUANTISED_BOUNDS = {"min_ssim": 0.999, "min_psnr": 60.0, "min_snr_db": 60.0}
TIMESTEP_MULTIPLIER = 1000.0     # the video decoder's timestep_scale_multiplier at its released value


@dataclass(frozen=True)
class AudioBound:
    """Bound on the waveform SNR in dB (the table prints it as `min_snr_db>=...`)."""
    min_snr_db: float


@dataclass
class SideOutput:
    """One request's chain on one side (parity/artifacts.py reads .video [1, 3, T, H, W] and .audio [C, N])."""
    latents: dict[str, torch.Tensor]
    mel: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor


def requests() -> list[Ltx2Request]:
    base = {"height": 32, "width": 32, "num_frames": 9, "frame_rate": 24.0, "num_inference_steps": 3}
    return [Ltx2Request(**base, guidance_scale=3.0, audio_guidance_scale=7.0, guidance_rescale=0.7,
                        audio_guidance_rescale=0.7, seed=41),
            Ltx2Request(**base, guidance_scale=2.5, audio_guidance_scale=5.0, guidance_rescale=0.0,
                        audio_guidance_rescale=None, seed=42)]


@dataclass
class Components:
    tcfg: object
    ccfg: object
    vcfg: object
    acfg: object
    ocfg: object
    states: dict[str, dict[str, torch.Tensor]]
    media: Ltx2Media
    stats: dict[str, torch.Tensor]


def components(case: C4Case, seed: int) -> Components:
    tcfg, ccfg = load_variant(TRANSFORMER), load_connectors_variant(CONNECTORS)
    vcfg, acfg = load_video_vae_variant(case.video_vae), load_audio_vae_variant(case.audio_vae)
    ocfg = load_vocoder_variant(VOCODER)
    bins = acfg.mel_bins // 4
    if tcfg.in_channels != vcfg.latent_channels or tcfg.audio_in_channels != acfg.latent_channels * bins or \
            ocfg.in_channels != acfg.output_channels * acfg.mel_bins:
        raise SetupError("ltx2 C4: the tiny transformer, VAEs and vocoder do not fit together")
    states = {
        "transformer": random_state_dict(key_shapes(tcfg), seed, gain_init(GAINS)),
        "connectors": random_state_dict(connector_key_shapes(ccfg), seed + 1, gain_init(connector_gains(ccfg))),
        "video_vae": random_state_dict(video_vae_key_shapes(vcfg), seed + 2, gain_init(VIDEO_VAE_GAINS)),
        "audio_vae": random_state_dict(audio_vae_key_shapes(acfg), seed + 3, gain_init(AUDIO_VAE_GAINS)),
        "vocoder": random_state_dict(vocoder_key_shapes(ocfg), seed + 4, gain_init(VOCODER_GAINS)),
    }
    if "decoder.timestep_scale_multiplier" in states["video_vae"]:   # a gain near 1 would hide a dropped multiplier
        states["video_vae"]["decoder.timestep_scale_multiplier"] = torch.tensor(TIMESTEP_MULTIPLIER)
    media = Ltx2Media(spatial_compression=vcfg.spatial_ratio, temporal_compression=vcfg.temporal_ratio,
                      latent_channels=vcfg.latent_channels, audio_latent_channels=acfg.latent_channels,
                      mel_bins=acfg.mel_bins, sample_rate=acfg.sample_rate, hop_length=acfg.mel_hop_length)
    v, a = states["video_vae"], states["audio_vae"]
    # LTX2Pipeline._denormalize_latents / _denormalize_audio_latents: the VAEs' statistics (video / scaling factor)
    stats = {"video_mean": v["latents_mean"], "video_std": v["latents_std"] / vcfg.scaling_factor,
             "audio_mean": a["latents_mean"], "audio_std": a["latents_std"]}
    return Components(tcfg, ccfg, vcfg, acfg, ocfg, states, media, stats)


def _timestep(case: C4Case, n: int) -> torch.Tensor | None:
    return None if case.decode_timestep is None else torch.full((n,), case.decode_timestep)


def reference_chain(c: Components, case: C4Case, reqs, texts) -> list[SideOutput]:
    s = c.states
    transformer, connectors = ref.load_model(c.tcfg, s["transformer"]), ref_connectors(c.ccfg, s["connectors"])
    vae, avae = ref_vae.load_video_vae(c.vcfg, s["video_vae"]), ref_avae.load_audio_vae(c.acfg, s["audio_vae"])
    voc = ref_voc.load_vocoder(c.ocfg, s["vocoder"])
    out = []
    for r, t in zip(reqs, texts):                    # one request at a time
        video, audio = ref_generate(transformer, connectors, r, *t, c.stats, c.media, Ltx2SchedulerConfig())
        mel = avae.decode(audio)
        out.append(SideOutput({"video": video, "audio": audio}, mel, vae.decode(video, _timestep(case, 1)),
                              voc.vocode(mel)[0]))
    return out


def optimized_chain(c: Components, case: C4Case, reqs, texts) -> list[SideOutput]:
    s = c.states
    transformer, connectors = opt.load_model(c.tcfg, s["transformer"]), fast_connectors(c.ccfg, s["connectors"])
    vae, avae = opt_vae.load_video_vae(c.vcfg, s["video_vae"]), opt_avae.load_audio_vae(c.acfg, s["audio_vae"])
    voc = opt_voc.load_vocoder(c.ocfg, s["vocoder"])
    video, audio = fast_generate(transformer, connectors, reqs, [Ltx2Prompt(*t) for t in texts], c.stats, c.media,
                                 Ltx2SchedulerConfig())             # the requests in one batch, decoded in one batch
    frames, mel = vae.decode(video, _timestep(case, len(reqs))), avae.decode(audio)
    wav = voc.vocode(mel)
    return [SideOutput({"video": video[k:k + 1], "audio": audio[k:k + 1]}, mel[k:k + 1], frames[k:k + 1], wav[k])
            for k in range(len(reqs))]


# ------------------------------------------------------------------------------------------------ faults

def _rgb_as_bgr():
    def make(original):
        def decode(self, *a, **kw):
            return original(self, *a, **kw).flip(1)
        return decode
    return patched(opt_vae.FastLtx2VideoVae, "decode", make)


def _swapped_stereo():
    def make(original):
        def vocode(self, *a, **kw):
            return original(self, *a, **kw).flip(1)
        return vocode
    return patched(opt_voc.FastLtx2Vocoder, "vocode", make)


C4_FAULTS = {"c4-rgb-as-bgr": _rgb_as_bgr, "c4-swapped-stereo": _swapped_stereo}
FAULTS = (Fault("c4-rgb-as-bgr", "the optimized video VAE's decoded frames have their colour channels reversed", "C4",
                "video vae decode"),
          Fault("c4-swapped-stereo", "the optimized vocoder's left / right channels exchanged", "C4", "vocoder"))


@contextlib.contextmanager
def planted(fault: str | None) -> Iterator[None]:
    if fault is None:
        yield
        return
    with C4_FAULTS[fault]():
        yield


# ------------------------------------------------------------------------------------------------ checks

def _stage(latents_ok: bool, stage_ok: bool | None, stage: str, before: str) -> str:
    if not latents_ok:
        return f"denoise loop (final {before} latents differ)"
    if stage_ok is False:
        return f"{stage} (final {before} latents agree)"
    return f"{stage} (its input agrees)"


def artifact_checks(prefix: str, want: SideOutput, got: SideOutput, bounds: dict, latent_tol: Tolerance,
                    sample_rate: int, workdir: Path, progress) -> list[CheckResult]:
    checks: list[CheckResult] = []
    lat_ok = {}
    for m in ("video", "audio"):
        mt = compare(got.latents[m], want.latents[m])
        lat_ok[m] = within(mt, latent_tol)
        checks.append(CheckResult(f"{prefix}/latents_{m}", lat_ok[m], mt, latent_tol,
                                  divergence=None if lat_ok[m] else "denoise loop"))
    mm = compare(got.mel, want.mel)
    mel_ok = within(mm, latent_tol)
    checks.append(CheckResult(f"{prefix}/mel", mel_ok, mm, latent_tol, detail="audio VAE decode: mel spectrogram",
                              divergence=None if mel_ok else _stage(lat_ok["audio"], False, "audio vae decode",
                                                                    "audio")))

    frame_tol = Tolerance(min_ssim=bounds["min_ssim"], min_psnr=bounds["min_psnr"])
    sim = video_similarity(frames01(want.video), frames01(got.video), 1.0)
    ok = "shape_mismatch" not in sim and sim["ssim_min"] >= bounds["min_ssim"] and sim["psnr_db"] >= bounds["min_psnr"]
    c = CheckResult(f"{prefix}/frames", ok, compare((got.video + 1) / 2, (want.video + 1) / 2), frame_tol,
                    detail=f"SSIM min {sim['ssim_min']:.6f} (mean {sim['ssim_mean']:.6f}) over "
                           f"{len(sim['ssim_per_frame'])} frames {list(want.video.shape[3:])}, PSNR "
                           f"{fmt_db(sim['psnr_db'])} dB (frames in [0, 1], data_range 1.0)"
                           + (f"; {sim['shape_mismatch']}" if "shape_mismatch" in sim else ""))
    c.extra = {k: v if not (isinstance(v, float) and math.isinf(v)) else str(v) for k, v in sim.items()}
    if not ok:
        c.divergence = _stage(lat_ok["video"], False, "video vae decode", "video") + \
            f"; SSIM min {sim['ssim_min']:.4f}, PSNR {fmt_db(sim['psnr_db'])} dB"
    checks.append(c)

    snr = snr_db(want.audio, got.audio)
    ok = snr >= bounds["min_snr_db"]
    c = CheckResult(f"{prefix}/audio", ok, compare(got.audio, want.audio), AudioBound(bounds["min_snr_db"]),
                    detail=f"waveform SNR {fmt_db(snr)} dB, {list(want.audio.shape)} at {sample_rate} Hz")
    c.extra = {"snr_db": snr if math.isfinite(snr) else str(snr)}
    if not ok:
        c.divergence = (_stage(lat_ok["audio"], False, "audio vae decode", "audio") if not mel_ok or not lat_ok["audio"]
                        else "vocoder (the mel spectrogram agrees)") + f"; SNR {fmt_db(snr)} dB"
    checks.append(c)
    progress(f"[ltx2 C4] {prefix}: SSIM min {sim['ssim_min']:.6f}, PSNR {fmt_db(sim['psnr_db'])} dB, audio SNR "
             f"{fmt_db(snr)} dB")

    files = {side: write_and_read_back(out, workdir / prefix.replace("/", "_") / side, sample_rate)
             for side, out in (("reference", want), ("optimized", got))}
    intact = all(np.array_equal(f["frames"], f["frames_expected"]) and not f["leftovers"]
                 and np.array_equal(f["pcm"], f["pcm_expected"]) and f["rate"] == sample_rate for f in files.values())
    checks.append(CheckResult(f"{prefix}/artifacts_roundtrip", intact,
                              detail="PNG frames and WAV written atomically (no temp files left), read back equal "
                                     "to the quantised tensors" if intact else "a read-back artifact differs from "
                                     "the tensor it was written from, or a temp file was left behind"))
    q = QUANTISED_BOUNDS
    checks.append(png_frames_check(prefix, files, q, Tolerance(min_ssim=q["min_ssim"], min_psnr=q["min_psnr"])))
    pa, pb = files["reference"]["pcm"], files["optimized"]["pcm"]
    snr8 = snr_db(torch.from_numpy(pa.astype(np.float64)), torch.from_numpy(pb.astype(np.float64)))
    ok = snr8 >= q["min_snr_db"]
    c = CheckResult(f"{prefix}/wav", ok, None, AudioBound(q["min_snr_db"]), divergence=None if ok else "see audio",
                    detail=f"16-bit WAV read-back: SNR {fmt_db(snr8)} dB, {pa.shape[0]} channels x {pa.shape[1]}")
    c.extra = {"snr_db": snr8 if math.isfinite(snr8) else str(snr8)}
    checks.append(c)
    return checks


# ------------------------------------------------------------------------------------------------ the served engine

ENGINE_VARIANT = "tiny"      # manifests/ltx2/model.py: every component's tiny variant, Gemma 3 included


def engine_requests():
    from manifests.ltx2.request import Ltx2GenerateRequest
    base = {"num_frames": 9, "height": 64, "width": 64, "num_steps": 3}
    return [Ltx2GenerateRequest(torch.tensor([2, 5, 9]), **base, seed=41, guidance_scale=3.0),
            Ltx2GenerateRequest(torch.tensor([2, 7]), torch.tensor([2, 11]), **base, seed=42, guidance_scale=2.0,
                                audio_guidance_scale=None, guidance_rescale=0.0)]


def engine_case(seed: int, fault: str | None, bounds: dict, latent_tol: Tolerance, progress) -> list[CheckResult]:
    # (frames: the engine's uint8 against the reference's quantised, so QUANTISED_BOUNDS + at most one level apart;
    # the waveform is float on both sides: the contract's bound)
    """The whole model on both sides from token ids: reference/ltx2/generate.py (Gemma 3 -> connectors -> loop ->
    VAE decode, audio VAE -> vocoder, one request at a time) vs the served `optimized.Engine` (its denoise loop
    kernel, both requests submitted together, and its media chain: uint8 frames, waveform in [-1, 1])."""
    from manifests.ltx2.model import load_model_variant
    from optimized import Engine
    from optimized.models.ltx2.instance import random_weights
    from optimized.runtime.artifacts import to_uint8_frames
    from reference.ltx2.generate import Ltx2Reference
    from reference.ltx2.generate import generate as reference_generate

    cfg = load_model_variant(ENGINE_VARIANT)
    w = random_weights(cfg, seed)
    model = Ltx2Reference(cfg, ref.load_model(cfg.transformer, w["transformer"]),
                          ref_connectors(cfg.connectors, w["connectors"]), w["text_encoder"],
                          ref_vae.load_video_vae(cfg.vae, w["vae"]), ref_avae.load_audio_vae(cfg.audio_vae, w["audio_vae"]),
                          ref_voc.load_vocoder(cfg.vocoder, w["vocoder"]))
    reqs = engine_requests()
    base = f"engine-{ENGINE_VARIANT}/float32/t2va"
    checks: list[CheckResult] = []
    try:
        wants = [reference_generate(model, r) for r in reqs]
    except Exception as e:  # noqa: BLE001
        return [raised_check(f"{base}/reference", e, who="reference")]
    try:
        with planted(fault):
            engine = Engine.from_weights(cfg, w)
            programs = [engine.start_video(r) for r in reqs]       # queued together: one batch per step
            gots = [p.result() for p in programs]
    except Exception as e:  # noqa: BLE001
        return [raised_check(f"{base}/engine", e, who="engine")]
    for k, (want, got) in enumerate(zip(wants, gots)):
        prefix = f"{base}/request{k}"
        with exceptions_fail(checks, f"{prefix}/artifacts"):
            lat_ok = {}
            for m, key, ref_key in (("video", "vision", "video_latents"), ("audio", "sound", "audio_latents")):
                mt = compare(got.latents[key], want[ref_key])
                lat_ok[m] = within(mt, latent_tol)
                checks.append(CheckResult(f"{prefix}/latents_{m}", lat_ok[m], mt, latent_tol,
                                          divergence=None if lat_ok[m] else "denoise loop (engine)"))
            a, b = to_uint8_frames(want["video"][:1]).numpy(), got.frames.numpy() if hasattr(got.frames, "numpy") \
                else np.asarray(got.frames)
            sim = video_similarity(a, b, 255.0)
            diff = int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max()) if a.shape == b.shape else -1
            q = QUANTISED_BOUNDS
            ok = "shape_mismatch" not in sim and sim["ssim_min"] >= q["min_ssim"] and \
                sim["psnr_db"] >= q["min_psnr"] and 0 <= diff <= 1
            checks.append(CheckResult(
                f"{prefix}/frames", ok, None, Tolerance(min_ssim=q["min_ssim"], min_psnr=q["min_psnr"]),
                detail=f"engine uint8 frames vs the reference's quantised: SSIM min {sim['ssim_min']:.6f}, PSNR "
                       f"{fmt_db(sim['psnr_db'])} dB (data_range 255), max |diff| {diff} levels (<= 1)",
                divergence=None if ok else _stage(lat_ok["video"], False, "video vae decode", "video")))
            ref_audio = want["waveform"][0].clamp(-1, 1)
            snr = snr_db(ref_audio, torch.as_tensor(got.audio).float())
            ok = snr >= bounds["min_snr_db"]
            checks.append(CheckResult(f"{prefix}/audio", ok, None, AudioBound(bounds["min_snr_db"]),
                                      detail=f"engine waveform vs the reference's (clamped to [-1, 1]): SNR "
                                             f"{fmt_db(snr)} dB, {list(ref_audio.shape)}",
                                      divergence=None if ok else ("denoise loop (final audio latents differ)"
                                                                  if not lat_ok["audio"] else
                                                                  "audio vae decode / vocoder (final audio latents "
                                                                  "agree)")))
            progress(f"[ltx2 C4] {prefix}: frames SSIM min {sim['ssim_min']:.6f}, max |diff| {diff}, audio SNR "
                     f"{fmt_db(snr)} dB")
    return checks


def _bounds(tol: Tolerance | None) -> tuple[dict, dict]:
    got = {k: getattr(tol, k, None) if tol is not None else None for k in DEFAULT_BOUNDS}
    src = {k: "contract" if v is not None else "default (not in the contract's C4 row)" for k, v in got.items()}
    return {k: (v if v is not None else DEFAULT_BOUNDS[k]) for k, v in got.items()}, src


def run_c4(variants: list[str] | None = None, checkpoint: str | None = None, device: str = "cpu",
           dtypes: list[str] | None = None, seed: int = 0, fault: str | None = None, progress=None, **_) -> Report:
    progress = progress or (lambda msg: None)
    if fault is not None and fault not in C4_FAULTS:
        raise SetupError(f"unknown ltx2 C4 fault {fault!r}; known: {', '.join(C4_FAULTS)}")
    if checkpoint is not None or device != "cpu":
        raise SetupError("ltx2 C4 runs the tiny components on CPU (fp32) only")
    if dtypes and set(dtypes) != {"fp32"}:
        raise SetupError(f"ltx2 C4 runs fp32 only (got --dtype {', '.join(dtypes)})")
    if variants and TRANSFORMER not in variants:
        raise SetupError(f"ltx2 C4 runs the transformer variant {TRANSFORMER!r} (with its tiny VAEs and vocoder)")
    contract = load_parity_contract("ltx2")
    try:
        tol = contract.tolerance("C4", "float32", "cpu")
    except ManifestError:
        tol = None
    latent_tol = contract.tolerance("C1", "float32", "cpu")
    bounds, sources = _bounds(tol)
    report = Report("ltx2", "C4", {"variants": [TRANSFORMER], "cases": [c.name for c in CASES], "seed": seed,
                                   "fault": fault, "dtype": "float32",
                                   "thresholds": {k: {"value": v, "source": sources[k]} for k, v in bounds.items()}})
    reqs = requests()
    with tempfile.TemporaryDirectory(prefix="fvparity-ltx2-c4-") as tmp, torch.no_grad():
        for case in CASES:
            base = f"{TRANSFORMER}/float32/{case.name}"
            progress(f"[ltx2 C4] {base}: generate + decode on both sides")
            try:
                comp = components(case, seed)
            except SetupError:
                raise
            except Exception as e:  # noqa: BLE001
                report.checks.append(raised_check(base, e))
                continue
            texts = c1.prompts(comp.ccfg.caption_channels * c1.TEXT_LAYERS, seed + 3)
            try:   # a side that raises is this case's failed check, not a crash of the run
                want = reference_chain(comp, case, reqs, texts)
            except Exception as e:  # noqa: BLE001
                report.checks.append(raised_check(f"{base}/reference", e, who="reference"))
                continue
            try:
                with planted(fault):
                    got = optimized_chain(comp, case, reqs, texts)
            except Exception as e:  # noqa: BLE001
                report.checks.append(raised_check(f"{base}/optimized", e, who="optimized"))
                continue
            for k, (w, g) in enumerate(zip(want, got)):
                prefix = f"{base}/request{k}"
                with exceptions_fail(report.checks, f"{prefix}/artifacts"):
                    report.checks += artifact_checks(prefix, w, g, bounds, latent_tol, comp.ocfg.output_sampling_rate,
                                                     Path(tmp), progress)
        progress(f"[ltx2 C4] engine-{ENGINE_VARIANT}: the whole model from token ids, reference vs the served engine")
        with exceptions_fail(report.checks, f"engine-{ENGINE_VARIANT}/float32"):
            report.checks += engine_case(seed, fault, bounds, latent_tol, progress)
    return report
