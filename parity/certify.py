"""`fvparity certify FAMILY --accel NAME[:knobs]`: what an acceleration costs, as a certificate (JSON).

One process runs the exact and the accelerated ENGINE paths (optimized WanDenoiseLoop through the work-unit scheduler,
every request of a side batched in one run, timed in the same process) on the contract's request set, and writes:

    label, exact (the kind's declaration), requests (the set, `placeholder` true when it is not the trained model's
    held-out set), speed-up (wall ratio exact / accelerated, and from the AccelDecision rows: the fraction of DiT
    block-forwards and of attention (query, key) pairs not computed), quality (PSNR / SSIM of the accelerated output
    against the exact output of the same request and seed), adherence change (trained model only), the C3
    distribution test (accelerated samples on a DISJOINT seed block vs the exact ones: p-value and the detectable
    effect at this K), C1 under the acceleration (engine decisions and latents vs the reference loop's), the declared
    budget, pass / fail and every reason.

Pass rules. Every acceleration: C1 under it passes (the engine does what the readable rule says: a cache that never
refreshes, a residual read by the wrong CFG branch, a sparse mask missing its diagonal tile each fail here, named by
step and branch). An exact kind: the accelerated output equals the exact output within C1's loop tolerance. A lossy
kind: PSNR >= budget.min_psnr_db, SSIM >= budget.min_ssim, adherence drop <= budget.max_adherence_drop (when
measured), C3 does not reject at budget.c3_alpha.

Without --checkpoint the request set is a placeholder (the tiny random variant, random token ids, quality on latents
scaled by the exact latents' range): its numbers say the machinery works, not what the acceleration costs on a real
model (random weights have no step-to-step redundancy). With --checkpoint DIR (a canonical wan model directory, e.g.
the trained golden/trained/wan_shapes) the set is parity.quality.HELD_OUT, latents are decoded by the reference VAE,
quality is on frames and adherence is scored.

Exit codes: 0 certificate passed, 1 it failed (written all the same), 2 bad input (one line), 3 a bug.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from manifests.accel import AccelBudget, AccelSpec, AccelSpecError, parse_accel

CERT_SCHEMA = "fvparity.accel_certificate/1"
FAULTS = ("never_refresh", "wrong_branch", "drop_diagonal")   # negative controls (planted in the engine only)
PLACEHOLDER_SEEDS = (0, 1, 2, 3)
PLACEHOLDER_STEPS = 8
C3_PERMUTATIONS = 200


class CertifyError(ValueError):
    """Bad input to certify (exit 2)."""


@dataclass
class Certificate:
    schema: str
    family: str
    label: str
    exact: bool
    checkpoint: str | None
    requests: dict                       # {"set", "placeholder", "k", "steps", "guidance", ...}
    speedup: dict                        # wall ratio + skipped fractions from the decisions
    quality: dict                        # PSNR / SSIM vs exact, per request and worst
    adherence: dict | None
    c3: dict | None
    c1: dict
    budget: dict
    fault: str | None
    passed: bool
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_budget(text: str | None) -> AccelBudget:
    """`min_psnr_db=30,min_ssim=0.9,max_adherence_drop=0.02,c3_alpha=0.01` (any subset) -> AccelBudget."""
    if not text:
        return AccelBudget()
    names = {f.name for f in fields(AccelBudget)}
    given: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        k, eq, v = item.partition("=")
        k = k.strip()
        if not eq or k not in names:
            raise CertifyError(f"--budget: expected name=value with name one of {', '.join(sorted(names))}, got "
                               f"{item!r}")
        try:
            given[k] = float(v)
        except ValueError:
            raise CertifyError(f"--budget: {k} must be a number, got {v!r}") from None
        if not math.isfinite(given[k]):
            raise CertifyError(f"--budget: {k} must be finite")
    return AccelBudget(**given)


@contextmanager
def planted(fault: str | None) -> Iterator[None]:
    """One engine fault for the duration: the caches' faults (parity.accel_checks) or the sparse mask's."""
    with ExitStack() as stack:
        if fault in ("never_refresh", "wrong_branch"):
            from parity.accel_rows import planted as cache_fault
            stack.enter_context(cache_fault(fault))
        elif fault == "drop_diagonal":
            from optimized.accel.sparse import planted as sparse_fault
            stack.enter_context(sparse_fault(fault))
        elif fault is not None:
            raise CertifyError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        yield


# ---------------------------------------------------------------------------------------------- the request set

@dataclass
class RequestSet:
    name: str
    placeholder: bool
    cfg: Any                             # WanModelConfig
    weights: dict
    requests: list                       # WanGenerateRequest, accel None (the exact side)
    disjoint: list                       # the same prompts on another seed block (C3's accelerated side)
    captions: list[str | None]
    decode: Any = None                   # latents [1, C, F, h, w] -> uint8 frames [F, H, W, 3] (trained model only)


def placeholder_set(seeds=PLACEHOLDER_SEEDS, steps: int = PLACEHOLDER_STEPS, variant: str = "tiny-2.1-t2v"
                    ) -> RequestSet:
    from manifests.wan import load_model_variant
    from optimized.models.wan.instance import WanModelInstance
    from parity.accel_checks import default_request
    cfg = load_model_variant(variant)
    weights = WanModelInstance.random_weights(cfg, 0)
    reqs = [default_request(cfg, None, steps, s) for s in seeds]
    off = max(seeds) + 1
    disjoint = [default_request(cfg, None, steps, s + off) for s in seeds]
    return RequestSet(f"placeholder: {variant} random weights, seeds {list(seeds)}", True, cfg, weights, reqs,
                      disjoint, [None] * len(reqs))


def held_out_set(checkpoint: Path, limit: int | None = None, steps: int | None = None) -> RequestSet:
    """The HELD_OUT captions at the evaluation settings (parity.quality.evaluate; `steps` overrides its STEPS)."""
    from manifests.checkpoint import CheckpointError, load_state, read_checkpoint
    from optimized.runtime.artifacts import to_uint8_frames
    from parity.quality import HELD_OUT
    from parity.quality.evaluate import FRAMES, GUIDANCE, SIZE, STEPS
    from reference.wan.pipeline import WanReferencePipeline
    from reference.wan.processor import WanProcessor
    try:
        ckpt = read_checkpoint(checkpoint)
        cfg = ckpt.typed_config()
        weights = {n: load_state(ckpt, component=n) for n in ckpt.components}
    except CheckpointError as e:
        raise CertifyError(str(e)) from None
    if ckpt.family != "wan" or "tokenizer" not in ckpt.assets:
        raise CertifyError(f"{checkpoint}: not a wan model directory with a tokenizer")
    proc = WanProcessor(ckpt.assets["tokenizer"])
    chosen = list(HELD_OUT)[:limit] if limit else list(HELD_OUT)

    def build(caption: str, seed: int):
        return proc.build_request(caption, None, None, num_frames=FRAMES, height=SIZE[0], width=SIZE[1],
                                  steps=steps or STEPS, guidance=GUIDANCE, seed=seed)

    ref = WanReferencePipeline(cfg, weights)

    def decode(latents: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return to_uint8_frames(ref.decode(latents)).numpy()

    return RequestSet(f"parity.quality.HELD_OUT ({len(chosen)} captions)", False, cfg, weights,
                      [build(r.caption, r.seed) for r in chosen],
                      [build(r.caption, r.seed + 100_000) for r in chosen], [r.caption for r in chosen], decode)


# ---------------------------------------------------------------------------------------------- engine runs

def _with_accel(req, spec: AccelSpec | None):
    import dataclasses
    return dataclasses.replace(req, accel=spec)


def run_engine(rs: RequestSet, requests: list, spec: AccelSpec | None) -> tuple[list[dict], float]:
    """Every request under `spec` (None: the exact path) batched through one WanDenoiseLoop; (results, wall s)."""
    from optimized.models.wan.denoise import WanDenoiseJob, WanDenoiseLoop
    from optimized.models.wan.instance import WanModelInstance
    from optimized.runtime.scheduler import RequestRejected, WorkUnitScheduler
    loop = WanDenoiseLoop(WanModelInstance(rs.cfg, rs.weights, weights_version="certify"))
    sched = WorkUnitScheduler()
    t0 = time.perf_counter()
    try:
        handles = [sched.submit(loop, WanDenoiseJob(_with_accel(r, spec))) for r in requests]
    except RequestRejected as e:
        raise CertifyError(str(e)) from None
    with torch.no_grad():
        while not sched.idle:
            sched.tick()
    wall = time.perf_counter() - t0
    bad = [h for h in handles if h.status != "completed"]
    if bad:
        raise CertifyError(f"the engine refused the request: {bad[0].error}")
    return [h.result for h in handles], wall


def skipped_fractions(results: list[dict], cfg, latent_shape) -> dict:
    """From the AccelDecision rows: DiT block-forwards not run (reused / predicted / CFG branch skipped) over those
    the exact path runs, and attention (query, key) pairs not computed over the dense count."""
    L, heads = cfg.dit.num_layers, cfg.dit.num_heads
    pt, ph, pw = cfg.dit.patch_size
    _, _, f, h, w = latent_shape
    tokens = (f // pt) * (h // ph) * (w // pw)
    run = total = skipped_pairs = 0
    for res in results:
        for d in res.get("accel", {}).get("decisions", []):
            total += L
            if d.action == "compute":
                run += L if d.blocks_computed is None else d.blocks_computed[1] - d.blocks_computed[0]
            elif d.action == "reuse":
                run += L - (d.blocks_reused[1] - d.blocks_reused[0]) if d.blocks_reused else \
                    (d.blocks_computed[1] - d.blocks_computed[0] if d.blocks_computed else 0)
            skipped_pairs += d.keys_skipped
    dense_pairs = total * heads * tokens * tokens
    return {"decision_rows": sum(len(r.get("accel", {}).get("decisions", [])) for r in results),
            "block_forwards_total": total, "block_forwards_run": run,
            "block_forwards_skipped_fraction": 1 - run / total if total else 0.0,
            "attention_pairs_skipped": skipped_pairs,
            "attention_pairs_skipped_fraction": skipped_pairs / dense_pairs if dense_pairs else 0.0}


def _latents(res: dict) -> torch.Tensor:
    return res["latents"]["vision"].detach().to(torch.float64)


def _quality(rs: RequestSet, exact: list[dict], fast: list[dict]) -> tuple[dict, list, list]:
    from parity.quality.image import video_quality
    rows, ex_out, fa_out = [], [], []
    for i, (e, a) in enumerate(zip(exact, fast)):
        xe, xa = _latents(e), _latents(a)
        if rs.decode is not None:
            ve, va = rs.decode(xe.float()), rs.decode(xa.float())
            q, on = video_quality(ve, va, 1.0), "frames"
            ex_out.append(ve.astype(np.float64) / 255)
            fa_out.append(va.astype(np.float64) / 255)
        else:   # latents [1, C, F, h, w] as F frames of C channels, on the exact latents' range
            lo, hi = float(xe.min()), float(xe.max())
            to = lambda x, lo=lo, hi=hi: ((x[0].permute(1, 2, 3, 0) - lo) / max(hi - lo, 1e-12)).numpy()  # noqa: E731
            q, on = video_quality(to(xe), to(xa), 1.0), "latents (scaled by the exact latents' range)"
            ex_out.append(xe.numpy())
            fa_out.append(xa.numpy())
        rows.append({"request": i, **q.to_dict()})
    psnrs = [r["psnr_db"] if r["psnr_db"] != "inf" else math.inf for r in rows]
    worst = min(psnrs) if psnrs else math.inf
    return ({"on": on, "psnr_db_min": worst if math.isfinite(worst) else "inf",
             "ssim_min": min(r["ssim_min"] for r in rows), "per_request": rows}, ex_out, fa_out)


def _c1(spec: AccelSpec, rs: RequestSet, fault: str | None) -> dict:
    """C1 under the acceleration on the set's first request (engine vs reference, same spec)."""
    from parity.accel_rows import compare, first_failure
    from parity.families.wan.common import contract_tolerance
    from reference.wan.pipeline import WanReferencePipeline
    tol = contract_tolerance("C1", "loop", "float32", "cpu").rel_l2
    req = _with_accel(rs.requests[0], spec)
    from optimized.models.wan.denoise import WanDenoiseJob, WanDenoiseLoop
    from optimized.models.wan.instance import WanModelInstance
    from optimized.runtime.scheduler import WorkUnitScheduler
    loop = WanDenoiseLoop(WanModelInstance(rs.cfg, rs.weights, weights_version="certify-c1"))
    sched = WorkUnitScheduler()
    with planted(fault), torch.no_grad():
        h = sched.submit(loop, WanDenoiseJob(req, record_trajectory=True))
        while not sched.idle:
            sched.tick()
    if h.status != "completed":
        raise CertifyError(f"the engine refused the request: {h.error}")
    with torch.no_grad():
        ref = WanReferencePipeline(rs.cfg, rs.weights).generate(req, keep_trajectory=True)
    rows = compare(h.result["accel"]["decisions"], h.result["trajectory"], ref.accel, ref.trajectory, tol)
    bad = first_failure(rows)
    return {"passed": bad is None, "rows": len(rows), "tolerance_rel_l2": tol,
            "first_failure": None if bad is None else {"step": bad.step, "check": bad.check, "branch": bad.branch,
                                                       "detail": bad.detail}}


