"""seedvr2 parity checks (reference vs optimized, and both vs the upstream goldens).

C0: window geometry (reference listings vs the goldens' listings, optimized vs reference on many grids), the
planner (every window on exactly one rank of the right world size), the full NaDiT for the 3B and 7B tiny
variants on ragged / batched / small-frame grids, each at SP world sizes 1..4 (ranks > 1 spawned on gloo),
with first-divergent-layer localisation. Golden probes seedvr2.nadit / .vae / .restore run golden/seedvr2/ (the public
upstream goldens in the project's case format).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from manifests import ManifestError
from manifests.parity import load_parity_contract
from manifests.seedvr2 import list_variants, load_variant, nadit_key_shapes
from parity.errors import SetupError, UpstreamConversionFailed
from parity.family import DTYPE_NAMES, DTYPES, Fault, ParityFamily, golden_probe
from parity.localise import first_divergence
from parity.metrics import compare, within
from parity.report import CheckResult, Report
from parity.weights import fan_in_init, random_state_dict

import optimized.models.seedvr2 as opt
import reference.seedvr2 as ref
from optimized.parallel import ParallelPlan, SPGroup
from optimized.parallel.launch import run_ranks

DEFAULT_VARIANTS = ("tiny-3b", "tiny-7b")
SUPPORTS_WORLD_SIZE = True  # fvparity --world-size
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)
ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = ROOT / "golden" / "seedvr2"  # `fvparity golden golden/seedvr2/*/`

# fault name -> (what it breaks, the canonical name the harness must report); planted at any level
FAULTS_INFO = {
    "cyclic-shift": ("shifted windows made cyclic (torch.roll) instead of clipped", "blocks.1"),
    "token-weighted-text": ("text mean over windows weighted by window token counts", "blocks.0"),
    "plan-cache-ignores-world-size": ("plan cache key without the SP world size", "blocks.0"),
    "skipped-transition": ("the layout transition into layer 1 skipped", "blocks.1"),
}
FAULTS = tuple(FAULTS_INFO)


def variants() -> list[str]:
    return list_variants()


def plant(fast, fault: str | None) -> None:
    if fault is None:
        return
    if fault not in FAULTS_INFO:
        raise SetupError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    if fault == "cyclic-shift":
        fast.faults.cyclic_shift = True
    elif fault == "token-weighted-text":
        fast.faults.token_weighted_text = True
    elif fault == "plan-cache-ignores-world-size":
        fast.plan_cache.ignore_world_size = True
    elif fault == "skipped-transition":
        fast.faults.skip_transition_at = 1


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NaDiTInputs:
    vid: torch.Tensor
    vid_shape: torch.Tensor
    txt: torch.Tensor
    txt_shape: torch.Tensor
    timestep: torch.Tensor

    def args(self, dtype: torch.dtype = torch.float32):
        return (self.vid.to(dtype), self.vid_shape, self.txt.to(dtype), self.txt_shape, self.timestep)


# (name, latent grids (T, H, W) per sample, text lengths): ragged on all axes; batched; one window per frame
# (3 windows, so a 4-rank group has an empty rank); the small-frame case.
CASES = (
    ("ragged", ((5, 24, 80),), (7,)),
    ("batch2", ((5, 6, 8), (7, 16, 24)), (4, 5)),
    ("few_windows", ((5, 6, 8),), (7,)),
)


def make_inputs(cfg, grids, text_lens, seed: int, timestep: float = 1000.0) -> NaDiTInputs:
    g = torch.Generator().manual_seed(seed)
    vids = []
    for T, H, W in grids:
        x = torch.randn(T * H * W, 32, generator=g)
        vids.append(torch.cat([x, torch.ones(T * H * W, 1)], -1))
    return NaDiTInputs(torch.cat(vids), torch.tensor(grids, dtype=torch.int64),
                       torch.randn(sum(text_lens), cfg.txt_in_dim, generator=g),
                       torch.tensor([[L] for L in text_lens], dtype=torch.int64),
                       torch.full((len(grids),), timestep))


def nadit_overrides(cfg, name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor | None:
    """Init rule for a second pass over the fan-in weights: scaled like the goldens (every block changes the
    residual clearly); None keeps the first pass's weight."""
    if name.endswith(".attn.rope.freqs"):
        n = math.prod(shape)
        if cfg.is_3b:
            return 10000.0 ** (-2 * torch.arange(n).float() / cfg.rope_axis_dim)
        return torch.linspace(1.0, cfg.pixel_rope_max_freq / 2, n) * torch.pi
    if name.endswith("_shift"):
        return 0.3 * r
    if name.endswith("_scale") or name == "vid_out_norm.weight":
        return 1 + 0.3 * r
    if name.endswith("_gate"):
        return 0.5 * r
    if ".norm_q." in name or ".norm_k." in name:
        return 1.5 + 0.3 * r
    return None


