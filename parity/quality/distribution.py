"""A distribution test of an accelerated path against the exact path, with the C3 machinery
(`parity.rollout_checks`: energy test on the final samples, KS tests on per-sample scalars, Bonferroni at alpha).

Each side is K samples (final latents or decoded clips, one per seed; the two sides on DISJOINT seed blocks, so
they are independent samples). The result carries the p-value and the detectable effect size at this K: the
smallest shift, in units of the exact samples' per-coordinate std, of half of the exact set that the same tests
detect against its other half (a sweep over EFFECT_SWEEP). A pass with a detectable effect of 0.5 says only that
the accelerated distribution is within about half a std of the exact one: the certificate reports both."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from parity.rollout_checks import C3_ALPHA, SampleSet, min_p, two_sample_tests

EFFECT_SWEEP = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0)


@dataclass
class DistributionResult:
    p_value: float                 # the smallest p over the tests
    worst_test: str
    threshold: float               # alpha / number of tests (Bonferroni)
    same: bool                     # p > threshold: the test does not tell the sides apart
    detectable_effect: float | None   # in exact-std units; None: not even the largest shift is detected at this K
    k: int
    tests: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"p_value": self.p_value, "worst_test": self.worst_test, "threshold": self.threshold,
                "same": self.same, "detectable_effect_std": self.detectable_effect, "k": self.k, "tests": self.tests}


def _sample_set(samples: list[torch.Tensor] | np.ndarray) -> SampleSet:
    f = np.stack([np.asarray(s.detach().to("cpu", torch.float64) if isinstance(s, torch.Tensor) else s,
                             dtype=np.float64).reshape(-1) for s in samples])
    return SampleSet(f, {"final_mean": f.mean(1), "final_std": f.std(1)})


def distribution_test(exact: list[torch.Tensor] | np.ndarray, accelerated: list[torch.Tensor] | np.ndarray,
                      alpha: float = C3_ALPHA, permutations: int = 1000, seed: int = 0) -> DistributionResult:
    """exact, accelerated: K samples each (any equal shape), from disjoint seed blocks."""
    a, b = _sample_set(exact), _sample_set(accelerated)
    if a.finals.shape != b.finals.shape:
        raise ValueError(f"the two sides need equal sample counts and shapes: {a.finals.shape} vs {b.finals.shape}")
    if len(a.finals) < 4:
        raise ValueError(f"a distribution test needs at least 4 samples per side, got {len(a.finals)}")
    tests = two_sample_tests(a, b, permutations, seed)
    worst, p = min_p(tests)
    threshold = alpha / len(tests)
    return DistributionResult(p, worst, threshold, p > threshold,
                              detectable_effect(a.finals, alpha, permutations, seed), len(a.finals),
                              {k: {"statistic": s, "p": pv} for k, (s, pv) in tests.items()})


def detectable_effect(exact: np.ndarray, alpha: float = C3_ALPHA, permutations: int = 1000, seed: int = 0
                      ) -> float | None:
    """The smallest shift (exact-std units, every coordinate) of one half of `exact` [K, d] that the tests detect
    against the other half; None when no shift in EFFECT_SWEEP is detected."""
    half = len(exact) // 2
    first, second = exact[:half], exact[half:2 * half]
    std = exact.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    for eps in EFFECT_SWEEP:
        shifted = second + eps * std
        tests = two_sample_tests(SampleSet(first, {"final_mean": first.mean(1), "final_std": first.std(1)}),
                                 SampleSet(shifted, {"final_mean": shifted.mean(1), "final_std": shifted.std(1)}),
                                 permutations, seed)
        if min_p(tests)[1] <= alpha / len(tests):
            return eps
    return None
