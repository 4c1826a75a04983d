"""cosmos3 C4: decoded artifacts end to end, reference vs engine, and the upstream golden probe `cosmos3.pipeline`.

Each side runs its own whole chain: generate latents (reference `generate` / `optimized.Engine.generate`), decode
them (reference Wan VAE + sound tokenizer through `reference.cosmos3.sound.decode_cosmos3_outputs`; the optimized
chunked `wan.vae_decode` loop + folded-weight-norm sound decoder through `optimized.models.cosmos3.sound.
decode_cosmos3_outputs`), and, for image-to-video, encode the conditioning clip with its own VAE (reference
`WanVAE.encode` + `normalize_latents`; optimized `encode_cosmos3_condition`, the chunked `wan.vae_encode` loop).
The decoded frames are compared with SSIM and PSNR (scikit-image, frames in [0, 1], `data_range` 1.0) and the
waveforms by SNR (dB); then both sides' frames and audio are written with the atomic artifact writers (PNG, WAV),
read back and compared again (uint8 / int16), and each read-back is checked against the tensor it came from.

Components and the two sides' chains: c4_setup.py. Artifact metrics and read-back: parity/artifacts.py.

Cases: text-to-video; image-to-video (a deterministic synthetic picture repeated over the clip, as the pipeline
pads it, VAE-encoded on each side; latent frame 0 conditioned); video with sound. The engine must also keep the
conditioning latent frame where the encoded image put it (upstream does not re-pin it; velocity there is 0).

Planted faults (`C4_FAULTS` in faults.py, optimized side only): `inverted-latents-std` (de-normalise with z / std + mean, the
pipeline's inv_std confused) and `swapped-stereo` (left/right channels of the decoded waveform exchanged).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from manifests import ManifestError
from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.sampling import Cosmos3GenerateRequest, UniPCConfig, latent_frames_for
from manifests.cosmos3.sound import Cosmos3SoundConfig
from manifests.parity import Tolerance, load_parity_contract
from manifests.wan import WanVAEConfig
from parity.artifacts import fmt_db, frames01, png_frames_check, snr_db, video_similarity, write_and_read_back
from parity.errors import SetupError
from parity.families.cosmos3.c4_setup import (Components, EngineSide, ReferenceSide, SideOutput, check_geometry,
                                              conditioning_clip, resolve_components, synthetic_image)
from parity.families.cosmos3.c4_setup import (c4_sound_config, c4_transformer_config,  # noqa: F401 (C4 surface)
                                              c4_vae_config, vae_random_state)
from parity.families.cosmos3.common import DEFAULT_VARIANTS
from parity.families.cosmos3.faults import C4_FAULTS, planted_c4
from parity.family import DTYPE_NAMES, DTYPES
from parity.golden import read_diffusers_dir
from parity.metrics import compare, within
from parity.report import CheckResult, Report, exceptions_fail, raised_check

STEPS = 4
NUM_FRAMES, HEIGHT, WIDTH = 9, 48, 64          # -> latent [1, 48, 3, 3, 4]
FPS = 24.0
COND_FRAME_MAX_ABS = 1e-5                      # engine: |final latent frame 0 - encoded image latent| (upstream drifts
                                               # <= 4.8e-7: it never re-pins clean frames; velocity there is 0)
# Used only while the contract's C4 row lacks the field (settings["thresholds"] says which source was used).
DEFAULT_BOUNDS = {"min_ssim": 0.999, "min_psnr": 60.0, "min_snr_db": 60.0}


@dataclass(frozen=True)
class AudioBound:
    """Bound on the waveform SNR in dB (the table prints it as `min_snr_db>=...`)."""
    min_snr_db: float


# ------------------------------------------------------------------------------------------------
# Cases and checks
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class C4Case:
    name: str
    seed: int
    image: bool = False
    sound: bool = False


CASES = (C4Case("t2v", 41), C4Case("i2v", 42, image=True), C4Case("t2v_sound", 43, sound=True))


def sound_frames_for(scfg: Cosmos3SoundConfig, num_frames: int, fps: float) -> int:
    """The pipeline's rule: ceil(int(num_frames / fps * sampling_rate) / hop)."""
    n = int(num_frames / fps * scfg.sampling_rate)
    return (n + scfg.hop - 1) // scfg.hop


