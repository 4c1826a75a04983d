"""What C2 (logprob identity) and C3 (rollout distributions) of every family share: the per-step logprob
comparison as a check, and the two-sample tests.

C2: rollout logprobs vs a recompute, per SDE step: mean and max |delta logp| and the ratio exp(recompute - rollout).
A tolerance of 0.0 means bitwise identity (ratio exactly 1), step 0 included.

C3: two sets of K rollouts compared as distributions. Each test returns a p-value; a check passes when p > alpha:
  energy   the energy distance between the two samples of final latents (flattened), permutation test
  ks       a Kolmogorov-Smirnov test (scipy) on one scalar statistic per sample (e.g. step i's logprob, the final
           latents' mean or std)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from scipy import stats

from manifests.parity import Tolerance
from parity.report import CheckResult


def _steps(lp: torch.Tensor) -> list[int]:
    return [i for i in range(len(lp)) if not math.isnan(float(lp[i]))]


def logprob_check(name: str, rollout: torch.Tensor, recompute: torch.Tensor, max_abs: float,
                  want_steps: list[int] | None = None) -> CheckResult:
    """Per-step |delta logp| <= max_abs (0.0 = identical) on the same SDE steps (NaN = ODE step on both sides)."""
    rs, cs = _steps(rollout), _steps(recompute)
    deltas = [abs(float(recompute[i]) - float(rollout[i])) for i in rs] if rs == cs else []
    ratios = [math.exp(float(recompute[i]) - float(rollout[i])) for i in rs] if rs == cs else []
    extra = {"steps": rs, "abs_delta": deltas, "ratio": ratios, "rollout": [float(x) for x in rollout],
             "recompute": [float(x) for x in recompute]}
    if rs != cs or not rs:
        return CheckResult(name, False, detail=f"SDE steps differ or are empty: rollout {rs}, recompute {cs}",
                           extra=extra)
    if want_steps is not None and rs != want_steps:
        return CheckResult(name, False, detail=f"logprobs on steps {rs}, expected the SDE window {want_steps}",
                           extra=extra)
    mean_d, max_d = sum(deltas) / len(deltas), max(deltas)
    bad = [i for i, d in zip(rs, deltas) if not d <= max_abs]
    ok = not bad
    detail = (f"mean|dlogp|={mean_d:.3g} max|dlogp|={max_d:.3g} ratio in [{min(ratios):.9g}, {max(ratios):.9g}] "
              f"over steps {rs}; tol {'identical' if max_abs == 0 else f'<= {max_abs:g}'}")
    if bad:
        detail = f"first divergent step {bad[0]}: " + detail
    return CheckResult(name, ok, tolerance=Tolerance(max_abs=max_abs) if max_abs > 0 else None, detail=detail,
                       extra=extra)


def exact_check(name: str, ok: bool, detail: str) -> CheckResult:
    return CheckResult(name, bool(ok), detail=detail)


# ------------------------------------------------------------------------------------------------ C3

def energy_distance(x: np.ndarray, y: np.ndarray) -> float:
    """The (V-statistic) energy distance 2 E|X-Y| - E|X-X'| - E|Y-Y'| between two samples of row vectors."""
    def mean_dist(a, b):
        return float(np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)).mean())
    return 2 * mean_dist(x, y) - mean_dist(x, x) - mean_dist(y, y)


def energy_test(x: np.ndarray, y: np.ndarray, permutations: int = 2000, seed: int = 0) -> tuple[float, float]:
    """(energy distance, permutation p-value) of two samples [K, d] (pairwise distances computed once)."""
    z = np.concatenate([x, y]).astype(np.float64)
    d = np.sqrt(((z[:, None, :] - z[None, :, :]) ** 2).sum(-1))
    n = len(x)

    def stat(idx: np.ndarray) -> float:
        a, b = idx[:n], idx[n:]
        return 2 * d[np.ix_(a, b)].mean() - d[np.ix_(a, a)].mean() - d[np.ix_(b, b)].mean()

    rng = np.random.default_rng(seed)
    observed = stat(np.arange(len(z)))
    null = [stat(rng.permutation(len(z))) for _ in range(permutations)]
    p = (1 + sum(s >= observed for s in null)) / (1 + permutations)
    return float(observed), float(p)


def ks_test(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    r = stats.ks_2samp(a, b)
    return float(r.statistic), float(r.pvalue)


@dataclass
class SampleSet:
    """K rollouts of one side: final latents [K, d] and per-sample scalar statistics by name."""
    finals: np.ndarray
    scalars: dict[str, np.ndarray]


def sample_set(finals: list[torch.Tensor], logprobs: list[torch.Tensor]) -> SampleSet:
    """Statistics per rollout: the final latents' mean and std, and each SDE step's logprob."""
    f = np.stack([t.detach().to("cpu", torch.float64).reshape(-1).numpy() for t in finals])
    scalars = {"final_mean": f.mean(1), "final_std": f.std(1)}
    lp = torch.stack([x.to(torch.float64) for x in logprobs]).numpy()
    for i in range(lp.shape[1]):
        if not np.isnan(lp[:, i]).any():
            scalars[f"logprob_step{i}"] = lp[:, i]
    return SampleSet(f, scalars)


def two_sample_tests(a: SampleSet, b: SampleSet, permutations: int = 2000, seed: int = 0) -> dict[str, tuple]:
    """name -> (statistic, p-value): one energy test on the final latents, one KS test per scalar statistic."""
    out = {"energy:final_latents": energy_test(a.finals, b.finals, permutations, seed)}
    for k in a.scalars:
        if k in b.scalars:
            out[f"ks:{k}"] = ks_test(a.scalars[k], b.scalars[k])
    return out


def min_p(tests: dict[str, tuple]) -> tuple[str, float]:
    name = min(tests, key=lambda k: tests[k][1])
    return name, tests[name][1]


def distribution_check(name: str, tests: dict[str, tuple], alpha: float, expect_same: bool) -> CheckResult:
    """The sides differ when some p <= alpha / (number of tests) (Bonferroni: the family-wise false-alarm rate
    stays <= alpha). expect_same: pass when they do not differ; a perturbed control passes when they do."""
    worst, p = min_p(tests)
    m = len(tests)
    extra = {k: {"statistic": s, "p": pv} for k, (s, pv) in tests.items()}
    if expect_same:
        ok = p > alpha / m
        detail = f"min p = {p:.3g} ({worst}) {'>' if ok else '<='} alpha/{m} = {alpha / m:.3g}"
    else:
        ok = p <= alpha / m
        detail = f"perturbation {'detected' if ok else 'NOT detected'}: min p = {p:.3g} ({worst}), alpha/{m} = " \
                 f"{alpha / m:.3g}"
    return CheckResult(name, ok, detail=detail, extra=extra)


# ------------------------------------------------------------------------------------------------ planted faults
# (family-agnostic: the SDE solver and the weight-update lifecycle are shared by every family's loop)

@contextlib.contextmanager
def _patched(module, name: str, make) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, make(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def sde_sigma_off_by_one():
    """The rollout's SDE step reads the sigma table one entry late (sigma_{i+1}, sigma_{i+2})."""
    from optimized.solvers import sde

    def shifted(original):
        def step_sigmas(s):
            n = len(s.sigmas) - 1
            return s.sigmas[min(s.index + 1, n - 1)], s.sigmas[min(s.index + 2, n)]
        return step_sigmas
    return _patched(sde, "step_sigmas", shifted)


def sde_noise_level_mismatch():
    """The rollout samples with noise_level 0.75 where the request (and so the record and recompute) says 0.7."""
    from optimized.solvers import sde
    return _patched(sde, "noise_level", lambda original: lambda s: original(s) * 0.75 / 0.7)


def stale_cache_after_update():
    """The weight update does not bump the version its caches are keyed by: old entries survive the update."""
    from optimized.training import weights
    return _patched(weights, "resolve_version", lambda original: lambda requested, current: current)


@contextlib.contextmanager
def cpu_threads(device: str, n: int = 1) -> Iterator[None]:
    """Tiny CPU rollouts run on one intra-op thread (threads only add overhead at these sizes, and C3 runs
    hundreds of them); restored afterwards."""
    import torch
    if not str(device).startswith("cpu"):
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
