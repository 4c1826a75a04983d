"""Readable step / residual caches for the reference Wan loop, one request and one CFG branch at a time.

Each acceleration is written out as upstream runs it (manifests/accel/caches.py names the upstream code):

    fbcache      block 0 always; r = out0 - in0; compute the rest iff no r_prev or mean|r - r_prev| / mean|r_prev| >
                 threshold (then r_prev = r and tail = outL - out0); else out = tail + out0.
    dbcache      blocks [0, Fn) always; r = x_Fn - x_0; warmup steps, max_cached, max_continuous and the accumulated
                 diff can forbid the cache; reuse iff diff < threshold: x = middle + x_Fn; then blocks [L - Bn, L).
    taylorseer   (lite) full steps store Taylor factors of the output; other steps sum the expansion.
    magcache     after the retention steps, accumulate ratio and error from the mag_ratios; skip all blocks while the
                 error and the skipped-step count allow it: out = in + last residual of the whole stack.
    guidance_interval  the uncond branch runs only on steps in [start, end).
    cfg_delta    the uncond branch runs on warmup / interval / cooldown steps and keeps cond - uncond; on the other
                 steps uncond = this step's cond output - that difference.

Every call returns the branch's DiT output (None when the branch does not run) and one AccelDecision, so C1 under
an acceleration can compare the engine's decisions with these first, tensors second.
"""

from __future__ import annotations

import math

import torch

from manifests.accel import AccelDecision, AccelSpec, AccelSpecError
from manifests.accel import sparse as sparse_kinds
from manifests.accel.caches import mag_ratios
from reference.wan.transformer import WanTransformer, attention

_FACTOR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def relative_change(new: torch.Tensor, old: torch.Tensor) -> float:
    """mean |new - old| / mean |old|, in the tensors' own dtype."""
    return ((new - old).abs().mean() / old.abs().mean()).item()


