"""The cosmos3-sound family: cosmos3's sound tokenizer (AVAE). C0: reference vs optimized decoder, whole clip (a
batch of two at different loudness), chunked and unbatched, the optimized side's load-time weight-norm fold, and the
encoder's posterior (mean / std, the first divergent encoder layer named);
upstream golden probes `cosmos3.sound_decode`, `cosmos3.sound_encode` (golden/cosmos3_sound/).
cosmos3's own C0 and C4 reuse `run_sound_c0` and `sound_random_state`."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from manifests import ManifestError
from manifests.cosmos3.sound import Cosmos3SoundConfig, canonical_key_shapes, list_variants, load_variant
from manifests.parity import Tolerance, load_parity_contract
from parity.errors import SetupError
from parity.family import DTYPE_NAMES, DTYPES, Fault, ParityFamily, golden_probe
from parity.golden import posterior_sample_seed, read_diffusers_dir
from parity.localise import ChunkTrace, first_divergence
from parity.metrics import compare
from parity.report import CheckResult, Report, exceptions_fail, tensor_check as check
from parity.weights import random_state_dict

import optimized.models.cosmos3.sound as opt_sound
import reference.cosmos3.sound as ref_sound

DEFAULT_VARIANTS = ("tiny",)
FAULTS = (Fault("perturbed-weight", "one weight of the optimized decoder's block 1 nudged", "C0", "decoder.block.1"),
          Fault("encoder-perturbed-weight", "one weight of the optimized encoder's first downsampling conv nudged", "C0",
                "encoder.layers.2"))   # tiny: layer 1 its one ConvNeXt block, 2 the first stride conv
C0_GAINS = (1.0, 0.25)       # per-sample loudness of the C0 latents: a batch of two that must not mix
FOLD_FP32_REL_L2 = 1e-6      # fp32 fold vs the reference's weight norm (measured 0: the same fp32 ops)
FOLD_MAX_FLIPPED = 0.01      # bf16: share of folded elements allowed 1-ulp flips of the final cast (measured 0 on CPU
                             # over 16 seeds; a fold computed in bf16 moves 32-36% of them): 32x margin


# ------------------------------------------------------------------------------------------------
# cosmos3 sound decoder C0
# ------------------------------------------------------------------------------------------------

def variants() -> list[str]:
    return list_variants()


def sound_decoder_init(name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor:
    """Keeps the waveform mostly inside the [-1, 1] clamp (weight-norm g ~ 0.5)."""
    if name.endswith("weight_g"):
        return (2.0 if name == "decoder.conv2.weight_g" else 0.5) * (1 + 0.1 * r)
    if name.endswith((".alpha", ".beta")):
        return 0.3 * r
    if name.endswith("norm.weight"):
        return 1 + 0.1 * r
    if len(shape) == 1:
        return 0.1 * r
    return r / (r[0].numel() ** 0.5)


def sound_random_state(cfg: Cosmos3SoundConfig, seed: int) -> dict[str, torch.Tensor]:
    return random_state_dict(canonical_key_shapes(cfg), seed, init=sound_decoder_init)


@contextlib.contextmanager
def _planted(fault: str | None, fast):
    if fault is None or (fault == "encoder-perturbed-weight") != isinstance(fast, opt_sound.FastSoundEncoder):
        yield
        return
    if fault == "encoder-perturbed-weight":
        w = fast.w[next(p for kind, p, _ in fast.plan if kind == "down")]   # the first stride conv
    else:
        w = fast.w["decoder.block.1.conv_t1"]
    saved = w.clone()
    w.view(-1)[0] += 1e-2 * w.abs().max()
    try:
        yield
    finally:
        w.copy_(saved)


def run_sound_c0(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
                 fault: str | None, progress: Callable[[str], None]) -> Report:
    if fault is not None and fault not in FAMILY.fault_names:
        raise SetupError(f"unknown fault {fault!r}; known: {', '.join(FAMILY.fault_names)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError("--device cuda requested but CUDA is not available")
    contract = load_parity_contract("cosmos3/sound")
    report = Report("cosmos3-sound", "C0", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                            "dtypes": dtypes, "seed": seed, "fault": fault})
    if checkpoint is not None:   # a converted sound tokenizer: its own architecture and weights
        from parity.checkpoints import models_to_check
        models = models_to_check("cosmos3", variants, DEFAULT_VARIANTS, checkpoint, seed, load_variant,
                                 canonical_key_shapes)
    else:
        try:
            models = [(v, cfg, sound_random_state(cfg, seed)) for v in variants or DEFAULT_VARIANTS
                      for cfg in [load_variant(v)]]
        except ManifestError as e:
            raise SetupError(str(e)) from None
    for v, cfg, state in models:
        for dname in dtypes:
            dtype, tol = DTYPES[dname], contract.tolerance("C0", DTYPE_NAMES[dname], device.split(":")[0])
            progress(f"[cosmos3-sound C0] {v} {dname}")
            with exceptions_fail(report.checks, f"{v}/{dname}"):  # an exception fails these rows, not the run
                ref = ref_sound.load_sound_tokenizer(cfg, state, device, dtype)
                fast = opt_sound.load_fast_sound_decoder(cfg, state, device, dtype)
                T = 2 * opt_sound.halo_frames(cfg) + 5 if v.startswith("tiny") else 8
                gains = torch.tensor(C0_GAINS).view(-1, 1, 1)
                z = torch.randn(len(C0_GAINS), cfg.latent_dim, T, generator=torch.Generator().manual_seed(seed + 1))
                z = (z * gains).to(device, dtype)
                ref_trace = ChunkTrace()
                with torch.no_grad():
                    want = ref.decode(z, trace=ref_trace)
                with _planted(fault, fast):
                    got = fast.decode(z)
                    chunked = fast.decode_chunked(z, max(1, T // 3))
                    unbatched = fast.decode(z[0])
                    fold = check_weight_norm_fold(f"{v}/{dname}/weight_norm_fold", state, fast, dtype)
                div = "decoder.block.1" if fault else "decoder"
                p = f"{v}/{dname}/sound_decode"
                report.checks.append(fold)
                report.checks.append(check(f"{p}/whole", got, want, tol, div,
                                           f"{list(z.shape)} at gains {C0_GAINS} -> {list(want.shape)}, weight norm "
                                           f"folded at load"))
                report.checks.append(check(f"{p}/chunked", chunked, want, tol, div, f"{max(1, T // 3)} latent frames "
                                           f"per chunk, halo {opt_sound.halo_frames(cfg)}"))
                report.checks.append(check(f"{p}/unbatched", unbatched, want[0], tol, div, "[C, T] input"))
                if cfg.has_encoder:
                    report.checks.extend(sound_encode_checks(f"{v}/{dname}/sound_encode", cfg, state, ref, device,
                                                             dtype, tol, seed, fault))
    return report


def _reference_encoder_trace(ref, audio: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference encoder's layer outputs under canonical prefixes (forward hooks on its Sequential), computed on
    the same volume-normalised, hop-padded waveform its `encode` builds."""
    records: dict[str, torch.Tensor] = {}
    x = audio
    if ref.cfg.normalize_volume:
        x = x / (x.abs().max() + 1e-5) * 0.95
    x = torch.nn.functional.pad(x, (0, (-x.shape[-1]) % ref.cfg.hop))
    hooks = [layer.register_forward_hook(lambda _m, _i, out, name=f"encoder.layers.{j}": records.__setitem__(name, out))
             for j, layer in enumerate(ref.encoder.layers)]
    try:
        with torch.no_grad():
            records["encoder.spectrogram"] = ref.encoder.spectrogram(x)
            ref.encoder(x)
    finally:
        for h in hooks:
            h.remove()
    return {"encoder.spectrogram": records.pop("encoder.spectrogram"), **records}


