"""What C2 (logprob identity) and C3 (rollout distributions) of every family share: the per-step logprob
comparison as a check, and the two-sample tests.

C2: rollout logprobs vs a recompute, per SDE step: mean and max |delta logp| and the ratio exp(recompute - rollout).
A tolerance of 0.0 means bitwise identity (ratio exactly 1), step 0 included. A sample of several stepped modalities
is compared per modality and as a whole (its logprob: the element-weighted mean over modalities, each side's own
`sample_logprob`, manifests.solvers.SAMPLE_LOGPROB_REDUCTION).

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
from parity.patching import patched as _patched


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


def record_modalities_weighed_equally():
    """The rollout's record weighs every stepped modality equally (element count 1 each): its sample logprob
    becomes the plain mean over modalities (a multi-modality rollout only; vision-only records are unchanged)."""
    from optimized.training import records
    return _patched(records, "element_counts", lambda original: lambda latents: {m: 1 for m in latents})


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


def c2_faults(cache: str, stale_cache_detail: str) -> tuple[dict, tuple]:
    """Every family's C2 faults (name -> context manager factory, and their Fault rows); `cache` names the prompt
    cache that a stale weight update keeps."""
    from parity.family import Fault
    stale = f"stale-{cache}-cache-after-update"
    planted_faults = {"sde-sigma-off-by-one": sde_sigma_off_by_one,
                      "sde-noise-level-mismatch": sde_noise_level_mismatch,
                      stale: stale_cache_after_update}
    rows = (Fault("sde-sigma-off-by-one", "the rollout's SDE steps read the sigma table one step late", "C2"),
            Fault("sde-noise-level-mismatch", "the rollout samples with noise_level 0.75, the record says 0.7", "C2"),
            Fault(stale, stale_cache_detail, "C2"))
    return planted_faults, rows


# ------------------------------------------------------------------------------------------------ shared runners

def check_fault(family: str, level: str, faults: dict, fault: str | None) -> None:
    """A fault must be one planted at this level for this family."""
    from parity.errors import SetupError
    if fault is not None and fault not in faults:
        raise SetupError(f"fault {fault!r} is not planted at {level} for {family} ({level} faults: "
                         f"{', '.join(faults)})")


@contextlib.contextmanager
def planted(faults: dict, fault: str | None) -> Iterator[None]:
    """The named fault (one of `faults`: name -> context manager factory) planted for the block; None: nothing."""
    if fault is None:
        yield
        return
    with faults[fault]():
        yield


def nan_logprobs(values) -> torch.Tensor:
    """A reference's per-step logprobs (None on ODE steps) as a tensor with NaN there."""
    return torch.tensor([float("nan") if x is None else float(x) for x in values])