def case_request(c: Components, case: C4Case, condition: torch.Tensor | None) -> Cosmos3GenerateRequest:
    g = torch.Generator().manual_seed(3000 + case.seed)
    s = c.vcfg.spatial_compression
    return Cosmos3GenerateRequest(
        text_ids=torch.randint(0, c.cfg.vocab_size, (9,), generator=g),
        negative_text_ids=torch.randint(0, c.cfg.vocab_size, (4,), generator=g),
        latent_frames=latent_frames_for(NUM_FRAMES, c.vcfg.temporal_compression), latent_height=HEIGHT // s,
        latent_width=WIDTH // s, num_steps=STEPS, guidance_scale=5.0, fps=FPS, seed=case.seed,
        scheduler=UniPCConfig(flow_shift=10.0),
        vision_condition_frames=(0,) if condition is not None else (), condition_latents=condition,
        sound_frames=sound_frames_for(c.scfg, NUM_FRAMES, FPS) if case.sound and c.scfg is not None else 0,
    ).validate(c.cfg)


def _bounds(tol: Tolerance) -> tuple[dict, dict]:
    got = {"min_ssim": tol.min_ssim, "min_psnr": tol.min_psnr, "min_snr_db": getattr(tol, "min_snr_db", None)}
    src = {k: "contract" if v is not None else "default (not in the contract's C4 row)" for k, v in got.items()}
    return {k: (v if v is not None else DEFAULT_BOUNDS[k]) for k, v in got.items()}, src


def artifact_checks(prefix: str, want: SideOutput, got: SideOutput, bounds: dict, latent_tol: Tolerance,
                    sample_rate: int | None, workdir: Path, progress) -> list[CheckResult]:
    checks: list[CheckResult] = []
    frame_tol = Tolerance(min_ssim=bounds["min_ssim"], min_psnr=bounds["min_psnr"])
    lat_ok = {m: within(compare(got.latents[m], want.latents[m]), latent_tol) for m in want.latents
              if m in got.latents}

    # ---- frames, float, before quantisation
    sim = video_similarity(frames01(want.video), frames01(got.video), 1.0)
    ok = "shape_mismatch" not in sim and sim["ssim_min"] >= bounds["min_ssim"] and sim["psnr_db"] >= bounds["min_psnr"]
    c = CheckResult(f"{prefix}/frames", ok, compare((got.video + 1) / 2, (want.video + 1) / 2), frame_tol,
                    detail=f"SSIM min {sim['ssim_min']:.6f} (mean {sim['ssim_mean']:.6f}) over "
                           f"{len(sim['ssim_per_frame'])} frames, PSNR {fmt_db(sim['psnr_db'])} dB "
                           f"(frames in [0, 1], data_range 1.0)" + (f"; {sim['shape_mismatch']}"
                                                                     if "shape_mismatch" in sim else ""))
    c.extra = {k: v if not (isinstance(v, float) and math.isinf(v)) else str(v) for k, v in sim.items()}
    if not ok:
        c.divergence = ("vae decode (final vision latents agree)" if lat_ok.get("vision")
                        else "denoise loop (final vision latents differ)") + \
            f"; SSIM min {sim['ssim_min']:.4f}, PSNR {fmt_db(sim['psnr_db'])} dB"
    checks.append(c)
    progress(f"[cosmos3 C4] {prefix}: frames SSIM min {sim['ssim_min']:.6f}, PSNR {fmt_db(sim['psnr_db'])} dB")

    # ---- audio
    if want.audio is not None or got.audio is not None:
        if want.audio is None or got.audio is None:
            checks.append(CheckResult(f"{prefix}/audio", False, detail="waveform missing on one side"))
        else:
            snr = snr_db(want.audio, got.audio)
            ok = snr >= bounds["min_snr_db"]
            c = CheckResult(f"{prefix}/audio", ok, compare(got.audio, want.audio), AudioBound(bounds["min_snr_db"]),
                            detail=f"SNR {fmt_db(snr)} dB, waveform {list(want.audio.shape)}")
            c.extra = {"snr_db": snr if math.isfinite(snr) else str(snr)}
            if not ok:
                c.divergence = ("sound decode (final sound latents agree)" if lat_ok.get("sound")
                                else "denoise loop (final sound latents differ)") + f"; SNR {fmt_db(snr)} dB"
            checks.append(c)
            progress(f"[cosmos3 C4] {prefix}: audio SNR {fmt_db(snr)} dB")

    # ---- artifacts on disk: atomic writes, read back, compared again
    files = {}
    for side, out in (("reference", want), ("optimized", got)):
        files[side] = write_and_read_back(out, workdir / prefix.replace("/", "_") / side, sample_rate)
    intact = all(np.array_equal(f["frames"], f["frames_expected"]) and not f["leftovers"]
                 and ("pcm" not in f or (np.array_equal(f["pcm"], f["pcm_expected"]) and f["rate"] == sample_rate))
                 for f in files.values())
    checks.append(CheckResult(f"{prefix}/artifacts_roundtrip", intact,
                              detail="PNG frames and WAV written atomically (no temp files left), read back equal "
                                     "to the quantised tensors" if intact else "a read-back artifact differs from "
                                     "the tensor it was written from, or a temp file was left behind"))
    checks.append(png_frames_check(prefix, files, bounds, frame_tol))
    if "pcm" in files["reference"] and "pcm" in files["optimized"]:
        pa, pb = files["reference"]["pcm"], files["optimized"]["pcm"]
        snr = snr_db(torch.from_numpy(pa.astype(np.float64)), torch.from_numpy(pb.astype(np.float64)))
        ok = snr >= bounds["min_snr_db"]
        c = CheckResult(f"{prefix}/wav", ok, None, AudioBound(bounds["min_snr_db"]),
                        divergence=None if ok else "see audio",
                        detail=f"16-bit WAV read-back: SNR {fmt_db(snr)} dB, {pa.shape[0]} channels x {pa.shape[1]}")
        c.extra = {"snr_db": snr if math.isfinite(snr) else str(snr)}
        checks.append(c)
    return checks


