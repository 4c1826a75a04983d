"""One batched DiT step under step / residual caches, for rows that made different decisions.

A row is one request's one CFG branch. Before any tensor is seen each row's rule plans the step: "skip" (the branch
does not run), "predict" (TaylorSeer: no forward), "from_cond" (cfg_delta: the request's cond output minus the stored
CFG delta, no forward), "reuse" (MagCache: no block runs), "compute", or "decide" at
block k (FBCache k = 1, DBCache k = Fn). Every row that runs shares ONE embedding call, then the block stack runs
segment by segment between the rows' decision points: a segment's blocks run once for all the rows still computing
there (a reused row leaves the batch at its decision point and rejoins it for its last Bn blocks), and one head call
finishes every row. The model is reached only through `CachedStack` (embed / run_blocks / head): the runtime never
names a family.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from manifests.accel import AccelDecision
from optimized.accel.residual import ResidualCache, ResidualOwner, detach
from optimized.accel.rules import (
    BranchRule,
    CfgDeltaRule,
    DualBlockRule,
    MagCacheRule,
    StepPlan,
    TaylorSeerRule,
)


class CachedStack(Protocol):
    """What a DiT exposes to the caches: its embedding, any block range on any rows, its output head."""
    num_layers: int
    dtype: torch.dtype

    keys_skipped: list[int]          # per embedded row: attention pairs a sparse mask removed (0 without one)

    def embed(self, inputs: Sequence[Any], steps: list[int]) -> Any:
        """The rows' embeddings (a batch object with `x`: the block stack's input [B, N, D]); `steps`: each row's
        denoising step."""

    def run_blocks(self, batch: Any, x: torch.Tensor, rows: list[int], start: int, end: int) -> torch.Tensor:
        """Blocks [start, end) on x [len(rows), N, D], rows = indices into the embedded batch."""

    def head(self, batch: Any, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The output head on x [len(rows), N, D] -> one output per row (batch dim first)."""


@dataclass
class AccelRow:
    owner: ResidualOwner
    branch: str                     # "cond" | "uncond"
    rule: BranchRule
    step: int                       # the request's step index


def _bn(rule: BranchRule) -> int:
    return rule.bn if isinstance(rule, DualBlockRule) else 0


