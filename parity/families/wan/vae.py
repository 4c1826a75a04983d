"""wan VAE parity. C0: the Wan VAE (2.1 / 2.2) decoder and encoder, reference (whole clip) vs optimized (chunked
loops with carried conv caches), per component (every traced block) and end to end, at several chunk sizes, an
image (1 latent frame), and two requests batched in one optimized call; fp32 and bf16. Golden probes
`wan.vae_encode` and `wan.vae_decode` (upstream diffusers AutoencoderKLWan cases in golden/wan/).

The family's C0 (c0.py) runs `c0_checks` on every VAE it checks and plants these faults through faults.py (where this
module's `perturbed-weight` is the family's `vae-perturbed-weight`); `run_c0` here is the VAE-only runner (used by
cosmos3's decoder rows)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from manifests import ManifestError
from manifests.parity import load_parity_contract
from manifests.wan import WanVAEConfig, canonical_key_shapes, list_variants, load_variant
from parity.checkpoints import models_to_check
from parity.errors import SetupError
from parity.family import DTYPE_NAMES, DTYPES, Fault, golden_probe
from parity.golden import posterior_sample_seed
from parity.golden import read_diffusers_dir
from parity.localise import ChunkTrace, first_divergence
from parity.report import CheckResult, Report, tensor_check as check

import optimized.models.wan as opt
from optimized.runtime.scheduler import run_request, run_requests
import reference.wan as ref

DEFAULT_VARIANTS = ("tiny-2.1", "tiny-2.2")
FAULTS = (
    Fault("perturbed-weight", "one weight of VAE decoder stage 1 nudged", "C0", "decoder.up_blocks.1"),
    Fault("rep-context", "temporal upsample conv sees frame 0 as context (upstream's 'Rep' quirk ignored)", "C0"),
    Fault("dropped-cache", "decoder.conv_in's conv cache not carried between chunks", "C0", "decoder.conv_in"),
)
FAULT_NAMES = tuple(f.name for f in FAULTS)


def variants() -> list[str]:
    return list_variants()


# ------------------------------------------------------------------------------------------------
# Planted faults (each breaks the optimized side in one known place; the harness must FAIL and name it)
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def planted(fault: str | None, fast: opt.FastWanVAE):
    if fault is None:
        yield
        return
    if fault == "perturbed-weight":  # one weight of decoder stage 1 nudged -> first divergence decoder.up_blocks.1
        w = fast.p["decoder.up_blocks.1.resnets.0.conv1.weight"]
        saved = w.clone()
        w.view(-1)[0] += 0.5 * w.abs().max()
        try:
            yield
        finally:
            w.copy_(saved)
    elif fault == "rep-context":  # temporal upsample conv sees frame 0 as context (ignores upstream's "Rep" quirk)
        original = fast._upsample

        def upsample(x, p, temporal, first, cache, out):
            if temporal and first and x.shape[2] > 1:
                name = f"{p}.time_conv"
                cache = opt.ConvCache({**cache.frames, name: x[:, :, :1]})
            return original(x, p, temporal, first, cache, out)
        fast._upsample = upsample
        try:
            yield
        finally:
            del fast._upsample
    elif fault == "dropped-cache":  # the conv cache of decoder.conv_in is not carried between chunks
        original = fast.decode_chunk

        def decode_chunk(z, cache, first, trace=None, consume=False):
            frames = {k: v for k, v in cache.frames.items() if k != "decoder.conv_in"}
            return original(z, opt.ConvCache(frames), first, trace, consume=consume)
        fast.decode_chunk = decode_chunk
        try:
            yield
        finally:
            del fast.decode_chunk
    else:
        raise SetupError(f"unknown fault {fault!r}; known: {', '.join(FAULT_NAMES)}")


# ------------------------------------------------------------------------------------------------
# The two sides behind one adapter each
# ------------------------------------------------------------------------------------------------

def reference_decode(model: ref.WanVAE, z: torch.Tensor, trace=None) -> torch.Tensor:
    with torch.no_grad():
        return model.decode(z, trace=trace)


def optimized_decode(fast: opt.FastWanVAE, z: torch.Tensor, chunk_frames: int, trace=None) -> torch.Tensor:
    kernel = opt.WanVaeDecodeKernel(fast, trace=trace)
    return run_request(kernel, opt.DecodeRequest("c0", z, chunk_frames=chunk_frames))


def reference_encode(model: ref.WanVAE, video: torch.Tensor, trace=None):
    with torch.no_grad():
        return model.encode(video, trace=trace)


def optimized_encode(fast: opt.FastWanVAE, video: torch.Tensor, chunk_frames: int, trace=None):
    return run_request(opt.WanVaeEncodeKernel(fast, trace=trace), opt.EncodeRequest("c0", video, chunk_frames))


def _localise(ref_records: dict, opt_records: dict, tol) -> str | None:
    div = first_divergence(opt_records, ref_records, tol)
    return None if div is None else f"{div.name} (rel_l2 {div.metrics.rel_l2:.2e})"


def _component_checks(prefix: str, ref_records: dict, opt_records: dict, tol) -> list[CheckResult]:
    """One row per traced component, in the reference's order."""
    out = []
    for name, want in ref_records.items():
        if name in opt_records:
            out.append(check(f"{prefix}/{name}", opt_records[name], want, tol, divergence=name))
    return out


