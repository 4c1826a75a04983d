"""seedvr2 C0: window geometry (optimized vs reference listings on fixed and rule grids), the planner (every
window on exactly one rank of the right world size), and the full NaDiT for the 3B and 7B tiny variants on the
cases of cases.CASES, each at SP world sizes 1..4 (ranks > 1 spawned on gloo): the output, every traced block
output (video and text, the 3B last layer's passive text included) and first-divergent-layer localisation."""

from __future__ import annotations

import os
from typing import Callable

import torch

from manifests import ManifestError
from manifests.parity import load_parity_contract
from manifests.seedvr2 import load_variant
from parity.errors import SetupError
from parity.family import DTYPE_NAMES, DTYPES
from parity.families.seedvr2 import cases as C
from parity.families.seedvr2.faults import check_fault, planted
from parity.localise import first_divergence
from parity.metrics import compare, within
from parity.report import CheckResult, Report, exceptions_fail

import optimized.models.seedvr2 as opt
import reference.seedvr2 as ref
from optimized.parallel import ParallelPlan, SPGroup
from optimized.parallel.launch import run_ranks

DEFAULT_VARIANTS = ("tiny-3b", "tiny-7b")
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)


class Recorder:
    def __init__(self):
        self.records: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, t: torch.Tensor) -> None:
        self.records[name] = t.detach().float().clone()


def run_reference(model, inp: C.NaDiTInputs, dtype, trace=None) -> torch.Tensor:
    with torch.no_grad():
        return model(*inp.args(dtype), trace=trace).float()


def run_optimized(model, inp: C.NaDiTInputs, dtype, group: SPGroup | None = None, trace=None) -> torch.Tensor:
    with torch.no_grad():
        return model(*inp.args(dtype), group=group, trace=trace).float()


def sp_worker(group: SPGroup, cfg_name: str, state, inp: C.NaDiTInputs, dtype_name: str, fault: str | None):
    """One rank: world size 1 locally first (the same model and plan cache), then the SP run with a trace."""
    cfg = load_variant(cfg_name)
    dtype = DTYPES[dtype_name]
    fast = opt.load_fast_nadit(cfg, state, dtype=dtype, parallel=ParallelPlan((("sp", group.world_size),)))
    with planted(fault, fast):
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


def compare_check(name, got, want, tol, where: Callable[[], str | None] | None = None) -> CheckResult:
    m = compare(got, want)
    ok = within(m, tol)
    r = CheckResult(name, ok, m, tol)
    if not ok and where is not None:
        r.divergence = where() or "outputs only (every traced layer within tolerance)"
    return r


def block_outputs_check(name: str, want: dict, got: dict, tol) -> CheckResult:
    """Every block's full output (video and text) against the reference's: the text of the 3B last layer feeds
    nothing downstream, so only this check sees it."""
    names = [k for k in want if k.startswith("blocks.") and k in got]
    div = first_divergence({k: got[k] for k in names}, {k: want[k] for k in names}, tol)
    if div is None:
        return CheckResult(name, bool(names), detail=f"{len(names)} block outputs within tolerance" if names else
                           "no block output traced on both sides")
    return CheckResult(name, False, div.metrics, tol, detail=f"first divergent block output {div.name}",
                       divergence=f"{div.name} (rel_l2 {div.metrics.rel_l2:.2e})")


# ------------------------------------------------------------------------------------------------
# Geometry and planner
# ------------------------------------------------------------------------------------------------

def check_geometry(fast) -> list[CheckResult]:
    out = []
    for grid in C.GEOMETRY_GRIDS:
        for method in ("regular", "shifted"):
            want = ref.windows(grid, (4, 3, 3), method)
            g = fast.plan_cache.get((grid,), (4, 3, 3), method, 1).geometry
            canon = torch.arange(grid[0] * grid[1] * grid[2]).view(grid)
            want_ids = torch.cat([canon[b[0][0]:b[0][1], b[1][0]:b[1][1], b[2][0]:b[2][1]].reshape(-1) for b in want])
            ids_ok = torch.equal(want_ids, g.token_ids) and [b for _, b in g.boxes] == want
            layer = f"blocks.{0 if method == 'regular' else 1}"
            out.append(CheckResult(f"windows/{grid}/{method}", ids_ok,
                                   detail=f"{len(want)} windows" if ids_ok else
                                   f"optimized geometry differs from the reference ({method}; {len(g.boxes)} windows "
                                   f"vs {len(want)}; first divergence {layer})",
                                   divergence=None if ids_ok else layer))
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


# ------------------------------------------------------------------------------------------------
# The NaDiT
# ------------------------------------------------------------------------------------------------

