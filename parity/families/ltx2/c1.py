"""ltx2 C1: the LTX2Pipeline loop (text connectors -> noise -> guided Euler steps -> de-normalised latents),
reference (one request at a time) against the optimized loop (the requests batched in one call), step by step
for both modalities; the first diverging step (`step.<i>.video` / `.audio`, or `connectors.*`) is named.

Faults (negative controls, planted on the optimized side only): `c1-no-terminal-stretch` (the schedule without
LTX's shift_terminal stretch), `c1-audio-uses-video-guidance` (the audio stream guided with the video scale).
"""

from __future__ import annotations

import dataclasses

import torch

import optimized.models.ltx2 as opt
import reference.ltx2 as ref
from manifests.ltx2 import key_shapes, load_variant
from manifests.ltx2.connectors import (
    connector_gains,
    connector_key_shapes,
    load_connectors_variant,
)
from manifests.ltx2.keys import GAINS
from manifests.ltx2.sampling import Ltx2Media, Ltx2Request, Ltx2SchedulerConfig
from manifests.parity import load_parity_contract
from optimized.models.ltx2.connectors import load_connectors as fast_connectors
from optimized.models.ltx2.pipeline import Ltx2Prompt
from optimized.models.ltx2.pipeline import generate_latents as fast_generate
from parity.localise import first_divergence
from parity.port.kit import gain_init
from parity.report import Report, exceptions_fail, tensor_check
from parity.weights import random_state_dict
from reference.ltx2.connectors import load_connectors as ref_connectors
from reference.ltx2.pipeline import generate_latents as ref_generate

# (transformer variant, connectors variant): LTX-2.0 and the 2.3 switches
PAIRS = (("tiny", "tiny"), ("tiny-2.3", "tiny-2.3"))
FAULTS = {"c1-no-terminal-stretch": "step.0.video", "c1-audio-uses-video-guidance": "step.0.audio"}
MEDIA = Ltx2Media(latent_channels=8, audio_latent_channels=2, mel_bins=16)
TEXT_LEN, TEXT_LAYERS = 8, 3


def requests() -> list[Ltx2Request]:
    """Two requests of one shape, different seeds, scales and rescale (one with rescale off)."""
    base = {"height": 64, "width": 64, "num_frames": 9, "frame_rate": 24.0, "num_inference_steps": 3}
    return [Ltx2Request(**base, guidance_scale=3.0, audio_guidance_scale=7.0, guidance_rescale=0.7,
                        audio_guidance_rescale=0.7, seed=5),
            Ltx2Request(**base, guidance_scale=2.0, audio_guidance_scale=4.0, guidance_rescale=0.0,
                        audio_guidance_rescale=None, seed=9)]


def prompts(width: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for pad in (0, 3):                                  # the second prompt left-padded (Gemma's side)
        mask = torch.ones(1, TEXT_LEN, dtype=torch.int64)
        mask[:, :pad] = 0
        neg = torch.ones(1, TEXT_LEN, dtype=torch.int64)
        neg[:, :5] = 0
        out.append((torch.randn(1, TEXT_LEN, width, generator=g), mask, torch.randn(1, TEXT_LEN, width, generator=g),
                    neg))
    return out


def stats(cfg, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 2)
    return {"video_mean": 0.2 * torch.randn(cfg.in_channels, generator=g),
            "video_std": 1 + 0.3 * torch.rand(cfg.in_channels, generator=g),
            "audio_mean": 0.2 * torch.randn(cfg.audio_in_channels, generator=g),
            "audio_std": 1 + 0.3 * torch.rand(cfg.audio_in_channels, generator=g)}


def run_c1(variants: list[str] | None = None, checkpoint: str | None = None, device: str = "cpu",
           dtypes: list[str] | None = None, seed: int = 0, fault: str | None = None, progress=None, **_) -> Report:
    progress = progress or (lambda msg: None)
    report = Report("ltx2", "C1", {"variants": variants, "seed": seed, "fault": fault})
    tol = load_parity_contract("ltx2").tolerance("C1", "float32", device)
    pairs = [p for p in PAIRS if not variants or p[0] in variants]
    for tvar, cvar in pairs:
        tcfg, ccfg = load_variant(tvar), load_connectors_variant(cvar)
        tstate = random_state_dict(key_shapes(tcfg), seed, gain_init(GAINS))
        cstate = random_state_dict(connector_key_shapes(ccfg), seed + 1, gain_init(connector_gains(ccfg)))
        st, reqs = stats(tcfg, seed), requests()
        texts = prompts(ccfg.caption_channels * TEXT_LAYERS, seed + 3)
        sched = Ltx2SchedulerConfig()
        check = f"{tvar}/float32/loop"
        progress(f"[ltx2 C1] {check}")
        with exceptions_fail(report.checks, check), torch.no_grad():
            rt, rc = ref.load_model(tcfg, tstate), ref_connectors(ccfg, cstate)
            want_trace: dict[str, torch.Tensor] = {}
            wants = []
            for n, (r, (e, m, ne, nm)) in enumerate(zip(reqs, texts)):    # the reference: one request at a time
                trace: dict[str, torch.Tensor] = {}
                wants.append(ref_generate(rt, rc, r, e, m, ne, nm, st, MEDIA, sched, trace=trace.__setitem__))
                for k, v in trace.items():
                    want_trace.setdefault(k, []).append(v)
            want_trace = {k: torch.cat(v) for k, v in want_trace.items() if k.startswith("step.")}
            fast_reqs, fast_sched = reqs, sched
            if fault == "c1-no-terminal-stretch":
                fast_sched = dataclasses.replace(sched, shift_terminal=None)
            if fault == "c1-audio-uses-video-guidance":
                fast_reqs = [dataclasses.replace(r, audio_guidance_scale=r.guidance_scale) for r in reqs]
            got_trace: dict[str, torch.Tensor] = {}
            video, audio = fast_generate(opt.load_model(tcfg, tstate), fast_connectors(ccfg, cstate), fast_reqs,
                                         [Ltx2Prompt(*t) for t in texts], st, MEDIA, fast_sched,
                                         trace=got_trace.__setitem__)
            div = first_divergence(got_trace, want_trace, tol)
            name = div.name if div else None
            report.checks.append(tensor_check(check + ".video", video, torch.cat([w[0] for w in wants]), tol, name,
                                              detail=f"{len(reqs)} requests batched, {len(want_trace)} steps traced"))
            report.checks.append(tensor_check(check + ".audio", audio, torch.cat([w[1] for w in wants]), tol, name))
    return report