def sound_encode_checks(prefix: str, cfg: Cosmos3SoundConfig, state: dict, ref, device: str, dtype: torch.dtype,
                        tol: Tolerance, seed: int, fault: str | None) -> list[CheckResult]:
    """Encoder rows: posterior mean / std of a batch of two clips at different loudness (the volume peak is the
    whole batch's: a per-sample peak fails here) with a length that needs hop padding; a failing row names the first
    encoder layer whose output diverges (both sides traced)."""
    fast = opt_sound.load_fast_sound_encoder(cfg, state, device, dtype)
    n = 3 * cfg.hop - 7
    audio = torch.randn(len(C0_GAINS), cfg.encoder_channels, n, generator=torch.Generator().manual_seed(seed + 2))
    audio = (audio * torch.tensor(C0_GAINS).view(-1, 1, 1)).clamp(-1, 1).to(device, dtype)
    with torch.no_grad():
        post = ref.encode(audio)
    fast_trace: dict[str, torch.Tensor] = {}
    with _planted(fault, fast):
        mean, std = fast.encode(audio, trace=lambda name, t: fast_trace.__setitem__(name, t.detach().clone()))
    div = first_divergence(fast_trace, _reference_encoder_trace(ref, audio), tol)
    where = div.name if div is not None else "encoder (no traced layer out of tolerance: the posterior head)"
    detail = f"{list(audio.shape)} at gains {C0_GAINS} -> {list(post.mean.shape)}, hop-padded, weight norm folded"
    return [check(f"{prefix}/posterior_mean", mean, post.mean, tol, where, detail),
            check(f"{prefix}/posterior_std", std, post.std, tol, where, detail)]