def nadit_state(cfg, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random canonical weights: fan-in weights, then the golden-like scales drawn from seed + 1."""
    shapes = nadit_key_shapes(cfg)
    return {**random_state_dict(shapes, seed),
            **random_state_dict(shapes, seed + 1, init=lambda k, shape, r: nadit_overrides(cfg, k, shape, r))}


def vae_init(name: str, shape: tuple[int, ...], r: torch.Tensor) -> torch.Tensor:
    """The restoration VAE's norms near 1; everything else fan-in."""
    if name.endswith(("norm1.weight", "norm2.weight", "group_norm.weight", "conv_norm_out.weight")):
        return 1 + 0.1 * r
    return fan_in_init(name, shape, r)


# ------------------------------------------------------------------------------------------------
# The two sides
# ------------------------------------------------------------------------------------------------

class Recorder:
    def __init__(self):
        self.records: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, t: torch.Tensor) -> None:
        self.records[name] = t.detach().float().clone()


def run_reference(model, inp: NaDiTInputs, dtype, trace=None) -> torch.Tensor:
    with torch.no_grad():
        return model(*inp.args(dtype), trace=trace).float()


def run_optimized(model, inp: NaDiTInputs, dtype, group: SPGroup | None = None, trace=None) -> torch.Tensor:
    with torch.no_grad():
        return model(*inp.args(dtype), group=group, trace=trace).float()


def sp_worker(group: SPGroup, cfg_name: str, state, inp: NaDiTInputs, dtype_name: str, fault: str | None):
    """One rank: world size 1 locally first (the same model and plan cache), then the SP run with a trace."""
    cfg = load_variant(cfg_name)
    dtype = DTYPES[dtype_name]
    fast = opt.load_fast_nadit(cfg, state, dtype=dtype, parallel=ParallelPlan((("sp", group.world_size),)))
    plant(fast, fault)
    single = run_optimized(fast, inp, dtype, SPGroup.single())
    fast.stats = type(fast.stats)()
    rec = Recorder()
    try:
        out = run_optimized(fast, inp, dtype, group, trace=rec)
        err = None
    except RuntimeError as e:
        import traceback
        out, err = None, f"{e} @ {traceback.format_exc(limit=-3)}" if os.environ.get("FVPARITY_DEBUG") else str(e)
    counts = dict(fast.last_rank_tokens)
    return {"single": single, "out": out, "error": err, "trace": rec.records if group.rank == 0 else None,
            "stats": vars(fast.stats), "bytes": group.stats["bytes_sent"], "counts": counts}


def localise(want: dict, got: dict, tol) -> str | None:
    div = first_divergence(got, want, tol)
    return None if div is None else f"{div.name} (rel_l2 {div.metrics.rel_l2:.2e})"


# ------------------------------------------------------------------------------------------------
# C0
# ------------------------------------------------------------------------------------------------

GEOMETRY_GRIDS = ((5, 12, 40), (7, 8, 12), (5, 3, 4), (21, 45, 80), (1, 64, 64), (31, 68, 120), (3, 8, 12),
                  (2, 45, 80), (9, 23, 41))


