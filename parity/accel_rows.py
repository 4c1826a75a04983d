"""The rows of C1 under an acceleration, shared by the wan and cosmos3 checks: decisions compared row by row, then
the latents after every step; the first failing row localises a fault. Also the planted engine faults (negative
controls): "never_refresh" (the residual store keeps the first value of every slot), "wrong_branch" (a branch reads
the other branch's residuals)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

FAULTS = ("never_refresh", "wrong_branch")
METRIC_TOL = 1e-4   # the compared quantity (residual diff, accumulated error) of both sides, relative


@dataclass(frozen=True)
class AccelC1Row:
    step: int
    check: str                       # "decision" | "latents"
    ok: bool
    detail: str                      # what differed (branch, actions, block ranges) or the measured rel L2
    branch: str | None = None
    rel_l2: float | None = None


def first_failure(rows: list[AccelC1Row]) -> AccelC1Row | None:
    """The earliest failing row (by step; a decision before the latents of its step)."""
    bad = [r for r in rows if not r.ok]
    return min(bad, key=lambda r: (r.step, r.check != "decision")) if bad else None


@contextmanager
def planted(fault: str | None) -> Iterator[None]:
    """Plant one engine fault for the duration (None: nothing)."""
    if fault is None:
        yield
        return
    if fault not in FAULTS:
        raise ValueError(f"unknown accel fault {fault!r} (known: {', '.join(FAULTS)})")
    from optimized.accel.residual import ResidualCache
    original_store, original_load = ResidualCache.store_value, ResidualCache.load

    def store_once(self, owner, branch, blocks, slot, value):
        if self.key(owner, branch, blocks, slot) not in self.store:   # never refreshes what it holds
            original_store(self, owner, branch, blocks, slot, value)

    def load_other(self, owner, branch, blocks, slot):
        return original_load(self, owner, {"cond": "uncond", "uncond": "cond"}[branch], blocks, slot)

    if fault == "never_refresh":
        ResidualCache.store_value = store_once
    else:
        ResidualCache.load = load_other
    try:
        yield
    finally:
        ResidualCache.store_value, ResidualCache.load = original_store, original_load


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _decision_view(d) -> tuple:
    return d.step, d.branch, d.action, d.blocks_computed, d.blocks_reused, d.keys_skipped


def compare(engine_decisions, engine_trajectory, ref_decisions, ref_trajectory, tol: float) -> list[AccelC1Row]:
    """Decisions row by row, then the latents after every step."""
    rows: list[AccelC1Row] = []
    n = max(len(engine_decisions), len(ref_decisions))
    for i in range(n):
        e = engine_decisions[i] if i < len(engine_decisions) else None
        r = ref_decisions[i] if i < len(ref_decisions) else None
        ok = e is not None and r is not None and _decision_view(e) == _decision_view(r)
        detail = "same" if ok else f"engine {e and _decision_view(e)} vs reference {r and _decision_view(r)}"
        if ok and (e.metric is None) != (r.metric is None):
            ok, detail = False, f"metric: engine {e.metric} vs reference {r.metric}"
        elif ok and e.metric is not None and abs(e.metric - r.metric) > METRIC_TOL * max(1.0, abs(r.metric)):
            ok, detail = False, f"metric: engine {e.metric:.6g} vs reference {r.metric:.6g}"
        rows.append(AccelC1Row((e or r).step, "decision", ok, detail, branch=(r or e).branch))
    for step, (x_e, x_r) in enumerate(zip(engine_trajectory, ref_trajectory)):
        err = _rel_l2(x_e, x_r)
        rows.append(AccelC1Row(step, "latents", err <= tol, f"rel L2 {err:.3g} (tolerance {tol:g})", rel_l2=err))
    if len(engine_trajectory) != len(ref_trajectory):
        rows.append(AccelC1Row(min(len(engine_trajectory), len(ref_trajectory)), "latents", False,
                               f"{len(engine_trajectory)} engine steps vs {len(ref_trajectory)} reference steps"))
    return rows