def cached_forward(stack: CachedStack, inputs: Sequence[Any], rows: Sequence[AccelRow], cache: ResidualCache
                   ) -> tuple[list[torch.Tensor | None], list[AccelDecision]]:
    """Outputs (None for a skipped branch) and one AccelDecision per row, in row order."""
    L = stack.num_layers
    plans: list[StepPlan] = [r.rule.plan(r.step) for r in rows]
    outputs: list[torch.Tensor | None] = [None] * len(rows)
    decisions: list[AccelDecision | None] = [None] * len(rows)
    actions = [p.action for p in plans]
    full = (0, L)

    for j, (r, p) in enumerate(zip(rows, plans)):
        if p.action == "skip":
            decisions[j] = AccelDecision(r.step, r.branch, "skip")
        elif p.action == "predict":
            factors = cache.load(r.owner, r.branch, full, "taylor")
            if factors is None:
                raise RuntimeError(f"taylorseer: the factors of {r.branch} were evicted before step {r.step}")
            outputs[j] = r.rule.predict(r.step, factors, stack.dtype)
            decisions[j] = AccelDecision(r.step, r.branch, "predict")
    cond_row = {rows[j].owner: j for j in range(len(rows)) if rows[j].branch == "cond"}
    deltas: dict[int, torch.Tensor] = {}              # from_cond row -> its stored CFG delta
    for j, (r, p) in enumerate(zip(rows, plans)):
        if p.action == "from_cond":
            delta = cache.load(r.owner, r.branch, full, "cfg_delta")
            if delta is None or r.owner not in cond_row:   # evicted (or no cond row): the branch computes
                actions[j] = "compute"
            else:
                deltas[j] = delta

    run = [j for j, a in enumerate(actions) if a in ("compute", "decide", "reuse")]
    if run:
        batch = stack.embed([inputs[j] for j in run], [rows[j].step for j in run])
        x0 = list(batch.x.split(1))                    # one [1, N, D] per running row, in `run` order
        xs = list(x0)
        pos = {j: i for i, j in enumerate(run)}
        skip_until: dict[int, int] = {}                # row -> first block it runs again (a reused range's end)
        mid_in: dict[int, torch.Tensor] = {}           # row -> input of its middle blocks (computed rows)
        metrics: dict[int, float | None] = {}
        for j in run:
            r = rows[j]
            if actions[j] == "reuse":                  # MagCache: out = in + the last whole-stack residual
                residual = cache.load(r.owner, r.branch, full, "stack_residual")
                if residual is None:                   # evicted: compute, as an empty upstream buffer would
                    actions[j] = "compute"
                else:
                    xs[pos[j]] = xs[pos[j]] + residual
                    skip_until[j] = L
        points = sorted({0, L} | {plans[j].decide_at for j in run if actions[j] == "decide"}
                        | {L - _bn(rows[j].rule) for j in run if actions[j] == "decide"})
        for a, b in zip(points, points[1:] + [None]):
            for j in run:                              # decision points at block a
                r, i = rows[j], pos[j]
                if actions[j] == "decide" and plans[j].decide_at == a:
                    k, end = a, L - _bn(r.rule)
                    residual = xs[i] - x0[i]
                    previous = cache.load(r.owner, r.branch, (0, k), "fn_residual")
                    reuse, metrics[j] = r.rule.decide(r.step, residual, previous)
                    middle = cache.load(r.owner, r.branch, (k, end), "mid_residual") if reuse else None
                    if reuse and middle is not None:
                        xs[i] = (middle + xs[i]).contiguous()   # (upstream) cached residual + current hidden
                        actions[j], skip_until[j] = "reuse", end
                    else:
                        actions[j] = "compute"
                        cache.store_value(r.owner, r.branch, (0, k), "fn_residual", detach(residual))
                        mid_in[j] = xs[i]
                if j in mid_in and L - _bn(r.rule) == a:
                    k = plans[j].decide_at
                    cache.store_value(r.owner, r.branch, (k, a), "mid_residual", detach(xs[i].contiguous() - mid_in[j]))
            if b is None:
                break
            active = [j for j in run if skip_until.get(j, 0) <= a]
            if active:
                out = stack.run_blocks(batch, torch.cat([xs[pos[j]] for j in active]), [pos[j] for j in active], a, b)
                for j, x in zip(active, out.split(1)):
                    xs[pos[j]] = x
        for j in run:
            r = rows[j]
            if isinstance(r.rule, MagCacheRule) and actions[j] == "compute":
                cache.store_value(r.owner, r.branch, full, "stack_residual", detach(xs[pos[j]] - x0[pos[j]]))
        heads = stack.head(batch, torch.cat(xs), list(range(len(run)))).split(1)
        for j, h in zip(run, heads):
            r = rows[j]
            outputs[j] = h
            if isinstance(r.rule, TaylorSeerRule):
                previous = cache.load(r.owner, r.branch, full, "taylor")
                cache.store_value(r.owner, r.branch, full, "taylor", r.rule.update(r.step, h, previous))
            metric = metrics.get(j, getattr(r.rule, "last_metric", None))
            skipped = stack.keys_skipped[pos[j]] if stack.keys_skipped else 0
            if actions[j] == "reuse":
                k = plans[j].decide_at
                decisions[j] = AccelDecision(r.step, r.branch, "reuse", blocks_computed=(0, k) if k else None,
                                             blocks_reused=(k, skip_until[j]), metric=metric, keys_skipped=skipped)
            else:
                decisions[j] = AccelDecision(r.step, r.branch, "compute", blocks_computed=full, metric=metric,
                                             keys_skipped=skipped)
    for j, r in enumerate(rows):
        if isinstance(r.rule, CfgDeltaRule) and r.branch == "uncond" and r.owner in cond_row:
            cond = outputs[cond_row[r.owner]]
            if j in deltas:                            # this step's cond output minus the last cond - uncond
                outputs[j] = cond - deltas[j]
                decisions[j] = AccelDecision(r.step, r.branch, "predict")
            else:
                cache.store_value(r.owner, r.branch, full, "cfg_delta", detach(cond - outputs[j]))
    for r, d in zip(rows, decisions):
        r.rule.after(r.step, d.action)
    return outputs, list(decisions)