def check_geometry(fast) -> list[CheckResult]:
    out = []
    for grid in GEOMETRY_GRIDS:
        for method in ("regular", "shifted"):
            want = ref.windows(grid, (4, 3, 3), method)
            g = fast.plan_cache.get((grid,), (4, 3, 3), method, 1, cyclic_shift=fast.faults.cyclic_shift
                                    and method == "shifted").geometry
            ids_ok = True
            canon = torch.arange(grid[0] * grid[1] * grid[2]).view(grid)
            want_ids = torch.cat([canon[b[0][0]:b[0][1], b[1][0]:b[1][1], b[2][0]:b[2][1]].reshape(-1) for b in want])
            ids_ok = torch.equal(want_ids, g.token_ids) and [b for _, b in g.boxes] == want
            out.append(CheckResult(f"windows/{grid}/{method}", ids_ok,
                                   detail=f"{len(want)} windows" if ids_ok else
                                   f"optimized geometry differs from the reference ({method}; first divergence "
                                   f"blocks.{0 if method == 'regular' else 1})",
                                   divergence=None if ids_ok else f"blocks.{0 if method == 'regular' else 1}"))
    return out


def check_planner(fast, grids) -> list[CheckResult]:
    out = []
    for ws in (1, 2, 3, 4, 8):
        for layer, method in ((0, "regular"), (1, "shifted")):
            plan = fast.plan_cache.get(grids, fast.cfg.num_windows, method, ws)
            n = plan.geometry.num_windows
            owned = sorted(w for items in plan.assignment.rank_items for w in items)
            ok = plan.world_size == ws and owned == list(range(n))
            out.append(CheckResult(f"planner/sp={ws}/{method}", ok,
                                   detail=f"max/mean tokens {plan.assignment.imbalance:.3f}" if ok else
                                   f"plan for sp={plan.world_size} returned for sp={ws}",
                                   divergence=None if ok else f"blocks.{layer} ({method} layout)"))
    return out


def _compare(name, got, want, tol, where: Callable[[], str | None] | None = None) -> CheckResult:
    m = compare(got, want)
    ok = within(m, tol)
    r = CheckResult(name, ok, m, tol)
    if not ok and where is not None:
        r.divergence = where() or "outputs only (every traced layer within tolerance)"
    return r


def nadit_checks(vname: str, dname: str, cfg, state, tol, seed, world_sizes, fault, progress) -> list[CheckResult]:
    dtype = DTYPES[dname]
    reference = ref.load_nadit(cfg, state, dtype=dtype)
    checks: list[CheckResult] = []
    fast = opt.load_fast_nadit(cfg, state, dtype=dtype)
    plant(fast, fault)
    if dname == "fp32":
        checks += check_geometry(fast)
        checks += check_planner(fast, ((5, 12, 40),))
    for i, (cname, grids, text_lens) in enumerate(CASES):
        inp = make_inputs(cfg, grids, text_lens, seed + i)
        prefix = f"{vname}/{dname}/{cname}"
        progress(f"[seedvr2 C0] {prefix}: reference")
        ref_trace = Recorder()
        want = run_reference(reference, inp, dtype, trace=ref_trace)
        for ws in world_sizes:
            if ws == 1:
                rec = Recorder()
                try:
                    got = run_optimized(fast, inp, dtype, trace=rec)
                except RuntimeError as e:
                    checks.append(CheckResult(f"{prefix}/sp=1", False, detail=str(e), divergence=str(e).split(" ")[0]))
                    continue
                # single-sample traces are comparable; batched traces cover sample 0 only on the reference side
                traced = rec.records if len(grids) == 1 else {}
                checks.append(_compare(f"{prefix}/sp=1", got, want, tol,
                                       lambda: localise(ref_trace.records, traced, tol)))
                continue
            progress(f"[seedvr2 C0] {prefix}: sp={ws} on {ws} gloo ranks")
            res = run_ranks(sp_worker, ws, (vname, state, inp, dname, fault), timeout_s=300)
            errors = [(r, rr["error"]) for r, rr in enumerate(res) if rr["error"]]
            if errors:  # report the root cause: a local error beats a peer's collective failure
                errors.sort(key=lambda e: ("failed (" in e[1], e[0]))
                r, err = errors[0]
                checks.append(CheckResult(f"{prefix}/sp={ws}", False, detail=f"rank {r}: {err}",
                                          divergence=err.split(" (")[0]))
            else:
                traced = res[0]["trace"] if len(grids) == 1 else {}
                checks.append(_compare(f"{prefix}/sp={ws}", res[0]["out"], want, tol,
                                       lambda: localise(ref_trace.records, traced, tol)))
                same = all(torch.equal(rr["out"], res[0]["out"]) for rr in res)
                checks.append(CheckResult(f"{prefix}/sp={ws}/ranks_agree", same,
                                          detail="every rank returns the same full output" if same else
                                          "ranks returned different outputs"))
                checks.append(_compare(f"{prefix}/sp={ws}/vs_sp=1", res[0]["out"], res[0]["single"], tol))
    return checks