class BranchCache:
    """The cache of one request's one CFG branch ("cond" or "uncond") for a whole denoising run."""

    def __init__(self, spec: AccelSpec, branch: str, num_steps: int, num_layers: int):
        self.spec, self.branch, self.num_steps, self.L = spec, branch, num_steps, num_layers
        self.knob = spec.get
        self.is_sparse = spec.name in {k.name for k in sparse_kinds.KINDS}
        if spec.name == "fbcache" and num_layers < 2:
            raise AccelSpecError("accel fbcache: needs a DiT of at least 2 blocks (a head and a tail)")
        if spec.name == "dbcache" and int(self.knob("fn")) + int(self.knob("bn")) > num_layers:
            raise AccelSpecError(f"accel dbcache: fn + bn exceeds the DiT's {num_layers} blocks")
        # what the caches remember between steps
        self.first_residual = None     # fbcache / dbcache: residual of the first blocks at the last computed step
        self.middle_residual = None    # fbcache / dbcache: what the skipped blocks added at the last computed step
        self.stack_residual = None     # magcache: what the whole stack added at the last computed step
        self.factors = None            # taylorseer: {order: tensor}
        self.last_full_step = None     # taylorseer
        self.cached_steps = []         # dbcache
        self.streak = 0                # dbcache: consecutive cached steps
        self.diff_sum = 0.0            # dbcache: accumulated positive diffs
        self.diff_seen = set()         # dbcache: steps whose diff is already counted
        self.ratio, self.error, self.skipped = 1.0, 0.0, 0   # magcache accumulators
        self.cfg_delta_last = None     # cfg_delta (uncond branch): cond - uncond of the last step that ran both
        if spec.name == "magcache":
            ratios = torch.tensor(mag_ratios(self.knob("ratios")))   # fp32, as upstream's torch.tensor(list)
            if len(ratios) != num_steps:   # nearest interpolation to the run's steps (upstream nearest_interp)
                if num_steps == 1:
                    ratios = ratios[-1:]
                else:
                    scale = (len(ratios) - 1) / (num_steps - 1)
                    ratios = ratios[torch.round(torch.arange(num_steps, dtype=torch.float32) * scale).long()]
            self.mag_ratios = ratios

    # ------------------------------------------------------------------ one step
    def forward(self, model: WanTransformer, step: int, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                image_embeds: torch.Tensor | None, sparse_attention=None, cond_output: torch.Tensor | None = None):
        """(DiT output or None, AccelDecision) of this branch at `step`; `cond_output`: the cond branch's output of
        this step (the uncond branch of cfg_delta predicts from it)."""
        name = self.spec.name
        if name == "cfg_delta":
            return self.cfg_delta(model, step, x, timestep, text, image_embeds, cond_output)
        if name == "guidance_interval":
            start, end = int(self.knob("start")), self.knob("end")
            inside = start <= step and (end is None or step < int(end))
            if self.branch == "uncond" and not inside:
                return None, AccelDecision(step, self.branch, "skip")
            return model(x, timestep, text, image_embeds), AccelDecision(step, self.branch, "compute",
                                                                         blocks_computed=(0, self.L))
        if name == "taylorseer":
            return self.taylorseer(model, step, x, timestep, text, image_embeds)

        tokens, context, modulation, rope, temb, grid = model.embed(x, timestep, text, image_embeds)
        skipped = [0]

        def attend_in(block_index):
            if not self.is_sparse:
                return attention

            def attend(q, k, v):
                out, n = sparse_attention(q, k, v, grid, self.spec, step=step, block=block_index)
                skipped[0] += int(n)
                return out
            return attend

        def blocks(h, start, end):
            for i in range(start, end):
                h = model.blocks[i](h, context, modulation, rope, self_attention=attend_in(i))
            return h

        if name == "fbcache":
            h, decision = self.fbcache(step, tokens, blocks)
        elif name == "dbcache":
            h, decision = self.dbcache(step, tokens, blocks)
        elif name == "magcache":
            h, decision = self.magcache(step, tokens, blocks)
        elif self.is_sparse:
            h = blocks(tokens, 0, self.L)
            decision = AccelDecision(step, self.branch, "compute", blocks_computed=(0, self.L), keys_skipped=skipped[0])
        else:
            raise AccelSpecError(f"accel {name}: not available in the reference wan loop")
        return model.head(h, temb, grid), decision

    # ------------------------------------------------------------------ the rules
    def fbcache(self, step, x0, blocks):
        x1 = blocks(x0, 0, 1)
        r = x1 - x0
        diff = None if self.first_residual is None else relative_change(r, self.first_residual)
        if diff is not None and not diff > float(self.knob("threshold")):
            return self.middle_residual + x1, AccelDecision(step, self.branch, "reuse", blocks_computed=(0, 1),
                                                            blocks_reused=(1, self.L), metric=diff)
        self.first_residual = r                          # only a computed step replaces the reference residual
        out = blocks(x1, 1, self.L)
        self.middle_residual = out - x1
        return out, AccelDecision(step, self.branch, "compute", blocks_computed=(0, self.L), metric=diff)

    def dbcache(self, step, x0, blocks):
        fn, bn, L = int(self.knob("fn")), int(self.knob("bn")), self.L
        threshold = float(self.knob("threshold"))
        if self.cached_steps[-1:] != [step - 1]:         # the previous step computed: the streak is broken
            self.streak = 0
        h = blocks(x0, 0, fn)
        r = h - x0
        diff, reuse = None, False
        max_cached, max_streak = int(self.knob("max_cached")), int(self.knob("max_continuous"))
        max_acc = self.knob("max_accumulated_diff")
        allowed = (step not in range(0, int(self.knob("warmup")), int(self.knob("warmup_interval")))
                   and not (max_cached >= 0 and len(self.cached_steps) >= max_cached)
                   and not (max_streak >= 0 and self.streak >= max_streak)
                   and not (max_acc is not None and max_acc > 0 and self.diff_sum >= max_acc)
                   and threshold > 0.0 and self.first_residual is not None)
        if allowed:
            if threshold >= 1.0:
                diff, reuse = -1.0, True                 # (upstream) "always similar", recorded as -1
            elif self.first_residual.shape != r.shape:
                diff = -2.0
            else:
                diff = relative_change(r, self.first_residual)
                reuse = diff < threshold
            if step not in self.diff_seen:
                self.diff_seen.add(step)
                self.diff_sum += diff if diff > 0 else 0.0
        if reuse:
            self.cached_steps.append(step)
            self.streak += 1
            h = blocks(self.middle_residual + h, L - bn, L)
            return h, AccelDecision(step, self.branch, "reuse", blocks_computed=(0, fn), blocks_reused=(fn, L - bn),
                                    metric=diff)
        self.first_residual = r
        middle = blocks(h, fn, L - bn)
        self.middle_residual = middle - h
        return blocks(middle, L - bn, L), AccelDecision(step, self.branch, "compute", blocks_computed=(0, L),
                                                        metric=diff)

    def magcache(self, step, x0, blocks):
        skip, metric = False, None
        if step >= int(float(self.knob("retention")) * self.num_steps + 0.5):
            self.ratio = self.ratio * self.mag_ratios[step]
            self.skipped += 1
            self.error = self.error + abs(1.0 - self.ratio)
            metric = float(self.error)
            if self.stack_residual is not None and self.error <= float(self.knob("threshold")) \
                    and self.skipped <= int(self.knob("max_skip")):
                skip = True
            else:
                self.ratio, self.skipped, self.error = 1.0, 0, 0.0
        if skip:
            return x0 + self.stack_residual, AccelDecision(step, self.branch, "reuse", blocks_reused=(0, self.L),
                                                           metric=metric)
        out = blocks(x0, 0, self.L)
        self.stack_residual = out - x0
        return out, AccelDecision(step, self.branch, "compute", blocks_computed=(0, self.L), metric=metric)

    def cfg_delta(self, model, step, x, timestep, text, image_embeds, cond_output):
        warmup, interval, cooldown = int(self.knob("warmup")), int(self.knob("interval")), int(self.knob("cooldown"))
        runs = step < warmup or (step - warmup) % interval == 0 or step >= self.num_steps - cooldown
        if self.branch == "uncond" and not runs and self.cfg_delta_last is not None:
            return cond_output - self.cfg_delta_last, AccelDecision(step, self.branch, "predict")
        out = model(x, timestep, text, image_embeds)
        if self.branch == "uncond":
            self.cfg_delta_last = cond_output - out        # cond - uncond of the last step that ran both
        return out, AccelDecision(step, self.branch, "compute", blocks_computed=(0, self.L))

    def taylorseer(self, model, step, x, timestep, text, image_embeds):
        before, interval, after = int(self.knob("before")), int(self.knob("interval")), self.knob("after")
        full = step < before or (step - before - 1) % interval == 0 or (after is not None and step >= int(after))
        dtype = _FACTOR_DTYPES[str(self.knob("factors_dtype"))]
        if full:
            out = model(x, timestep, text, image_embeds)
            factors = {0: out}
            if self.last_full_step is not None:          # finite differences of the stored (rounded) factors
                gap = step - self.last_full_step
                for order in range(int(self.knob("order"))):
                    if order not in self.factors or self.factors[order].shape != factors[order].shape:
                        break
                    factors[order + 1] = (factors[order] - self.factors[order].to(out.dtype)) / gap
            self.factors = {k: v.to(dtype) for k, v in factors.items()}
            self.last_full_step = step
            return out, AccelDecision(step, self.branch, "compute", blocks_computed=(0, self.L))
        if self.factors is None:
            raise ValueError("taylorseer: cannot predict before a full step")
        out_dtype = next(model.parameters()).dtype
        gap = step - self.last_full_step
        out = torch.zeros_like(self.factors[0], dtype=out_dtype)
        for order in range(len(self.factors)):
            out = out + self.factors[order].to(out_dtype) * ((gap ** order) / math.factorial(order))
        return out, AccelDecision(step, self.branch, "predict")