def certify(family: str, accel: str, *, checkpoint: str | Path | None = None, budget: AccelBudget | None = None,
            fault: str | None = None, limit: int | None = None, request_set: RequestSet | None = None,
            steps: int | None = None) -> Certificate:
    """Run both paths and judge. `fault` plants a negative control in the engine for every accelerated run."""
    if family != "wan":
        raise CertifyError(f"certify: family {family!r} is not wired yet (wan only)")
    try:
        spec = parse_accel(accel)
    except AccelSpecError as e:
        raise CertifyError(str(e)) from None
    if fault is not None and fault not in FAULTS:
        raise CertifyError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
    budget = budget or AccelBudget()
    if steps is not None and not checkpoint:
        raise CertifyError("--steps applies to the held-out set of a --checkpoint")
    rs = request_set or (held_out_set(Path(checkpoint), limit, steps) if checkpoint else placeholder_set())
    try:
        # one untimed request on each path first: torch's first-call costs would otherwise land on the exact side
        run_engine(rs, rs.requests[:1], None)
        with planted(fault):
            run_engine(rs, rs.requests[:1], spec)
        exact, t_exact = run_engine(rs, rs.requests, None)
        with planted(fault):
            fast, t_fast = run_engine(rs, rs.requests, spec)
            fast_disjoint, _ = run_engine(rs, rs.disjoint, spec)
        c1 = _c1(spec, rs, fault)
    except (ValueError, TypeError) as e:       # a spec the model cannot run: one message
        raise CertifyError(str(e)) from None
    shape = tuple(_latents(exact[0]).shape)
    speed = {"wall_exact_s": round(t_exact, 4), "wall_accel_s": round(t_fast, 4),
             "wall_ratio": round(t_exact / t_fast, 4) if t_fast > 0 else None,
             "measured": "same process, same weights and requests, each side warmed up, then batched in one run (CPU)",
             **skipped_fractions(fast, rs.cfg, shape)}
    quality, ex_out, fa_out = _quality(rs, exact, fast)

    reasons: list[str] = []
    if not c1["passed"]:
        f = c1["first_failure"]
        reasons.append(f"C1 under {spec.label()} failed at step {f['step']}"
                       + (f" branch {f['branch']}" if f["branch"] else "") + f" ({f['check']}: {f['detail']}): the "
                       f"engine does not do what the reference rule decides")
    adherence = c3 = None
    if spec.exact:
        from parity.families.wan.common import contract_tolerance
        tol = contract_tolerance("C1", "loop", "float32", "cpu").rel_l2
        worst = max(float((_latents(a) - _latents(e)).norm() / _latents(e).norm()) for e, a in zip(exact, fast))
        quality["rel_l2_vs_exact_max"] = worst
        if worst > tol:
            reasons.append(f"an exact acceleration changed the output: rel L2 {worst:.3g} > {tol:g} vs the exact path")
    else:
        psnr_min = quality["psnr_db_min"]
        if psnr_min != "inf" and psnr_min < budget.min_psnr_db:
            reasons.append(f"PSNR {psnr_min:.2f} dB vs exact < budget {budget.min_psnr_db:g} dB ({quality['on']})")
        if quality["ssim_min"] < budget.min_ssim:
            reasons.append(f"SSIM {quality['ssim_min']:.4f} vs exact < budget {budget.min_ssim:g}")
        if rs.decode is not None:
            from parity.quality.adherence import adherence_rate, score_clip
            se = [score_clip((x * 255).round().astype(np.uint8), c) for x, c in zip(ex_out, rs.captions)]
            sa = [score_clip((x * 255).round().astype(np.uint8), c) for x, c in zip(fa_out, rs.captions)]
            adherence = {"exact": adherence_rate(se), "accel": adherence_rate(sa),
                         "change": adherence_rate(sa) - adherence_rate(se)}
            if -adherence["change"] > budget.max_adherence_drop:
                reasons.append(f"adherence dropped {-adherence['change'] * 100:.1f} points > budget "
                               f"{budget.max_adherence_drop * 100:g}")
        if len(rs.requests) >= 4:
            from parity.quality.distribution import distribution_test
            fd = [(_latents(r).numpy() if rs.decode is None else rs.decode(_latents(r).float()).astype(np.float64)
                   / 255) for r in fast_disjoint]
            res = distribution_test(ex_out, fd, alpha=budget.c3_alpha, permutations=C3_PERMUTATIONS)
            c3 = res.to_dict()
            if not res.same:
                reasons.append(f"C3: the accelerated samples' distribution differs from the exact one "
                               f"(p {res.p_value:.3g} <= {res.threshold:.3g}, {res.worst_test})")
        else:
            c3 = {"skipped": f"needs >= 4 requests, the set has {len(rs.requests)}"}
    return Certificate(
        schema=CERT_SCHEMA, family=family, label=spec.label(), exact=spec.exact,
        checkpoint=str(checkpoint) if checkpoint else None,
        requests={"set": rs.name, "placeholder": rs.placeholder, "k": len(rs.requests),
                  "steps": rs.requests[0].num_steps, "guidance": rs.requests[0].guidance_scale,
                  "frames": rs.requests[0].num_frames, "size": [rs.requests[0].height, rs.requests[0].width]},
        speedup=speed, quality=quality, adherence=adherence, c3=c3, c1=c1, budget=asdict(budget), fault=fault,
        passed=not reasons, reasons=reasons)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(type(o).__name__)