def _resolve(variants, checkpoint, seed):
    if checkpoint is not None:
        raise SetupError("seedvr2: --checkpoint is not supported yet; use fvparity golden-style checks "
                         "(fvparity golden golden/seedvr2/*/) for converted upstream weights")
    try:
        return [(v, load_variant(v)) for v in (variants or DEFAULT_VARIANTS)]
    except ManifestError as e:
        raise SetupError(str(e)) from None


def run_c0(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress: Callable[[str], None], world_sizes: list[int] | None = None) -> Report:
    if fault is not None and fault not in FAULTS_INFO:
        raise SetupError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    if device != "cpu":
        raise SetupError("seedvr2 C0 runs on cpu (gloo ranks); GPU runs go through tools/")
    world_sizes = list(world_sizes or _env_world_sizes())
    contract = load_parity_contract("seedvr2")
    report = Report("seedvr2", "C0", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                      "dtypes": dtypes, "seed": seed, "fault": fault, "world_sizes": world_sizes})
    for vname, cfg in _resolve(variants, checkpoint, seed):
        if cfg.dim > 256:
            raise SetupError(f"variant {vname!r} is a released size; C0 on CPU runs the tiny variants")
        state = nadit_state(cfg, seed)
        for dname in dtypes:
            tol = contract.tolerance("C0", DTYPE_NAMES[dname], device)
            report.checks += nadit_checks(vname, dname, cfg, state, tol, seed, world_sizes, fault, progress)
    return report


def _env_world_sizes() -> tuple[int, ...]:
    raw = os.environ.get("FVPARITY_WORLD_SIZES")
    return tuple(int(x) for x in raw.split(",")) if raw else DEFAULT_WORLD_SIZES


# ------------------------------------------------------------------------------------------------
# C1 (the one-step restoration loop) and C4 (decoded frames, SSIM / PSNR)
# ------------------------------------------------------------------------------------------------

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
    plant(fast, fault)
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
    if fault is not None and fault not in FAULTS_INFO:
        raise SetupError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    if dtypes != ["fp32"] or device != "cpu":
        raise SetupError(f"seedvr2 {level} runs fp32 on cpu so far")
    world_sizes = list(world_sizes or _env_world_sizes())
    contract = load_parity_contract("seedvr2")
    tol = contract.tolerance(level, "float32", device)
    report = Report("seedvr2", level, {"variants": variants or ["tiny-3b"], "world_sizes": world_sizes,
                                       "seed": seed, "fault": fault})
    for vname, cfg in _resolve(variants or ["tiny-3b"], checkpoint, seed):
        state = nadit_state(cfg, seed)
        vae_cfg, vae_state, args = restore_inputs(cfg, seed)
        progress(f"[seedvr2 {level}] {vname}: reference restoration")
        want = restore(ref.load_nadit(cfg, state), load_vae(vae_cfg, vae_state), *args)
        for ws in world_sizes:
            progress(f"[seedvr2 {level}] {vname}: optimized restoration at sp={ws}")
            got = run_ranks(restore_worker, ws, (vname, state, vae_state, args, fault), timeout_s=300)[0] if ws > 1 \
                else restore_worker(SPGroup.single(), vname, state, vae_state, args, fault)
            name = f"{vname}/sp={ws}"
            if level == "C1":
                for field in ("dit_vid_sample", "x0_latent"):
                    r = _compare(f"{name}/step0/{field}", got[field], getattr(want, field), tol)
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