def _trace_name(layer: str) -> str:
    """A decoder conv's name at the granularity of the C0 trace (decoder.conv1, decoder.block.i, decoder)."""
    parts = layer.split(".")
    if parts[1] == "block":
        return ".".join(parts[:3])
    return layer if layer == "decoder.conv1" else "decoder"


def check_weight_norm_fold(name: str, state: dict[str, torch.Tensor], fast, dtype: torch.dtype) -> CheckResult:
    """The optimized decoder's load-time fold g * v / ||v|| of every weight-normalised conv vs the reference's
    weight_norm of the same weights at the run dtype, computed in fp32 and cast once. fp32 runs agree to rounding;
    bf16 runs may differ only by 1-ulp flips of the final cast in a few elements. A fold computed in bf16 rounds
    three more times and moves about a third of the elements while the decoded waveform stays inside the bf16
    noise (its error vs the fp32 reference is that of the clean decoder, measured over 8 seeds). Upstream and the
    reference in bf16 recompute the norm in bf16 at every forward; the optimized side promises a single rounding."""
    wants, gots, first_bad, flipped, over, share_of = [], [], None, 0, 0, {}
    for k in state:
        if not (k.startswith("decoder.") and k.endswith(".weight_v")):
            continue
        layer = k[: -len(".weight_v")]
        g, v = state[f"{layer}.weight_g"].to(dtype).float(), state[k].to(dtype).float()  # as both sides load them
        want = ref_sound.weight_norm(g, v).to(dtype).float()
        got = fast.w[layer].detach().to("cpu").float()
        if got.shape != want.shape:
            return CheckResult(name, False, compare(got, want), detail=f"{layer}: folded shape {list(got.shape)}, "
                               f"want {list(want.shape)}", divergence=_trace_name(layer))
        diff = (got - want).abs()
        if dtype == torch.float32:
            bad = compare(got, want).rel_l2 > FOLD_FP32_REL_L2
        else:
            ulp = torch.finfo(dtype).eps * want.abs().clamp_min(torch.finfo(dtype).tiny)
            n_over = int((diff > ulp * 1.01).sum())
            flipped, over = flipped + int((diff > 0).sum()), over + n_over
            share_of[layer] = float((diff > 0).float().mean())
            bad = n_over > 0
        if bad and first_bad is None:
            first_bad = layer
        wants.append(want.flatten())
        gots.append(got.flatten())
    got_all, want_all = torch.cat(gots), torch.cat(wants)
    m = compare(got_all, want_all)
    if dtype == torch.float32:
        ok = first_bad is None
        detail = f"{len(wants)} folded convs vs the reference's fp32 weight norm (rel_l2 <= {FOLD_FP32_REL_L2:g} each)"
    else:
        share = flipped / max(1, want_all.numel())
        if first_bad is None and share > FOLD_MAX_FLIPPED:
            first_bad = max(share_of, key=share_of.get)  # too many flips in all: blame the conv with the most
        ok = first_bad is None
        detail = (f"{len(wants)} folded convs vs the fp32 weight norm cast once: {share:.2%} of elements differ "
                  f"(<= {FOLD_MAX_FLIPPED:.0%}), {over} by more than 1 ulp (0 allowed)")
    if not ok:
        detail = f"{first_bad}: {detail} (a folded weight is off: a fold below fp32?)"
    tol = Tolerance(rel_l2=FOLD_FP32_REL_L2) if dtype == torch.float32 else None  # bf16: the flip rule above
    return CheckResult(name, ok, m, tol, detail=detail, divergence=None if ok else _trace_name(first_bad))