def condition_checks(prefix: str, ref_cond: torch.Tensor, eng_cond: torch.Tensor, eng: SideOutput,
                     component_tol: Tolerance) -> list[CheckResult]:
    m = compare(eng_cond, ref_cond)
    checks = [CheckResult(f"{prefix}/condition_latents", within(m, component_tol), m, component_tol,
                          detail="encoded image clip: optimized chunked wan.vae_encode vs reference encode, "
                                 "normalised", divergence=None if within(m, component_tol) else "vae encode")]
    drift = (eng.latents["vision"][:, :, 0] - eng_cond[:, :, 0]).abs().max().item()
    ok = drift <= COND_FRAME_MAX_ABS
    checks.append(CheckResult(f"{prefix}/condition_frame_kept", ok, compare(eng.latents["vision"][:, :, :1],
                                                                           eng_cond[:, :, :1]),
                              Tolerance(max_abs=COND_FRAME_MAX_ABS),
                              detail=f"engine: final latent frame 0 vs its encoded image latent, max |diff| "
                                     f"{drift:.1e} (<= {COND_FRAME_MAX_ABS:g}; upstream does not re-pin)"))
    return checks


# ------------------------------------------------------------------------------------------------
# C4 runner
# ------------------------------------------------------------------------------------------------

def run_c4(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress: Callable[[str], None]) -> Report:
    if fault is not None and fault not in C4_FAULTS:
        raise SetupError(f"unknown C4 fault {fault!r}; known: {', '.join(C4_FAULTS)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError("--device cuda requested but CUDA is not available")
    contract = load_parity_contract("cosmos3")
    dev = device.split(":")[0]
    report = Report("cosmos3", "C4", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                      "dtypes": dtypes, "seed": seed, "checkpoint": checkpoint, "fault": fault,
                                      "steps": STEPS, "video": [NUM_FRAMES, HEIGHT, WIDTH], "fps": FPS})
    models = resolve_components(variants, checkpoint, seed)
    if fault == "swapped-stereo":
        if all(comp.scfg is None for _, comp in models):
            raise SetupError("fault swapped-stereo needs sound; none of the variants has a sound head")
        report.settings["fault_not_applicable"] = [v for v, comp in models if comp.scfg is None]
    with tempfile.TemporaryDirectory(prefix="fvparity-c4-") as tmp:
        for vname, comp in models:
            for dname in dtypes:
                dtype = DTYPES[dname]
                try:
                    tol = contract.tolerance("C4", DTYPE_NAMES[dname], dev)
                    latent_tol = contract.tolerance("C1", DTYPE_NAMES[dname], dev)
                    component_tol = contract.tolerance("C0", DTYPE_NAMES[dname], dev)
                except ManifestError as e:
                    raise SetupError(str(e)) from None
                bounds, sources = _bounds(tol)
                report.settings.setdefault("thresholds", {})[dname] = {
                    **{k: {"value": v, "source": sources[k]} for k, v in bounds.items()},
                    "condition_frame_max_abs": COND_FRAME_MAX_ABS}
                progress(f"[cosmos3 C4] {vname} {dname}: loading transformer, VAE and sound decoder on both sides")
                reference, engine = ReferenceSide(comp, device, dtype), EngineSide(comp, device, dtype)
                rate = comp.scfg.sampling_rate if comp.scfg is not None else None
                with planted_c4(fault, engine):
                    for case in CASES:
                        if case.sound and comp.scfg is None:
                            continue
                        prefix = f"{vname}/{dname}/{case.name}"
                        progress(f"[cosmos3 C4] {prefix}: generate + decode on both sides")
                        clip = (conditioning_clip(synthetic_image(HEIGHT, WIDTH), NUM_FRAMES).to(device)
                                if case.image else None)
                        sides = {}
                        for who, side in (("reference", reference), ("engine", engine)):
                            try:  # a side that raises (e.g. NaN latents reaching the VAE) is this case's failed check
                                cond = side.encode_condition(clip) if case.image else None
                                sides[who] = cond, side.generate(case_request(comp, case, cond))
                            except Exception as e:  # noqa: BLE001
                                report.checks.append(raised_check(f"{prefix}/{who}", e, who=who))
                                break
                        if len(sides) < 2:
                            continue
                        (ref_cond, want), (eng_cond, got) = sides["reference"], sides["engine"]
                        with exceptions_fail(report.checks, f"{prefix}/artifacts"):  # a comparison that raises fails
                            if case.image:
                                report.checks += condition_checks(prefix, ref_cond, eng_cond, got, component_tol)
                            report.checks += artifact_checks(prefix, want, got, bounds, latent_tol,
                                                             rate, Path(tmp), progress)
    return report


