"""seedvr2 C1 (the one-step restoration loop: the DiT call's prediction and x0) and C4 (decoded frames, SSIM /
PSNR), reference vs optimized at SP world sizes 1..4."""

from __future__ import annotations

import torch

from manifests.parity import load_parity_contract
from manifests.seedvr2 import load_variant
from parity.errors import SetupError
from parity.families.seedvr2.c0 import compare_check, env_world_sizes, resolve_variants
from parity.families.seedvr2.cases import nadit_state, vae_init
from parity.families.seedvr2.faults import check_fault, planted
from parity.metrics import compare
from parity.report import CheckResult, Report, exceptions_fail
from parity.weights import random_state_dict

import optimized.models.seedvr2 as opt
import reference.seedvr2 as ref
from optimized.parallel import ParallelPlan, SPGroup
from optimized.parallel.launch import run_ranks

RESTORE_CLIP = (17, 48, 64)   # frames, height, width -> latent (5, 6, 8), token grid (5, 3, 4): 3 windows


def restore_inputs(cfg, seed: int):
    from manifests.seedvr2 import load_vae_variant, vae_key_shapes
    g = torch.Generator().manual_seed(seed)
    F_, H, W = RESTORE_CLIP
    T, h, w = (F_ - 1) // 4 + 1, H // 8, W // 8
    vae_cfg = load_vae_variant("tiny")
    vae_state = random_state_dict(vae_key_shapes(vae_cfg), seed + 7, init=vae_init)
    return vae_cfg, vae_state, (torch.rand(3, F_, H, W, generator=g) * 2 - 1, torch.randn(7, cfg.txt_in_dim, generator=g),
                                torch.randn(T, h, w, 16, generator=g), torch.randn(1, 16, T, h, w, generator=g))


def restore_worker(group: SPGroup, cfg_name: str, state, vae_state, args, fault: str | None):
    from manifests.seedvr2 import load_vae_variant
    from optimized.models.seedvr2.pipeline import RestorationLoop
    from optimized.models.seedvr2.vae import load_fast_vae
    cfg = load_variant(cfg_name)
    fast = opt.load_fast_nadit(cfg, state, parallel=ParallelPlan((("sp", group.world_size),)))
    with planted(fault, fast):
        out = RestorationLoop(fast, load_fast_vae(load_vae_variant("tiny"), vae_state), group).generate(*args)
    return {"x0_latent": out.x0_latent, "dit_vid_sample": out.dit_vid_sample, "decoded": out.decoded,
            "output_uint8": out.output_uint8}


def _frames_metrics(got_u8: torch.Tensor, want_u8: torch.Tensor) -> tuple[float, float]:
    import numpy as np
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity
    a, b = got_u8.numpy(), want_u8.numpy()
    ssim = float(np.mean([structural_similarity(x, y, channel_axis=-1, data_range=255) for x, y in zip(a, b)]))
    psnr = float("inf") if np.array_equal(a, b) else float(peak_signal_noise_ratio(b, a, data_range=255))
    return ssim, psnr


def _restore_level(level: str, variants, checkpoint, device, dtypes, seed, fault, progress, world_sizes=None):
    from reference.seedvr2.sampler import restore
    from reference.seedvr2.vae import load_vae
    check_fault(fault)
    if dtypes != ["fp32"] or device != "cpu":
        raise SetupError(f"seedvr2 {level} runs fp32 on cpu so far")
    world_sizes = list(world_sizes or env_world_sizes())
    contract = load_parity_contract("seedvr2")
    tol = contract.tolerance(level, "float32", device)
    report = Report("seedvr2", level, {"variants": variants or ["tiny-3b"], "world_sizes": world_sizes,
                                       "seed": seed, "fault": fault})
    for vname, cfg in resolve_variants(variants or ["tiny-3b"], checkpoint, seed):
        with exceptions_fail(report.checks, vname):  # an exception fails this variant's rows, not the run
            state = nadit_state(cfg, seed)
            vae_cfg, vae_state, args = restore_inputs(cfg, seed)
            progress(f"[seedvr2 {level}] {vname}: reference restoration")
            want = restore(ref.load_nadit(cfg, state), load_vae(vae_cfg, vae_state), *args)
            for ws in world_sizes:
                progress(f"[seedvr2 {level}] {vname}: optimized restoration at sp={ws}")
                got = (run_ranks(restore_worker, ws, (vname, state, vae_state, args, fault), timeout_s=300)[0]
                       if ws > 1 else restore_worker(SPGroup.single(), vname, state, vae_state, args, fault))
                name = f"{vname}/sp={ws}"
                if level == "C1":
                    for field in ("dit_vid_sample", "x0_latent"):
                        r = compare_check(f"{name}/step0/{field}", got[field], getattr(want, field), tol)
                        if not r.passed:
                            r.divergence = "the DiT call of step 0 (run fvparity C0 to localise the layer)"
                        report.checks.append(r)
                else:
                    m = compare(got["decoded"], want.decoded)
                    ssim, psnr = _frames_metrics(got["output_uint8"], want.output_uint8)
                    ok = ssim >= (tol.min_ssim or 0) and psnr >= (tol.min_psnr or 0)
                    report.checks.append(CheckResult(f"{name}/frames", ok, m, tol,
                                                     detail=f"SSIM {ssim:.6f}, PSNR {psnr:.2f} dB"))
    return report


def run_c1(variants, checkpoint, device, dtypes, seed, fault, progress, world_sizes=None) -> Report:
    return _restore_level("C1", variants, checkpoint, device, dtypes, seed, fault, progress, world_sizes)


def run_c4(variants, checkpoint, device, dtypes, seed, fault, progress, world_sizes=None) -> Report:
    return _restore_level("C4", variants, checkpoint, device, dtypes, seed, fault, progress, world_sizes)