def write_certificate(cert: Certificate, out: Path) -> None:
    """Atomically: a temporary file beside OUT, then renamed (never a half-written certificate)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(cert.to_dict(), indent=2, default=_json_default) + "\n")
    os.replace(tmp, out)


@click.command("certify", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("family")
@click.option("--accel", "accel", required=True, metavar="NAME[:knobs]",
              help="The acceleration to certify, e.g. fbcache:threshold=0.05, dbcache:fn=1,bn=0, sta.")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="A canonical wan model directory (the trained model): HELD_OUT requests, frames, adherence. "
                   "Default: a placeholder set on the tiny random variant (flagged in the certificate).")
@click.option("--out", "out", type=click.Path(path_type=Path), default=None, help="Write the certificate JSON here.")
@click.option("--budget", default=None, metavar="k=v,...",
              help="Override the declared budget: min_psnr_db, min_ssim, max_adherence_drop, c3_alpha.")
@click.option("--limit", type=int, default=None, help="Use the first N held-out requests only (>= 4 for C3).")
@click.option("--steps", type=int, default=None,
              help="Denoising steps of the held-out requests (default: the evaluation's, "
                   "parity.quality.evaluate.STEPS = 12); needs --checkpoint.")
@click.option("--plant-fault", "fault", type=click.Choice(FAULTS), default=None,
              help="Negative control: plant this engine fault; the certificate must fail and say why.")
def certify_cmd(family: str, accel: str, checkpoint: Path | None, out: Path | None, budget: str | None,
                limit: int | None, steps: int | None, fault: str | None) -> None:
    """Certify an acceleration: exact vs accelerated engine paths on the contract's request set; a JSON certificate
    (speed-up, PSNR / SSIM, adherence change, C3, C1 under the acceleration, budget, pass / fail with reasons).
    Exit 0 passed, 1 failed, 2 bad input."""
    try:
        if limit is not None and limit < 1:
            raise CertifyError("--limit must be >= 1")
        if steps is not None and steps < 1:
            raise CertifyError("--steps must be >= 1")
        if checkpoint is not None and not checkpoint.is_dir():
            raise CertifyError(f"{checkpoint}: no such model directory")
        cert = certify(family, accel, checkpoint=checkpoint, budget=parse_budget(budget), fault=fault, limit=limit,
                       steps=steps)
    except CertifyError as e:
        raise click.UsageError(str(e)) from None
    if out is not None:
        write_certificate(cert, out)
    s = cert.speedup
    click.echo(f"certificate {cert.label} ({'exact' if cert.exact else 'lossy'}) on {cert.requests['set']}"
               + (" [PLACEHOLDER request set]" if cert.requests["placeholder"] else ""))
    click.echo(f"  speed-up: wall x{s['wall_ratio']}, block-forwards skipped "
               f"{s['block_forwards_skipped_fraction'] * 100:.1f}%, attention pairs skipped "
               f"{s['attention_pairs_skipped_fraction'] * 100:.1f}%")
    q = cert.quality
    click.echo(f"  quality vs exact ({q['on']}): PSNR min {q['psnr_db_min']} dB, SSIM min {q['ssim_min']:.4f}")
    if cert.c3 and "p_value" in cert.c3:
        click.echo(f"  C3: p {cert.c3['p_value']:.3g}, detectable effect {cert.c3['detectable_effect_std']} std")
    click.echo(f"  C1 under accel: {'pass' if cert.c1['passed'] else 'FAIL'}")
    click.echo(f"  {'PASSED' if cert.passed else 'FAILED'}" + ("" if cert.passed else ": " + "; ".join(cert.reasons)))
    if out is not None:
        click.echo(f"  written: {out}")
    raise SystemExit(0 if cert.passed else 1)


__all__ = [
    "CERT_SCHEMA",
    "FAULTS",
    "Certificate",
    "CertifyError",
    "certify",
    "certify_cmd",
    "held_out_set",
    "parse_budget",
    "placeholder_set",
    "write_certificate",
]