# ------------------------------------------------------------------------------------------------
# Upstream golden probe `cosmos3.pipeline` (diffusers Cosmos3OmniPipeline, decoded output; golden/README.md)
# ------------------------------------------------------------------------------------------------

def golden_components(case) -> Components:
    """upstream/ (transformer, converted), upstream_vae/ and upstream_sound/ (diffusers names = canonical)."""
    from converters import ConversionError, convert_diffusers_dir_to_canonical_state_dict
    if case.meta.get("upstream_format") != "diffusers":
        raise SetupError(f"golden case {case.path}: upstream_format must be 'diffusers'")
    try:
        cfg, state = convert_diffusers_dir_to_canonical_state_dict(case.path / "upstream")
        vconf, vstate = read_diffusers_dir(case, "upstream_vae")
        vcfg = WanVAEConfig.from_diffusers_config(vconf)
        scfg = sstate = None
        if (case.path / "upstream_sound").is_dir():
            sconf, sstate = read_diffusers_dir(case, "upstream_sound")
            scfg = Cosmos3SoundConfig.from_diffusers_config(sconf)
    except (ConversionError, ManifestError) as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    check_geometry(cfg, vcfg, scfg)
    return Components(cfg, vcfg, scfg, state, vstate, sstate)


def golden_pipeline_request(case, cfg: Cosmos3Config, condition: torch.Tensor | None) -> Cosmos3GenerateRequest:
    """The stored pure noise, mixed with this side's own encoded conditioning where frames are conditioned
    (what the pipeline's prepare_latents does with its generator's draw)."""
    t, p = case.inputs, case.meta.get("params", {})
    try:
        cond_frames = tuple(int(f) for f in p.get("vision_condition_frames", []))
        noise = t["noise_vision"].float()
        if cond_frames:
            if condition is None:
                raise SetupError(f"golden case {case.path}: conditioned frames but no conditioning image")
            mask = torch.zeros(noise.shape[2], 1, 1)
            mask[list(cond_frames)] = 1.0
            noise = mask * condition + (1.0 - mask) * noise
        return Cosmos3GenerateRequest(
            text_ids=t["input_ids"], negative_text_ids=t["negative_input_ids"],
            latent_frames=int(p["latent_frames"]), latent_height=int(p["latent_height"]),
            latent_width=int(p["latent_width"]), num_steps=int(p["num_inference_steps"]),
            guidance_scale=float(p["guidance_scale"]), fps=float(p["fps"]), seed=None,
            scheduler=UniPCConfig(**p["scheduler"]), vision_condition_frames=cond_frames,
            condition_latents=condition if cond_frames else None, sound_frames=int(p.get("sound_frames", 0)),
            noise_vision=noise, noise_sound=t.get("noise_sound")).validate(cfg)
    except (KeyError, TypeError, ManifestError) as e:
        raise SetupError(f"golden case {case.path}: incomplete cosmos3.pipeline inputs/params ({e})") from None


