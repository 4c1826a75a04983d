"""cosmos3 C0: packing / position ids, one decoder layer, full forward (the cases below, tiny and tiny-edge, fp32 and
bf16), several requests batched in one optimized call, the und-stream cache, and the decoders (Wan2.2-geometry VAE,
sound decoder, through the wan and cosmos3-sound families). Golden probe `cosmos3.transformer`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from manifests import ManifestError
from manifests.cosmos3 import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs, Cosmos3Prediction
from manifests.parity import load_parity_contract
from parity.errors import SetupError
from parity.families.cosmos3 import faults as fault_lib
from parity.families.cosmos3.common import (DEFAULT_VARIANTS, cast_inputs, compare_predictions, load_optimized,
                                            load_reference, resolve_models, run_optimized, run_reference)
from parity.family import DTYPE_NAMES, DTYPES
from parity.localise import TraceRecorder, first_divergence
from parity.metrics import compare, exact, within
from parity.report import CheckResult, Report

import optimized.models.cosmos3 as opt
import reference.cosmos3 as ref


# ------------------------------------------------------------------------------------------------
# Inputs: the C0 cases. Every case is one packed sample (one CFG branch).
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CaseSpec:
    name: str
    text_len: int
    vision: tuple[int, int, int]        # latent (T, H, W)
    cond_frames: tuple[int, ...] = ()
    fps: float = 24.0
    timestep: float = 937
    sound_frames: int = 0               # 0 = no sound
    action_rows: int = 0                # 0 = no action
    action_cond: tuple[int, ...] = ()
    domain: int = 1


CASES = (
    CaseSpec("t2v", 9, (3, 4, 6)),
    CaseSpec("i2v_sound_action", 11, (3, 4, 6), cond_frames=(0,), sound_frames=7, action_rows=4,
             action_cond=(0, 1), domain=2),
    CaseSpec("odd_hw_fps30", 6, (2, 5, 7), fps=30.0, timestep=500, action_rows=3),
    CaseSpec("image", 5, (1, 4, 4), timestep=999, sound_frames=3),
    CaseSpec("all_frames_cond", 7, (2, 4, 4), cond_frames=(0, 1), action_rows=2, action_cond=(0, 1)),
)


def make_inputs(cfg: Cosmos3Config, case: CaseSpec, seed: int) -> Cosmos3ForwardInputs:
    g = torch.Generator().manual_seed(seed)
    T, H, W = case.vision
    sound = action = None
    if case.sound_frames and cfg.has_sound:
        sound = torch.randn(cfg.sound_dim, case.sound_frames, generator=g)
    if case.action_rows and cfg.has_action:
        action = torch.randn(case.action_rows, cfg.action_dim, generator=g)
    return Cosmos3ForwardInputs(
        text_ids=torch.randint(0, cfg.vocab_size, (case.text_len,), generator=g),
        vision_latents=torch.randn(1, cfg.latent_channels, T, H, W, generator=g),
        timestep=case.timestep, fps_vision=case.fps, vision_condition_frames=case.cond_frames,
        sound_latents=sound, fps_sound=cfg.sound_latent_fps if sound is not None else None,
        action_latents=action, action_condition_rows=case.action_cond if action is not None else (),
        action_domain_id=min(case.domain, cfg.num_embodiment_domains - 1) if action is not None else None,
    ).validate(cfg)


def run_c0(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress: Callable[[str], None]) -> Report:
    if fault is not None and fault not in fault_lib.COSMOS3_FAULTS:
        raise SetupError(f"unknown C0 fault {fault!r}; known: {', '.join(fault_lib.COSMOS3_FAULTS)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SetupError("--device cuda requested but CUDA is not available")
    contract = load_parity_contract("cosmos3")
    report = Report("cosmos3", "C0", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                      "dtypes": dtypes, "seed": seed, "checkpoint": checkpoint, "fault": fault})
    for vname, cfg, state in resolve_models(variants, checkpoint, seed):
        for dname in dtypes:
            dtype = DTYPES[dname]
            tol = contract.tolerance("C0", DTYPE_NAMES[dname], device.split(":")[0])
            progress(f"[cosmos3 C0] {vname} {dname}: loading both sides")
            reference = load_reference(cfg, state, device, dtype)
            fast = load_optimized(cfg, state, device, dtype)
            with fault_lib.planted(fault, fast, cfg):
                report.checks += c0_checks(vname, dname, cfg, reference, fast, tol, dtype, seed, progress)
    if checkpoint is None and fault is None:  # cosmos3's decoders: the Wan2.2 VAE and the sound decoder
        report.checks += decoder_checks(device, dtypes, seed, progress)
    return report


def decoder_checks(device: str, dtypes: list[str], seed: int, progress) -> list[CheckResult]:
    """C0 of cosmos3's video VAE (Wan2.2 geometry, tiny) and sound decoder, as their own families check them."""
    from parity.families.cosmos3_sound import run_sound_c0
    from parity.families.wan.vae import run_c0 as run_wan_vae_c0

    checks = []
    for prefix, run in (("vae", lambda: run_wan_vae_c0(["tiny-2.2"], None, device, dtypes, seed, None, progress)),
                        ("sound", lambda: run_sound_c0(["tiny"], None, device, dtypes, seed, None, progress))):
        for c in run().checks:
            c.name = f"{prefix}/{c.name}"
            checks.append(c)
    return checks