LEVELS = {"C0": run_c0, "C1": run_c1, "C4": run_c4}


# ------------------------------------------------------------------------------------------------
# Upstream golden probes (golden/seedvr2/, made by the official SeedVR code; see golden/README.md)
# ------------------------------------------------------------------------------------------------

def _golden_weights(case, name: str, variant: str | None = None) -> tuple[object, dict[str, torch.Tensor]]:
    """(config, canonical state) of upstream/<name> through fvconvert's official_pth manifest (the DiT), or the
    VAE state as stored (its upstream names are the canonical names)."""
    from converters import ConversionError, convert_to_state_dict
    path = case.path / "upstream" / name
    if not path.is_file():
        raise SetupError(f"golden case {case.path}: missing upstream/{name}")
    if variant is None:
        return None, torch.load(path, weights_only=True, map_location="cpu")
    try:
        return convert_to_state_dict("seedvr2", case.meta["upstream_format"], path, variant=variant)
    except ConversionError as e:
        raise UpstreamConversionFailed(f"golden case {case.path}: {e}") from None


def _nadit_call(model, case, k: int | list[int], **kw) -> torch.Tensor:
    ks = [k] if isinstance(k, int) else k
    a = [torch.cat([case.inputs[f"{n}_{j}"] for j in ks]) for n in ("vid", "vid_shape", "txt", "txt_shape", "timestep")]
    with torch.no_grad():
        return model(*a, **kw).float()


@golden_probe(required=("vid_sample_3b_0", "vid_sample_3b_1", "vid_sample_7b"),
              optional=("emb_*", "txt_in_*", "vid_in_*"))
def golden_nadit_probe(case, sides) -> list[CheckResult]:
    """Each model of params.models on each call (3B: one call each, then both calls as one batch, which must equal
    the per-call outputs; 7B: both calls as one batch, as upstream ran it), prediction and stored intermediates."""
    tol, n = case.tolerance, int(case.meta["params"]["num_calls"])
    checks: list[CheckResult] = []
    for tag, spec in case.meta["params"]["models"].items():
        cfg, state = _golden_weights(case, spec["weights"], spec["variant"])
        for side in sides:
            model = ref.load_nadit(cfg, state) if side == "reference" else opt.load_fast_nadit(cfg, state)
            name = f"{case.name}/{side}:{tag}"
            if tag == "3b":  # upstream 3B mixes text q/k across a batch: its goldens are single-sample calls
                for k in range(n):
                    rec = Recorder()
                    got = _nadit_call(model, case, k, trace=rec)
                    checks.append(_compare(f"{name}/vid_sample_{k}", got, case.outputs[f"vid_sample_3b_{k}"], tol))
                    for inter in ("emb", "txt_in", "vid_in"):
                        want = case.outputs.get(f"{inter}_3b_{k}")
                        if want is not None:
                            checks.append(_compare(f"{name}/{inter}_{k}", rec.records[inter].reshape(want.shape),
                                                   want, tol))
                got = _nadit_call(model, case, list(range(n)))
                rows = [case.outputs[f"vid_sample_3b_{k}"] for k in range(n)]
                checks.append(_compare(f"{name}/batched_per_sample", got, torch.cat(rows), tol))
            else:
                got = _nadit_call(model, case, list(range(n)))
                checks.append(_compare(f"{name}/vid_sample", got, case.outputs[f"vid_sample_{tag}"], tol))
    return checks


@golden_probe(required=("moments", "posterior_mean", "posterior_std", "decoded"),
              optional=("posterior_logvar",), required_with={"posterior_noise": ("posterior_sample",)})