# ------------------------------------------------------------------------------------------------
# Golden probes
# ------------------------------------------------------------------------------------------------

def _sound_case(case):
    config, state = read_diffusers_dir(case)
    try:
        cfg = Cosmos3SoundConfig.from_diffusers_config(config)
    except ManifestError as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    return cfg, state


def golden_sound_decode_probe(case, sides) -> list[CheckResult]:
    cfg, state = _sound_case(case)
    z, want, tol = case.inputs["latents"], case.outputs["audio"], case.tolerance
    results = []
    for side in sides:
        if side == "reference":
            got = ref_sound.load_sound_tokenizer(cfg, state).decode(z)
            results.append(check(f"{case.name}/reference:audio", got, want, tol))
        else:
            fast = opt_sound.load_fast_sound_decoder(cfg, state)
            results.append(check(f"{case.name}/optimized:audio", fast.decode(z), want, tol))
            results.append(check(f"{case.name}/optimized:audio_chunked", fast.decode_chunked(z, 2), want, tol))
    return results


@golden_probe(required=("posterior_mean", "posterior_std"), optional=("posterior_sample",))
def golden_sound_encode_probe(case, sides) -> list[CheckResult]:
    """Both sides' posterior (mean, std) against upstream's; the posterior sample is compared only where the case
    stores it with its draw (`params.sample_seed`)."""
    cfg, state = _sound_case(case)
    seed = posterior_sample_seed(case)
    audio = case.inputs["audio"]
    results = []
    for side in sides:
        if side == "reference":
            with torch.no_grad():
                post = ref_sound.load_sound_tokenizer(cfg, state).encode(audio)
            mean, std = post.mean, post.std
            draw = (lambda g: post.sample(g))
        else:
            fast = opt_sound.load_fast_sound_encoder(cfg, state)
            mean, std = fast.encode(audio)
            draw = (lambda g: fast.sample(mean, std, g))
        rows = [("posterior_mean", mean), ("posterior_std", std)]
        if seed is not None:
            rows.append(("posterior_sample", draw(torch.Generator().manual_seed(seed))))
        for name, got in rows:
            results.append(check(f"{case.name}/{side}:{name}", got, case.outputs[name], case.tolerance, "encoder"))
    return results


PROBES = {"cosmos3.sound_decode": golden_sound_decode_probe, "cosmos3.sound_encode": golden_sound_encode_probe}
LEVELS = {"C0": run_sound_c0}

FAMILY = ParityFamily(
    name="cosmos3-sound",
    description="cosmos3's sound tokenizer (AVAE): decoder whole / chunked / unbatched, encoder posterior; both vs "
                "upstream",
    levels=LEVELS, variants=variants, default_variants=DEFAULT_VARIANTS, faults=FAULTS, golden_probes=PROBES)