def c0_checks(vname: str, dname: str, cfg: Cosmos3Config, reference, fast, tol, dtype, seed,
              progress) -> list[CheckResult]:
    checks: list[CheckResult] = []
    cases = [(c, cast_inputs(make_inputs(cfg, c, seed + i), dtype)) for i, c in enumerate(CASES)]
    prefix = f"{vname}/{dname}"

    if dname == "fp32":  # packing is dtype-independent: check it once per variant
        for case, inp in cases:
            checks.append(check_packing(f"{vname}/packing/{case.name}", cfg, inp))

    progress(f"[cosmos3 C0] {prefix}: one decoder layer")
    checks.append(check_one_layer(f"{prefix}/layer0", cfg, reference, fast, cases[1][1], tol))

    progress(f"[cosmos3 C0] {prefix}: full forward, {len(cases)} cases")
    want = {}
    for case, inp in cases:
        want[case.name] = run_reference(reference, inp)
        fast.und_cache.clear()
        got = run_optimized(fast, [inp])[0]
        checks += compare_predictions(f"{prefix}/forward/{case.name}", got, want[case.name], tol,
                                      localise=lambda inp=inp: localise(reference, fast, inp, tol))

    progress(f"[cosmos3 C0] {prefix}: {len(cases)} requests batched in one optimized call")
    fast.und_cache.clear()
    batched = run_optimized(fast, [inp for _, inp in cases])
    for (case, inp), got in zip(cases, batched):
        checks += compare_predictions(f"{prefix}/batched/{case.name}", got, want[case.name], tol)

    checks += check_und_cache(f"{prefix}/und_cache", cfg, reference, fast, cases[1][1], tol, seed)
    return checks


def localise(reference, fast, inp: Cosmos3ForwardInputs, tol) -> str | None:
    """Trace both sides by canonical name and return the first divergent one."""
    ref_trace, opt_trace = TraceRecorder(), TraceRecorder(sample=0)
    run_reference(reference, inp, trace=ref_trace)
    fast.und_cache.clear()  # a recompute, so the und layers are traced too
    run_optimized(fast, [inp], trace=opt_trace)
    div = first_divergence(opt_trace.records, ref_trace.records, tol)
    return None if div is None else f"{div.name} (rel_l2 {div.metrics.rel_l2:.2e})"


def check_packing(name: str, cfg: Cosmos3Config, inp: Cosmos3ForwardInputs) -> CheckResult:
    want = ref.pack_sample(cfg, inp)
    got = opt.pack_layout(cfg, inp)
    for field in ("position_ids", "vision_sequence_indexes", "vision_mse_loss_indexes", "sound_sequence_indexes",
                  "sound_mse_loss_indexes", "action_sequence_indexes", "action_mse_loss_indexes"):
        a, b = getattr(got, field), getattr(want, field)
        if (a is None) != (b is None) or (a is not None and not exact(a, b)):
            return CheckResult(name, False, detail=f"{field} differs")
    return CheckResult(name, True, detail="position ids and token indexes identical")


def check_one_layer(name: str, cfg: Cosmos3Config, reference, fast, inp, tol) -> CheckResult:
    """Layer 0 alone, fed the same hidden states and rope tables on both sides."""
    ref_trace = TraceRecorder()
    run_reference(reference, inp, trace=ref_trace)
    n = inp.text_ids.numel()
    hidden = ref_trace.records["embed"]
    packed = ref.pack_sample(cfg, inp)
    und_want, gen_want = ref.run_layer(reference, 0, hidden[:n], hidden[n:], packed.position_ids)
    und_got, gen_got = opt.run_layer(fast, 0, hidden[:n], hidden[n:], packed.position_ids)
    m_u, m_g = compare(und_got, und_want), compare(gen_got, gen_want)
    worst = m_g if m_g.rel_l2 >= m_u.rel_l2 else m_u
    ok = within(m_u, tol) and within(m_g, tol)
    div = None if ok else ("layers.0.und" if not within(m_u, tol) else "layers.0.gen")
    return CheckResult(name, ok, worst, tol, detail="und and gen streams of layer 0", divergence=div)


