"""wan C4: decoded frames end to end, reference vs engine.

Each side runs its own whole chain on the same request: generate latents (reference `WanReferencePipeline.generate`
/ the engine's `denoise` loop), then decode them (reference `WanReferencePipeline.decode`: de-normalise and the
whole-clip VAE decoder; engine: the wan entry's media chain de-normalises (optimized/models/wan/media.py) and the
chunked `vae_decode` loop runs through the engine's scheduler, 1 and 2 latent frames per chunk). Frames are
compared by SSIM and PSNR (scikit-image, [0, 1], data_range 1.0), then written as PNG with the runtime's atomic
writer on both sides, read back and compared again (uint8), each read-back checked against the tensor it came from
and for temp files left behind.

Cases per whole-model variant: the task's own request (t2v, i2v with its image, ti2v with an image, two experts),
and for ti2v the text-only request. The reference runs fp32; a bf16 run decodes the bf16 engine's latents.
Planted fault (optimized side): `inverted-latents-std` (the media chain de-normalises with z * (1 / std) + mean).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from manifests.parity import Tolerance
from parity.artifacts import fmt_db, frames01, png_frames_check, video_similarity, write_and_read_back
from parity.errors import SetupError
from parity.families.wan import faults
from parity.families.wan.common import (DEFAULT_VARIANTS, contract_tolerance, engine_decode, engine_for, make_request,
                                        reference_pipeline, resolve_models)
from parity.family import DTYPES
from parity.metrics import compare, within
from parity.report import CheckResult, Report, exceptions_fail, raised_check

DEFAULT_BOUNDS = {"min_ssim": 0.999, "min_psnr": 60.0}   # used only while the contract's C4 row lacks a field


@dataclass
class Decoded:
    """What each side hands the artifact writers (parity/artifacts.py reads .video and .audio)."""
    latents: torch.Tensor
    video: torch.Tensor                 # [1, 3, F, H, W] in [-1, 1]
    audio: None = None


def c4_cases(cfg) -> list[tuple[str, dict]]:
    own = "two_experts" if cfg.two_experts else {"t2v": "t2v", "i2v": "i2v", "ti2v": "ti2v_image"}[cfg.task]
    cases = [(own, {"seed": 41, **({"guidance_scale_2": 2.5} if cfg.two_experts else {})})]
    if cfg.task == "ti2v":
        cases.append(("ti2v_text_only", {"seed": 42, "image": False}))
    return cases


def frame_checks(prefix: str, want: Decoded, got: Decoded, bounds: dict, latent_tol: Tolerance, workdir: Path,
                 progress) -> list[CheckResult]:
    frame_tol = Tolerance(min_ssim=bounds["min_ssim"], min_psnr=bounds["min_psnr"])
    latents_agree = within(compare(got.latents, want.latents), latent_tol)
    sim = video_similarity(frames01(want.video), frames01(got.video), 1.0)
    ok = "shape_mismatch" not in sim and sim["ssim_min"] >= bounds["min_ssim"] and sim["psnr_db"] >= bounds["min_psnr"]
    c = CheckResult(f"{prefix}/frames", ok, compare((got.video + 1) / 2, (want.video + 1) / 2), frame_tol,
                    detail=f"SSIM min {sim['ssim_min']:.6f} (mean {sim['ssim_mean']:.6f}) over "
                           f"{len(sim['ssim_per_frame'])} frames {list(want.video.shape[3:])}, PSNR "
                           f"{fmt_db(sim['psnr_db'])} dB (frames in [0, 1], data_range 1.0)"
                           + (f"; {sim['shape_mismatch']}" if "shape_mismatch" in sim else ""))
    c.extra = {k: v if not (isinstance(v, float) and math.isinf(v)) else str(v) for k, v in sim.items()}
    if not ok:
        c.divergence = ("vae decode (final latents agree)" if latents_agree else
                        "denoise loop (final latents differ)") + f"; SSIM min {sim['ssim_min']:.4f}"
    progress(f"[wan C4] {prefix}: SSIM min {sim['ssim_min']:.6f}, PSNR {fmt_db(sim['psnr_db'])} dB")
    checks = [c]

    files = {side: write_and_read_back(out, workdir / prefix.replace("/", "_") / side, None)
             for side, out in (("reference", want), ("optimized", got))}
    intact = all(np.array_equal(f["frames"], f["frames_expected"]) and not f["leftovers"] for f in files.values())
    checks.append(CheckResult(f"{prefix}/artifacts_roundtrip", intact,
                              detail="PNG frames written atomically (no temp files left), read back equal to the "
                                     "quantised tensors" if intact else "a read-back PNG differs from the tensor it "
                                     "was written from, or a temp file was left behind"))
    checks.append(png_frames_check(prefix, files, bounds, frame_tol))
    return checks


def run_c4(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress: Callable[[str], None]) -> Report:
    faults.check_fault(fault, "C4", faults.C4_FAULTS)
    models = resolve_models(variants, checkpoint, seed, kinds=("model",))
    report = Report("wan", "C4", {"variants": variants or list(DEFAULT_VARIANTS), "device": device, "dtypes": dtypes,
                                  "seed": seed, "checkpoint": checkpoint, "fault": fault,
                                  "reference": "fp32 CPU (the reference pipeline's only precision)"})
    with tempfile.TemporaryDirectory(prefix="fvparity-wan-c4-") as tmp:
        for m in models:
            pipe = reference_pipeline(m)
            for dname in dtypes:
                dtype = DTYPES[dname]
                tol = contract_tolerance("C4", "frames", dname, device)
                latent_tol = contract_tolerance("C1", "loop", dname, device)
                bounds = {k: getattr(tol, k) if getattr(tol, k) is not None else v for k, v in DEFAULT_BOUNDS.items()}
                report.settings.setdefault("thresholds", {})[dname] = bounds
                engine = engine_for(m, device, dtype, seed)
                for name, kw in c4_cases(m.cfg):
                    prefix = f"{m.name}/{dname}/{name}"
                    progress(f"[wan C4] {prefix}: generate + decode on both sides")
                    req = make_request(m.cfg, **kw)
                    try:  # a side that raises is this case's failed check, not a crash of the run
                        res = pipe.generate(req)
                        want = Decoded(res.latents, pipe.decode(res.latents))
                    except Exception as e:  # noqa: BLE001
                        report.checks.append(raised_check(f"{prefix}/reference", e, who="reference"))
                        continue
                    try:
                        latents = engine.generate(req)["latents"]["vision"]
                        with faults.planted_decode(fault):
                            got = Decoded(latents, engine_decode(engine, latents))
                            got2 = engine_decode(engine, latents, chunk_frames=2)
                    except Exception as e:  # noqa: BLE001
                        report.checks.append(raised_check(f"{prefix}/engine", e, who="engine"))
                        continue
                    with exceptions_fail(report.checks, f"{prefix}/frames"):  # a comparison that raises fails too
                        report.checks += frame_checks(prefix, want, got, bounds, latent_tol, Path(tmp), progress)
                        m2 = compare(got2, got.video)
                        report.checks.append(CheckResult(f"{prefix}/decode_chunk2", within(m2, latent_tol), m2,
                                                         latent_tol, detail="engine decode, 2 latent frames per "
                                                                            "chunk, vs 1 per chunk"))
    if checkpoint is None and (fault is None or fault in faults.WORKFLOW_FAULTS) and not variants:
        report.checks += workflow_rows(fault, progress)
    if not report.checks:
        raise SetupError("no C4 case ran")
    return report


def workflow_rows(fault: str | None, progress: Callable[[str], None]) -> list[CheckResult]:
    """ComfyUI workflows compiled to programs (parity/workflow_checks.py): each example workflow against the direct
    request with its settings, latents (C1) and frames (C4) bitwise, on the tiny models written by fvconvert into a
    temporary models directory. Rows are named `workflow/<case>/...`."""
    from parity import workflow_checks

    progress("[wan C4] workflow: the example ComfyUI workflows vs the direct requests")
    checks: list[CheckResult] = []
    with exceptions_fail(checks, "workflow"), tempfile.TemporaryDirectory(prefix="fvparity-wan-workflows-") as tmp:
        for name, variant in workflow_checks.TINY_MODELS.items():
            workflow_checks.write_tiny_models(tmp, name, variant=variant)
        for c in workflow_checks.run_checks(tmp, fault if fault in faults.WORKFLOW_FAULTS else None).checks:
            checks.append(dataclasses.replace(c, name=f"workflow/{c.name}",   # a failing row names its case / check
                                              divergence=c.divergence or (None if c.passed else c.name)))
    return checks