def golden_pipeline_probe(case, sides) -> list[CheckResult]:
    """Both sides: encode the stored conditioning image (i2v) with their own VAE, generate, decode; compare with the
    pipeline's decoded frames (output_type "pt": [T, 3, H, W] in [0, 1]) and waveform, plus the latents on the way."""
    from parity.families.cosmos3.c1 import golden_schedule_checks  # c1 imports this module's neighbours: lazy
    comp = golden_components(case)
    tol, out = case.tolerance, case.outputs
    params = case.meta.get("params", {})
    clip = None
    if "image" in case.inputs:
        clip = conditioning_clip(case.inputs["image"].float(), int(params["num_frames"]))
    results: list[CheckResult] = []

    def chk(name, got, key):
        if key not in out:
            return
        if got is None:
            results.append(CheckResult(name, False, detail=f"no {key} produced"))
            return
        m = compare(got, out[key])
        results.append(CheckResult(name, within(m, tol), m, tol))

    for side in sides:
        name = f"{case.name}/{side}"
        s = ReferenceSide(comp) if side == "reference" else EngineSide(comp)
        cond = s.encode_condition(clip) if clip is not None else None
        chk(f"{name}:condition_latents", cond, "condition_latents")
        req = golden_pipeline_request(case, comp.cfg, cond)
        if side == "reference":
            res = s.ref.generate(s.model, req, keep_trajectory=True)
            latents = {"vision": res.vision, "sound": res.sound}
            trajectory, timesteps = res.trajectory, res.timesteps
            video, audio = s.ref_sound.decode_cosmos3_outputs(s.vae, s.sound, res.vision, res.sound)
        else:
            r = s.engine.generate(req, record_trajectory=True)
            latents, trajectory, timesteps = r["latents"], r["trajectory"], r["timesteps"]
            video, audio = s.opt_sound.decode_cosmos3_outputs(s.vae, s.sound, latents["vision"], latents.get("sound"))
        want_ts = out.get("model_timesteps")
        ok = want_ts is not None and list(timesteps) == want_ts.tolist()
        results.append(CheckResult(f"{name}:model_timesteps", ok,
                                   detail="" if ok else f"{timesteps} vs upstream "
                                                        f"{None if want_ts is None else want_ts.tolist()}"))
        results += golden_schedule_checks(name, side, req, out)
        chk(f"{name}:vision", latents.get("vision"), "latents_vision")
        if "trajectory_vision" in out:
            steps = [compare(st["vision"], out["trajectory_vision"][k]) for k, st in enumerate(trajectory)]
            bad = [k for k, m in enumerate(steps) if not within(m, tol)]
            worst = max(steps, key=lambda m: m.rel_l2)
            results.append(CheckResult(f"{name}:vision_trajectory", not bad and len(steps) ==
                                       len(out["trajectory_vision"]), worst, tol,
                                       detail=f"first divergent step {bad[0]}" if bad else f"{len(steps)} steps"))
        chk(f"{name}:sound", latents.get("sound"), "latents_sound")
        # decoded frames before uint8 quantisation, in the pipeline's "pt" layout [T, 3, H, W] in [0, 1]
        chk(f"{name}:frames", (video[0].permute(1, 0, 2, 3) + 1) / 2, "video")
        chk(f"{name}:audio", audio, "audio")
    return results


PROBES = {"cosmos3.pipeline": golden_pipeline_probe}