def check_und_cache(name: str, cfg: Cosmos3Config, reference, fast, inp, tol, seed) -> list[CheckResult]:
    """The cached und stream must equal a recompute; a second step with the same prompt must hit and skip
    the und pathway; a different prompt must miss."""
    want = run_reference(reference, inp)
    fast.und_cache.clear()
    first = run_optimized(fast, [inp])[0]
    misses, und_layers = fast.und_cache.misses, fast.stats.und_layers_run
    step2 = replace(inp, timestep=inp.timestep - 100, vision_latents=inp.vision_latents * 0.9)
    want2 = run_reference(reference, step2)
    second = run_optimized(fast, [step2])[0]
    hit = fast.und_cache.hits >= 1 and fast.und_cache.misses == misses and fast.stats.und_layers_run == und_layers
    results = compare_predictions(f"{name}/miss", first, want, tol)
    results += compare_predictions(f"{name}/hit", second, want2, tol)
    results.append(CheckResult(f"{name}/hit_skips_und", hit,
                               detail="second step with the same prompt hit the cache and ran no und layer"
                               if hit else "expected a cache hit with no und layer run"))
    other = replace(step2, text_ids=(inp.text_ids + 1) % cfg.vocab_size)
    want3 = run_reference(reference, other)
    before = fast.und_cache.misses
    third = run_optimized(fast, [other])[0]
    results += compare_predictions(f"{name}/new_prompt", third, want3, tol)
    results.append(CheckResult(f"{name}/new_prompt_misses", fast.und_cache.misses == before + 1,
                               detail="a changed prompt must miss the cache"))
    return results


# ------------------------------------------------------------------------------------------------
# Upstream golden probe `cosmos3.transformer` (format in golden/README.md)
# ------------------------------------------------------------------------------------------------

PACKING_OUTPUTS = ("position_ids", "vision_sequence_indexes", "vision_mse_loss_indexes", "sound_sequence_indexes",
                   "sound_mse_loss_indexes", "action_sequence_indexes", "action_mse_loss_indexes")


def golden_inputs(case) -> Cosmos3ForwardInputs:
    t, p = case.inputs, case.meta.get("params", {})
    if "timestep" not in p or "fps_vision" not in p:
        raise SetupError(f"golden case {case.path}: params must give timestep and fps_vision")
    as_tuple = lambda name: tuple(int(x) for x in t[name].tolist()) if name in t else ()
    try:
        return Cosmos3ForwardInputs(
            text_ids=t["input_ids"], vision_latents=t["vision_latents"], timestep=p["timestep"],
            fps_vision=float(p["fps_vision"]), vision_condition_frames=as_tuple("vision_condition_frames"),
            sound_latents=t.get("sound_latents"), fps_sound=p.get("fps_sound"),
            action_latents=t.get("action_latents"), action_condition_rows=as_tuple("action_condition_rows"),
            action_domain_id=int(t["action_domain_id"]) if "action_domain_id" in t else None)
    except KeyError as e:
        raise SetupError(f"golden case {case.path}: inputs.safetensors lacks {e}") from None


def golden_transformer_probe(case, sides) -> list[CheckResult]:
    from converters import ConversionError, convert_to_state_dict

    try:  # any upstream format fvconvert knows (diffusers, diffusers-raw, framework, ...)
        cfg, state = convert_to_state_dict("cosmos3", case.meta["upstream_format"], case.path / "upstream")
        inp = golden_inputs(case).validate(cfg)
    except (ConversionError, ManifestError) as e:
        raise SetupError(f"golden case {case.path}: {e}") from None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case.meta["dtype"]]
    tol = case.tolerance
    results: list[CheckResult] = []
    upstream = Cosmos3Prediction(vision=case.outputs["pred_vision"], sound=case.outputs.get("pred_sound"),
                                 action=case.outputs.get("pred_action"))
    for side in sides:
        name = f"{case.name}/{side}"
        if side == "reference":
            layout = ref.pack_sample(cfg, inp)
            pred = run_reference(load_reference(cfg, state, "cpu", dtype), cast_inputs(inp, dtype))
        else:
            layout = opt.pack_layout(cfg, inp)
            pred = run_optimized(load_optimized(cfg, state, "cpu", dtype), [cast_inputs(inp, dtype)])[0]
        for field in PACKING_OUTPUTS:
            if field not in case.outputs:
                continue
            mine = getattr(layout, field)
            ok = mine is not None and exact(mine, case.outputs[field])
            results.append(CheckResult(f"{name}:{field}", ok, detail="" if ok else f"{field} differs from upstream"))
        results += compare_predictions(name, pred, upstream, tol)
    return results


PROBES = {"cosmos3.transformer": golden_transformer_probe}