class LogprobIdentity:
    """C2 on one engine: its rollouts (the fault planted around them) and the checks that compare their logprobs,
    named under `prefix`. The family supplies the requests and the reference; the check sequence is shared."""

    def __init__(self, prefix: str, engine, faults: dict, fault: str | None):
        from optimized.training.records import CaptureSpec
        self.prefix, self.engine, self.faults, self.fault = prefix, engine, faults, fault
        self.batch_invariant = CaptureSpec(latents=True, batch_invariant=True)
        self.checks: list[CheckResult] = []

    def run(self, reqs, capture=None):
        from optimized.training.rollout import rollout
        with planted(self.faults, self.fault):
            return rollout(self.engine, reqs, capture or self.batch_invariant)

    def identity(self, name: str, sample, want_steps=None, use_cache=True) -> None:
        """The engine's recompute of a rollout's record reproduces its logprobs exactly (and its tables)."""
        from optimized.training.recompute import recompute_logprobs
        rc = recompute_logprobs(self.engine, sample.record, sample.request, use_cache=use_cache)
        self.checks.append(logprob_check(f"{self.prefix}/{name}", sample.record.logprob, rc.logprob, 0.0,
                                         want_steps))
        if len(sample.record.modalities) > 1:  # each modality too: the sample check alone could hide a swap
            self.per_modality(name, sample.record, rc.logprobs, 0.0)
        if rc.table_mismatch:
            self.checks.append(exact_check(f"{self.prefix}/{name}:tables", False, rc.table_mismatch))

    def single_cases(self, cases: dict) -> dict:
        """One rollout per named request, in one batch; each identical to its recompute (`sde_window`: steps 1, 2)."""
        samples = dict(zip(cases, self.run(list(cases.values()))))
        for name, s in samples.items():
            self.identity(name, s, want_steps=[1, 2] if name == "sde_window" else None)
        return samples

    def without_cache(self, name: str, samples: dict, cases: dict, cache: str) -> None:
        """The prompt cache (`cache` names it) changes nothing: a recompute and a rollout that compute afresh."""
        from optimized.training.recompute import cache_use
        s = samples[name]
        self.identity(f"{name}/recompute_without_{cache}_cache", s, use_cache=False)
        with cache_use(self.engine.model, False):
            cold, = self.run([cases[name]])
        self.checks.append(logprob_check(f"{self.prefix}/{name}/rollout_without_{cache}_cache", s.record.logprob,
                                         cold.record.logprob, 0.0))

    def group_of_8(self, group: list, serving_tol: float) -> None:
        """8 requests in one batch vs each alone (identical), and plain batched forwards vs alone (serving_tol)."""
        from optimized.training.records import CaptureSpec
        batched = self.run(group)
        alone = [self.run([r])[0] for r in group]
        sizes = sorted({b for x in batched for b in x.record.batch_sizes})
        self.checks.append(exact_check(f"{self.prefix}/batch8/ran_as_one_batch", sizes == [8], f"batch sizes {sizes}"))
        for k in (0, 7):
            self.checks.append(logprob_check(f"{self.prefix}/batch8/sample{k}_vs_alone", alone[k].record.logprob,
                                             batched[k].record.logprob, 0.0))
            self.identity(f"batch8/sample{k}", batched[k])
        serving = self.run(group, CaptureSpec(latents=True, batch_invariant=False))
        self.checks.append(logprob_check(f"{self.prefix}/batch8_serving_batched/sample3_vs_alone",
                                         alone[3].record.logprob, serving[3].record.logprob, serving_tol))

    def per_modality(self, name: str, record, other: dict, tol: float) -> None:
        """`{name}:{m}` for every stepped modality m: the record's logprobs of m vs `other[m]` (a tensor, or a
        reference's per-step list), within tol."""
        missing = [m for m in record.modalities if m not in other]
        if missing:
            self.checks.append(exact_check(f"{self.prefix}/{name}:modalities", False,
                                           f"no logprobs for {missing}: the record steps {record.modalities}, the "
                                           f"other side {sorted(other)}"))
        for m in record.modalities:
            if m in other:
                theirs = other[m] if isinstance(other[m], torch.Tensor) else nan_logprobs(other[m])
                self.checks.append(logprob_check(f"{self.prefix}/{name}:{m}", record.logprobs[m], theirs, tol))

    def against_reference(self, names, samples: dict, recompute, resample, tol: float) -> None:
        """The readable reference recomputes each record (`recompute(sample)`) and re-samples its seed
        (`resample(request)`), both as `ReferenceLogprobs`, within tol: the sample's logprob, and for a
        multi-modality sample every modality's."""
        for name in names:
            s = samples[name]
            for kind, theirs in (("reference_recompute", recompute(s)), ("reference_rollout", resample(s.request))):
                self.checks.append(logprob_check(f"{self.prefix}/{name}/{kind}", s.record.logprob,
                                                 nan_logprobs(theirs.sample), tol))
                if len(s.record.modalities) > 1:
                    self.per_modality(f"{name}/{kind}", s.record, theirs.by_modality, tol)

    def after_weight_update(self, warm, new_weights, cache: str) -> None:
        """A prompt cached under policy-v1, the weights updated to policy-v2 (the fault planted around the update):
        the record carries the new version and recomputes identically without the `cache` cache."""
        self.run([warm])  # the prompt's cache entries are now under policy-v1
        with planted(self.faults, self.fault):
            update = self.engine.update_weights(new_weights, "policy-v2")
        after, = self.run([warm])
        self.checks.append(exact_check(f"{self.prefix}/weight_update/record_version",
                                       after.record.weights_version == "policy-v2",
                                       f"record carries {after.record.weights_version!r}, update {update}"))
        self.identity(f"weight_update/recompute_without_{cache}_cache", after, use_cache=False)


def rollout_set(engine, requests: list, faults: dict, fault: str | None) -> SampleSet:
    """The engine's rollouts of `requests` in one batch (the fault planted), as a sample set."""
    from optimized.training.records import CaptureSpec
    from optimized.training.rollout import rollout
    with planted(faults, fault):
        samples = rollout(engine, requests, CaptureSpec())
    return sample_set([s.latents["vision"] for s in samples], [s.record.logprob for s in samples])


def mixed_batch_set(engine, requests: list, background, faults: dict, fault: str | None) -> SampleSet:
    """The same requests submitted one per tick, every 4th beside `background(k)` (a request of another prompt),
    on an engine of small max_batch (allowed nondeterminism: batch composition)."""
    from optimized.training.rollout import submit_rollout
    handles = []
    with planted(faults, fault):
        for k, r in enumerate(requests):
            handles.append(submit_rollout(engine, r))
            if k % 4 == 0:
                engine.submit(background(k))
            engine.step()
        engine.run_until_idle()
    results = [h.result() for h in handles]
    return sample_set([r["latents"]["vision"] for r in results], [r["behavior"].logprob for r in results])