# ------------------------------------------------------------------------------------------------
# C0
# ------------------------------------------------------------------------------------------------

def _resolve(variants: list[str], checkpoint: str | None, seed: int):
    """(name, config, canonical state dict) per model to check: the variants with seeded random weights, or the
    one canonical checkpoint `fvconvert wan` wrote (each named variant must then equal its config)."""
    return models_to_check("wan", variants, DEFAULT_VARIANTS, checkpoint, seed, load_variant, canonical_key_shapes)


def run_c0(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress: Callable[[str], None]) -> Report:
    if fault is not None and fault not in FAULT_NAMES:
        raise SetupError(f"unknown fault {fault!r}; known: {', '.join(FAULT_NAMES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError("--device cuda requested but CUDA is not available")
    contract = load_parity_contract("wan")
    report = Report("wan", "C0", {"variants": variants or list(DEFAULT_VARIANTS), "device": device, "dtypes": dtypes,
                                  "seed": seed, "checkpoint": checkpoint, "fault": fault})
    for vname, cfg, state in _resolve(variants, checkpoint, seed):
        big = not vname.startswith("tiny")
        for dname in dtypes:
            dtype = DTYPES[dname]
            tol = contract.tolerance("C0", DTYPE_NAMES[dname], device.split(":")[0])
            progress(f"[wan C0] {vname} {dname}: loading both sides")
            model = ref.load_vae(cfg, state, device, dtype)
            fast = opt.load_fast_vae(cfg, state, device, dtype)
            with planted(fault, fast):
                report.checks += c0_checks(f"{vname}/{dname}", cfg, model, fast, tol, dtype, device, seed, big,
                                           components=dname == "fp32", progress=progress)
    return report


def c0_checks(prefix: str, cfg: WanVAEConfig, model, fast, tol, dtype, device, seed, big: bool, components: bool,
              progress) -> list[CheckResult]:
    g = torch.Generator().manual_seed(seed + 1)
    h, w = (2, 3) if big else (3, 4)
    T = 3 if big else 5
    z = torch.randn(2, cfg.z_dim, T, h, w, generator=g).to(device, dtype)
    checks: list[CheckResult] = []

    progress(f"[wan C0] {prefix}: decode {list(z.shape[1:])} whole clip vs chunks")
    ref_trace = ChunkTrace()
    want = reference_decode(model, z[:1], ref_trace)
    for n in (1, 2) if not big else (1,):
        opt_trace = ChunkTrace()
        got = optimized_decode(fast, z[:1], n, opt_trace)
        where = _localise(ref_trace.records, opt_trace.records, tol)
        checks.append(check(f"{prefix}/decode/chunk{n}", got, want, tol, where or "video only",
                            f"{T} latent frames, {n} per chunk, conv caches carried"))
        if components and n == 1:
            checks += _component_checks(f"{prefix}/decode/component", ref_trace.records, opt_trace.records, tol)

    progress(f"[wan C0] {prefix}: decode one latent frame (image); two requests batched")
    checks.append(check(f"{prefix}/decode/image", optimized_decode(fast, z[:1, :, :1], 1),
                        reference_decode(model, z[:1, :, :1]), tol))
    kernel = opt.WanVaeDecodeKernel(fast)
    both = run_requests(kernel, [opt.DecodeRequest("a", z[:1], 1), opt.DecodeRequest("b", z[1:], 1)])
    want_b = reference_decode(model, z[1:])
    checks.append(check(f"{prefix}/decode/batched_a", both[0], want, tol, detail="2 requests in one run_step"))
    checks.append(check(f"{prefix}/decode/batched_b", both[1], want_b, tol, detail="2 requests in one run_step"))

    s = cfg.spatial_compression
    frames = 5 if big else 9
    video = (torch.rand(1, cfg.pixel_channels, frames, h * s, w * s, generator=g) * 2 - 1).to(device, dtype)
    progress(f"[wan C0] {prefix}: encode {list(video.shape[1:])}")
    ref_trace = ChunkTrace()
    want_p = reference_encode(model, video, ref_trace)
    opt_trace = ChunkTrace()
    got_p = optimized_encode(fast, video, 1, opt_trace)
    where = _localise(ref_trace.records, opt_trace.records, tol)
    checks.append(check(f"{prefix}/encode/mean", got_p.mean, want_p.mean, tol, where or "outputs only"))
    checks.append(check(f"{prefix}/encode/logvar", got_p.logvar, want_p.logvar, tol, where or "outputs only"))
    if components:
        checks += _component_checks(f"{prefix}/encode/component", ref_trace.records, opt_trace.records, tol)
    if not big:
        got2 = optimized_encode(fast, video, 2)
        checks.append(check(f"{prefix}/encode/chunk2_mean", got2.mean, want_p.mean, tol))
    return checks


# ------------------------------------------------------------------------------------------------
# Upstream golden probes `wan.vae_encode`, `wan.vae_decode` (golden/wan/README.md)
# ------------------------------------------------------------------------------------------------

def _golden_setup(case):
    config, state = read_diffusers_dir(case)
    try:
        cfg = WanVAEConfig.from_diffusers_config(config)
    except ManifestError as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    return cfg, state


@golden_probe(required=("video",))
def golden_decode_probe(case, sides) -> list[CheckResult]:
    cfg, state = _golden_setup(case)
    z, want, tol = case.inputs["latents"], case.outputs["video"], case.tolerance
    results = []
    for side in sides:
        if side == "reference":
            results.append(check(f"{case.name}/reference:video", reference_decode(ref.load_vae(cfg, state), z), want, tol))
        else:
            fast = opt.load_fast_vae(cfg, state)
            for n in (1, 2):
                results.append(check(f"{case.name}/optimized:video_chunk{n}", optimized_decode(fast, z, n), want, tol))
    return results


@golden_probe(required=("posterior_mean", "posterior_std"), optional=("posterior_sample",))
def golden_encode_probe(case, sides) -> list[CheckResult]:
    """Posterior mean and std; the posterior sample only where the case stores it with its draw
    (`params.sample_seed`): a case made without a sample is complete."""
    cfg, state = _golden_setup(case)
    seed = posterior_sample_seed(case)
    video, tol = case.inputs["video"], case.tolerance
    results = []
    for side in sides:
        post = reference_encode(ref.load_vae(cfg, state), video) if side == "reference" \
            else optimized_encode(opt.load_fast_vae(cfg, state), video, 1)
        rows = [("posterior_mean", post.mean), ("posterior_std", post.std)]
        if seed is not None:
            rows.append(("posterior_sample", post.sample(torch.Generator().manual_seed(seed))))
        for name, got in rows:
            results.append(check(f"{case.name}/{side}:{name}", got, case.outputs[name], tol))
    return results


PROBES = {"wan.vae_encode": golden_encode_probe, "wan.vae_decode": golden_decode_probe}