def golden_vae_probe(case, sides) -> list[CheckResult]:
    """Encode (raw moments, posterior mean / std; the sample only when its noise draw is stored) and decode of the
    stored posterior mean."""
    from manifests.seedvr2 import load_vae_variant
    from optimized.models.seedvr2.vae import load_fast_vae
    from reference.seedvr2.vae import load_vae
    _, state = _golden_weights(case, "upstream_weights.pth")
    cfg = load_vae_variant(case.meta["params"]["variant"])
    tol, x, out = case.tolerance, case.inputs["x"], case.outputs
    checks = []
    for side in sides:
        vae = (load_vae if side == "reference" else load_fast_vae)(cfg, state)
        with torch.no_grad():
            checks.append(_compare(f"{case.name}/{side}:moments", vae.encode_moments(x), out["moments"], tol))
            mean, std = vae.posterior(x)
            checks.append(_compare(f"{case.name}/{side}:posterior_mean", mean, out["posterior_mean"], tol))
            checks.append(_compare(f"{case.name}/{side}:posterior_std", std, out["posterior_std"], tol))
            if "posterior_noise" in case.inputs:
                checks.append(_compare(f"{case.name}/{side}:posterior_sample", mean + std * case.inputs["posterior_noise"],
                                       out["posterior_sample"], tol))
            checks.append(_compare(f"{case.name}/{side}:decoded", vae.decode(out["posterior_mean"]), out["decoded"], tol))
    return checks


@golden_probe(required=("cond_latent", "dit_vid_sample", "x0_latent", "decoded", "output_uint8"))
def golden_restore_probe(case, sides) -> list[CheckResult]:
    """The one-step restoration end to end; output_uint8 may differ by one where decoded sits on a rounding tie."""
    from manifests.seedvr2 import load_vae_variant
    from optimized.models.seedvr2.pipeline import RestorationLoop
    from optimized.models.seedvr2.vae import load_fast_vae
    from reference.seedvr2.sampler import restore
    from reference.seedvr2.vae import load_vae
    params, tol, i, o = case.meta["params"], case.tolerance, case.inputs, case.outputs
    cfg, dit_state = _golden_weights(case, "dit.pth", params["variant"])
    _, vae_state = _golden_weights(case, "vae.pth")
    vae_cfg = load_vae_variant(params["vae_variant"])
    args = (i["lq_video"], i["txt_pos"], i["noise"], i["vae_posterior_noise"])
    checks = []
    for side in sides:
        if side == "reference":
            r = restore(ref.load_nadit(cfg, dit_state), load_vae(vae_cfg, vae_state), *args)
        else:
            r = RestorationLoop(opt.load_fast_nadit(cfg, dit_state), load_fast_vae(vae_cfg, vae_state)).generate(*args)
        for name in ("cond_latent", "dit_vid_sample", "x0_latent", "decoded"):
            checks.append(_compare(f"{case.name}/{side}:{name}", getattr(r, name), o[name], tol))
        diff = (r.output_uint8.int() - o["output_uint8"].int()).abs()
        ok = diff.shape == o["output_uint8"].shape and int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
        checks.append(CheckResult(f"{case.name}/{side}:output_uint8", ok,
                                  detail=f"max |diff| {int(diff.max())}, {int((diff > 0).sum())} values off by one"))
    return checks


PROBES = {"seedvr2.nadit": golden_nadit_probe, "seedvr2.vae": golden_vae_probe, "seedvr2.restore": golden_restore_probe}

FAMILY = ParityFamily(
    name="seedvr2",
    description="NaDiT with 3D window attention, one-step restoration, window-aligned sequence parallelism",
    levels=LEVELS, variants=variants, default_variants=DEFAULT_VARIANTS,
    faults=tuple(Fault(name, what, "C0", layer) for name, (what, layer) in FAULTS_INFO.items()),
    golden_probes=PROBES, supports_world_size=SUPPORTS_WORLD_SIZE)
