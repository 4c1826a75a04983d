"""The decision rules of the step / residual caches, one small typed class per kind, one instance per request AND CFG
branch (upstream keeps one state per cache context: diffusers' `cache_context("cond" / "uncond")`, cache-dit's
separate-CFG buffers). Model-agnostic: a rule sees step indices, scalars and the residual tensors the engine hands
it, never a model family. The tensors themselves live in the engine's cache store (`residual.ResidualCache`).

Semantics are the upstream ones named in manifests/accel/caches.py; the quirks are commented where they bite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from manifests.accel import AccelSpec, AccelSpecError
from manifests.accel.caches import mag_ratios

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """mean|current - previous| / mean|previous| (FBCache and DBCache compute it this way, in the tensors' dtype)."""
    return ((current - previous).abs().mean() / previous.abs().mean()).item()


# ------------------------------------------------------------------------------------------------ per-step plans
@dataclass(frozen=True)
class StepPlan:
    """What a branch does this step before any tensor is seen.

    action: "skip" (the branch is not run: guidance interval), "predict" (no forward: TaylorSeer), "from_cond" (no
    forward: the request's cond output of this step minus the stored CFG delta), "reuse" (no block runs: MagCache),
    "compute" (every block), "decide" (run blocks [0, decide_at), then `decide`)."""
    action: str
    decide_at: int = 0


class BranchRule:
    """Base: one request's one CFG branch. `plan(step)` first; "decide" plans then call `decide`."""
    kind: str = ""

    def plan(self, step: int) -> StepPlan:
        return StepPlan("compute")

    def after(self, step: int, action: str) -> None:
        """Bookkeeping once the step ran (`action` is what actually happened)."""


# ------------------------------------------------------------------------------------------------ fbcache
@dataclass
class FirstBlockRule(BranchRule):
    """diffusers FBCHeadBlockHook: block 0 always runs; compute the rest iff no previous residual or diff > threshold.
    The previous head residual is only replaced on compute steps (a reuse keeps comparing with the last compute)."""
    threshold: float
    kind: str = "fbcache"

    def plan(self, step: int) -> StepPlan:
        return StepPlan("decide", decide_at=1)

    def decide(self, step: int, head_residual: torch.Tensor,
               previous: torch.Tensor | None) -> tuple[bool, float | None]:
        """(reuse?, metric)."""
        if previous is None:
            return False, None
        diff = relative_l1(head_residual, previous)
        return not diff > self.threshold, diff   # (upstream) `diff > threshold` computes: equality reuses


# ------------------------------------------------------------------------------------------------ dbcache
@dataclass
class DualBlockRule(BranchRule):
    """cache-dit DBCache for one branch (its separate-CFG buffers and counters are per branch)."""
    fn: int
    bn: int
    threshold: float
    warmup: int
    warmup_interval: int
    max_cached: int
    max_continuous: int
    max_accumulated: float | None
    kind: str = "dbcache"
    cached_steps: list[int] = field(default_factory=list)
    continuous: int = 0
    accumulated_diff: float = 0.0
    diffs: dict[int, float] = field(default_factory=dict)

    def plan(self, step: int) -> StepPlan:
        # (upstream) mark_step_begin: a step that does not follow a cached one breaks the streak
        if not self.cached_steps or self.cached_steps[-1] != step - 1:
            self.continuous = 0
        return StepPlan("decide", decide_at=self.fn)

    def _record(self, step: int, diff: float) -> None:
        if step not in self.diffs:                 # (upstream) add_residual_diff keeps the first diff of a step
            self.diffs[step] = diff
            if diff > 0.0:
                self.accumulated_diff += diff

    def decide(self, step: int, fn_residual: torch.Tensor, previous: torch.Tensor | None) -> tuple[bool, float | None]:
        if step in range(0, self.warmup, self.warmup_interval):
            return False, None
        if self.max_cached >= 0 and len(self.cached_steps) >= self.max_cached:
            return False, None
        if self.max_continuous >= 0 and self.continuous >= self.max_continuous:
            return False, None
        if self.max_accumulated is not None and self.max_accumulated > 0.0 \
                and self.accumulated_diff >= self.max_accumulated:
            return False, None
        if self.threshold <= 0.0 or previous is None:
            return False, None
        if self.threshold >= 1.0:                  # (upstream) similarity(): >= 1 is "always similar", diff -1
            self._record(step, -1.0)
            return True, -1.0
        if previous.shape != fn_residual.shape:
            self._record(step, -2.0)
            return False, -2.0
        diff = relative_l1(fn_residual, previous)
        self._record(step, diff)
        return diff < self.threshold, diff

    def after(self, step: int, action: str) -> None:
        if action == "reuse":
            self.cached_steps.append(step)
            self.continuous += 1


# ------------------------------------------------------------------------------------------------ taylorseer
@dataclass
class TaylorSeerRule(BranchRule):
    """diffusers TaylorSeer (lite): the DiT output is cached as Taylor factors, predicted between full steps."""
    interval: int
    before: int
    after_step: int | None
    order: int
    factors_dtype: torch.dtype
    kind: str = "taylorseer"
    last_update: int | None = None

    def computes(self, step: int) -> bool:
        warm = step < self.before
        # (upstream) (step - before - 1) % interval: step `before` itself is predicted unless interval == 1
        on_interval = (step - self.before - 1) % self.interval == 0
        cool = self.after_step is not None and step >= self.after_step
        return warm or on_interval or cool

    def plan(self, step: int) -> StepPlan:
        if self.computes(step):
            return StepPlan("compute")
        if self.last_update is None:
            raise ValueError("taylorseer: cannot predict before a full step (upstream raises the same)")
        return StepPlan("predict")

    def update(self, step: int, output: torch.Tensor,
               previous: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor]:
        """New factors from this step's output (TaylorSeerState.update)."""
        new = {0: output}
        if self.last_update is not None and previous is not None:
            delta = step - self.last_update
            for j in range(self.order):
                prev = previous.get(j)
                if prev is None or prev.shape != new[j].shape:
                    break
                new[j + 1] = (new[j] - prev.to(output.dtype)) / delta
        self.last_update = step
        return {k: v.to(self.factors_dtype) for k, v in new.items()}

    def predict(self, step: int, factors: dict[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        offset = step - self.last_update
        out = torch.zeros_like(factors[0], dtype=dtype)
        for k in range(len(factors)):
            out = out + factors[k].to(dtype) * ((offset ** k) / math.factorial(k))
        return out


# ------------------------------------------------------------------------------------------------ magcache
def nearest_interp(ratios: torch.Tensor, n: int) -> torch.Tensor:
    """diffusers mag_cache.nearest_interp (fp32 grid, torch.round)."""
    if n == 1:
        return ratios[-1:]
    scale = (len(ratios) - 1) / (n - 1)
    return ratios[torch.round(torch.arange(n, dtype=torch.float32) * scale).long()]


@dataclass
class MagCacheRule(BranchRule):
    """diffusers MagCacheHeadHook for one branch; the accumulators are fp32 tensors as upstream's become."""
    threshold: float
    max_skip: int
    retention: float
    ratios: torch.Tensor                            # fp32 [num_steps] (interpolated)
    num_steps: int
    kind: str = "magcache"
    acc_ratio: object = 1.0
    acc_err: object = 0.0
    acc_steps: int = 0
    has_residual: bool = False
    last_metric: float | None = None

    def plan(self, step: int) -> StepPlan:
        skip = False
        scale = self.ratios[step] if step < len(self.ratios) else 1.0
        if step >= int(self.retention * self.num_steps + 0.5):
            self.acc_ratio = self.acc_ratio * scale
            self.acc_steps += 1
            self.acc_err = self.acc_err + abs(1.0 - self.acc_ratio)
            self.last_metric = float(self.acc_err)
            if self.has_residual and self.acc_err <= self.threshold and self.acc_steps <= self.max_skip:
                skip = True
            else:
                self.acc_ratio, self.acc_steps, self.acc_err = 1.0, 0, 0.0
        else:
            self.last_metric = None
        return StepPlan("reuse" if skip else "compute")

    def after(self, step: int, action: str) -> None:
        if action == "compute":
            self.has_residual = True


# ------------------------------------------------------------------------------------------------ guidance interval
@dataclass
class GuidanceIntervalRule(BranchRule):
    start: int
    end: int | None
    branch: str
    kind: str = "guidance_interval"

    def plan(self, step: int) -> StepPlan:
        inside = self.start <= step and (self.end is None or step < self.end)
        return StepPlan("compute" if self.branch == "cond" or inside else "skip")


# ------------------------------------------------------------------------------------------------ cfg delta
@dataclass
class CfgDeltaRule(BranchRule):
    """The uncond branch runs on warmup / interval / cooldown steps and files cond - uncond; on the others it is
    predicted as this step's cond output minus that delta (no forward). The cond branch always computes."""
    warmup: int
    interval: int
    cooldown: int
    num_steps: int
    branch: str
    kind: str = "cfg_delta"

    def refreshes(self, step: int) -> bool:
        return (self.branch == "cond" or step < self.warmup or (step - self.warmup) % self.interval == 0
                or step >= self.num_steps - self.cooldown)

    def plan(self, step: int) -> StepPlan:
        return StepPlan("compute" if self.refreshes(step) else "from_cond")


CACHE_KINDS = ("fbcache", "dbcache", "taylorseer", "magcache", "guidance_interval", "cfg_delta")


def make_rule(spec: AccelSpec, branch: str, num_steps: int, num_layers: int) -> BranchRule:
    """The rule of `spec` for one branch of a request of `num_steps` steps on a `num_layers`-block DiT."""
    g = spec.get
    if spec.name == "fbcache":
        if num_layers < 2:
            raise AccelSpecError("accel fbcache: needs a DiT of at least 2 blocks (a head and a tail)")
        return FirstBlockRule(float(g("threshold")))
    if spec.name == "dbcache":
        fn, bn = int(g("fn")), int(g("bn"))
        if fn + bn > num_layers:
            raise AccelSpecError(f"accel dbcache: fn + bn = {fn + bn} exceeds the DiT's {num_layers} blocks")
        acc = g("max_accumulated_diff")
        return DualBlockRule(fn, bn, float(g("threshold")), int(g("warmup")), int(g("warmup_interval")),
                             int(g("max_cached")), int(g("max_continuous")), None if acc is None else float(acc))
    if spec.name == "taylorseer":
        after = g("after")
        return TaylorSeerRule(int(g("interval")), int(g("before")), None if after is None else int(after),
                              int(g("order")), _DTYPES[str(g("factors_dtype"))])
    if spec.name == "magcache":
        ratios = torch.tensor(mag_ratios(g("ratios")))   # (upstream) torch.tensor(list): fp32
        if len(ratios) != num_steps:
            ratios = nearest_interp(ratios, num_steps)
        return MagCacheRule(float(g("threshold")), int(g("max_skip")), float(g("retention")), ratios, num_steps)
    if spec.name == "guidance_interval":
        end = g("end")
        return GuidanceIntervalRule(int(g("start")), None if end is None else int(end), branch)
    if spec.name == "cfg_delta":
        return CfgDeltaRule(int(g("warmup")), int(g("interval")), int(g("cooldown")), num_steps, branch)
    raise AccelSpecError(f"accel {spec.name}: not a step / residual cache")