@dataclass
class ReferenceLogprobs:
    """A reference's logprobs of one sample, per step (None on ODE steps): per stepped modality and as a whole."""
    by_modality: dict[str, list]
    sample: list


@dataclass
class RolloutSides:
    """How one family draws K rollouts per side for C3, each from a block of seeds (keyword args: the knobs)."""
    reference: object   # (seeds, **knobs) -> SampleSet: the readable reference
    engine: object      # (seeds, **knobs) -> SampleSet: the engine, K requests in one batch
    mixed: object       # (seeds) -> SampleSet: the engine in small batches beside other requests


C3_ALPHA = 0.01
C3_BASE = {"noise_level": 0.7, "guidance": 5.0}                                  # every request's knobs
C3_CONTROLS = {"noise_level": dict(noise_level=0.75), "guidance": dict(guidance=5.5)}   # must be detected
C3_POWER_SWEEP = (0.02, 0.04, 0.07, 0.1, 0.2)   # relative perturbations tried, smallest first


def guidance_drift(module):
    """The planted C3 fault: the engine's CFG combine (`module.cfg_combine`) uses 1.1 x the request's guidance."""
    return _patched(module, "cfg_combine", lambda original: lambda c, u, scale: original(c, u, scale * 1.1))


def engine_sides(reference, engine, small_engine, request, background, faults: dict,
                 fault: str | None) -> RolloutSides:
    """The C3 sides of one family: `reference(seeds, **knobs)`, `engine` for one batch, `small_engine()` (max_batch
    3) for the mixed side, `request(seed, **knobs)`, `background(k)` beside the mixed side's requests."""
    return RolloutSides(
        reference=reference,
        engine=lambda seeds, **kw: rollout_set(engine, [request(s, **kw) for s in seeds], faults, fault),
        mixed=lambda seeds: mixed_batch_set(small_engine(), [request(s) for s in seeds], background, faults, fault))


def rollout_distribution_checks(prefix: str, sides: RolloutSides, k: int, progress, alpha: float = C3_ALPHA,
                                base: dict[str, float] = C3_BASE, controls: dict[str, dict] = C3_CONTROLS,
                                power_sweep: tuple[float, ...] = C3_POWER_SWEEP) -> list[CheckResult]:
    """C3 for one model and dtype: K seeded SDE rollouts per side, disjoint seed blocks, compared as distributions
    (two_sample_tests, Bonferroni over the tests at alpha):

        reference_vs_engine     the reference vs the engine (K requests in one batch)               must NOT differ
        batch_composition       the engine in one batch vs the engine in batches of 3 beside other
                                requests (allowed nondeterminism)                                   must NOT differ
        control/noise_level     the engine at noise_level 0.75 vs the reference at 0.7              must differ
        control/guidance        the engine at guidance 5.5 vs the reference at 5.0                  must differ
        power/<knob>            the smallest relative perturbation of each knob detected at K (a sweep); it must
                                be no larger than the control's
    """
    seeds = lambda block: range(block * k, (block + 1) * k)   # disjoint seed blocks: independent samples
    progress(f"[C3] {prefix}: K={k} rollouts per side")
    reference = sides.reference(seeds(0))
    checks = [distribution_check(f"{prefix}/reference_vs_engine", two_sample_tests(
        reference, sides.engine(seeds(1))), alpha, expect_same=True)]
    batched = sides.engine(seeds(2))
    mixed = sides.mixed(seeds(3))
    checks.append(distribution_check(f"{prefix}/batch_composition", two_sample_tests(batched, mixed), alpha,
                                     expect_same=True))
    progress(f"[C3] {prefix}: perturbed controls and power")
    for block, (knob, kw) in enumerate(controls.items(), start=4):
        tests = two_sample_tests(reference, sides.engine(seeds(block), **kw))
        checks.append(distribution_check(f"{prefix}/control/{knob}", tests, alpha, expect_same=False))
    for block, knob in enumerate(base, start=6):
        detected, swept = None, {}
        for rel in power_sweep:
            other = sides.engine(seeds(block), **{knob: base[knob] * (1 + rel)})
            tests = two_sample_tests(reference, other)
            _, p = min_p(tests)
            swept[rel] = p
            if p <= alpha / len(tests):
                detected = rel
                break
        control = controls[knob][knob] / base[knob] - 1
        ok = detected is not None and detected <= control + 1e-9
        detail = (f"smallest detected perturbation at K={k}: {knob} x (1 + {detected})" if detected is not None
                  else f"no perturbation up to {power_sweep[-1]:.0%} detected at K={k}")
        checks.append(CheckResult(f"{prefix}/power/{knob}", ok, detail=detail,
                                  extra={"min_p_by_perturbation": swept, "control": control}))
    return checks