def _sp_checks(prefix, vname, state, inp, dname, fault, ws, want, ref_trace, single_sample, tol) -> list[CheckResult]:
    res = run_ranks(sp_worker, ws, (vname, state, inp, dname, fault), timeout_s=300)
    errors = [(r, rr["error"]) for r, rr in enumerate(res) if rr["error"]]
    if errors:  # report the root cause: a local error beats a peer's collective failure
        errors.sort(key=lambda e: ("failed (" in e[1], e[0]))
        r, err = errors[0]
        return [CheckResult(f"{prefix}/sp={ws}", False, detail=f"rank {r}: {err}", divergence=err.split(" (")[0])]
    traced = res[0]["trace"] if single_sample else {}
    checks = [compare_check(f"{prefix}/sp={ws}", res[0]["out"], want, tol,
                            lambda: localise(ref_trace.records, traced, tol))]
    if single_sample:
        checks.append(block_outputs_check(f"{prefix}/sp={ws}/block_outputs", ref_trace.records, traced, tol))
    same = all(torch.equal(rr["out"], res[0]["out"]) for rr in res)
    checks.append(CheckResult(f"{prefix}/sp={ws}/ranks_agree", same,
                              detail="every rank returns the same full output" if same else
                              "ranks returned different outputs"))
    checks.append(compare_check(f"{prefix}/sp={ws}/vs_sp=1", res[0]["out"], res[0]["single"], tol))
    return checks


def nadit_checks(vname: str, dname: str, cfg, state, tol, seed, world_sizes, fault, progress) -> list[CheckResult]:
    dtype = DTYPES[dname]
    reference = ref.load_nadit(cfg, state, dtype=dtype)
    checks: list[CheckResult] = []
    fast = opt.load_fast_nadit(cfg, state, dtype=dtype)
    with planted(fault, fast):
        if dname == "fp32":
            checks += check_geometry(fast)
            checks += check_planner(fast, ((5, 12, 40),))
        for i, case in enumerate(C.CASES):
            inp = C.make_inputs(cfg, case.grids, case.text_lens, seed + i)
            prefix = f"{vname}/{dname}/{case.name}"
            single_sample = len(case.grids) == 1  # batched traces cover sample 0 only on the reference side
            with exceptions_fail(checks, prefix):  # an exception fails this case, not the run
                progress(f"[seedvr2 C0] {prefix}: reference")
                ref_trace = Recorder()
                want = run_reference(reference, inp, dtype, trace=ref_trace)
                for ws in world_sizes if case.world_sizes == "all" else [1]:
                    if ws > 1:
                        progress(f"[seedvr2 C0] {prefix}: sp={ws} on {ws} gloo ranks")
                        checks += _sp_checks(prefix, vname, state, inp, dname, fault, ws, want, ref_trace,
                                             single_sample, tol)
                        continue
                    rec = Recorder()
                    try:
                        got = run_optimized(fast, inp, dtype, trace=rec)
                    except RuntimeError as e:
                        checks.append(CheckResult(f"{prefix}/sp=1", False, detail=str(e),
                                                  divergence=str(e).split(" ")[0]))
                        continue
                    traced = rec.records if single_sample else {}
                    checks.append(compare_check(f"{prefix}/sp=1", got, want, tol,
                                                lambda: localise(ref_trace.records, traced, tol)))
                    if single_sample:
                        checks.append(block_outputs_check(f"{prefix}/sp=1/block_outputs", ref_trace.records, traced,
                                                          tol))
    return checks


def resolve_variants(variants, checkpoint, seed):
    """(name, config) per model to check: the named variants, or the architecture of a converted checkpoint."""
    if checkpoint is not None:
        return [(name, cfg) for name, cfg, _ in _checkpoint_models(variants, checkpoint, seed)]
    try:
        return [(v, load_variant(v)) for v in (variants or DEFAULT_VARIANTS)]
    except ManifestError as e:
        raise SetupError(str(e)) from None


def _checkpoint_models(variants, checkpoint, seed):
    from manifests.seedvr2.keys import nadit_key_shapes
    from parity.checkpoints import models_to_check
    return models_to_check("seedvr2", variants, DEFAULT_VARIANTS, checkpoint, seed, load_variant, nadit_key_shapes)


def env_world_sizes() -> tuple[int, ...]:
    raw = os.environ.get("FVPARITY_WORLD_SIZES")
    return tuple(int(x) for x in raw.split(",")) if raw else DEFAULT_WORLD_SIZES


def run_c0(variants: list[str], checkpoint: str | None, device: str, dtypes: list[str], seed: int,
           fault: str | None, progress: Callable[[str], None], world_sizes: list[int] | None = None) -> Report:
    check_fault(fault)
    if device != "cpu":
        raise SetupError("seedvr2 C0 runs on cpu (gloo ranks); GPU runs go through tools/")
    world_sizes = list(world_sizes or env_world_sizes())
    contract = load_parity_contract("seedvr2")
    report = Report("seedvr2", "C0", {"variants": variants or list(DEFAULT_VARIANTS), "device": device,
                                      "dtypes": dtypes, "seed": seed, "fault": fault, "world_sizes": world_sizes})
    models = (_checkpoint_models(variants, checkpoint, seed) if checkpoint is not None else
              [(vname, cfg, None) for vname, cfg in resolve_variants(variants, None, seed)])
    for vname, cfg, converted in models:
        if cfg.dim > 256:
            raise SetupError(f"{'checkpoint' if converted is not None else 'variant ' + repr(vname)} is a released "
                             f"size; C0 on CPU runs the tiny variants")
        state = converted if converted is not None else C.nadit_state(cfg, seed)
        for dname in dtypes:
            tol = contract.tolerance("C0", DTYPE_NAMES[dname], device)
            report.checks += nadit_checks(vname, dname, cfg, state, tol, seed, world_sizes, fault, progress)
    return report
