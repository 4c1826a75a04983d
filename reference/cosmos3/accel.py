"""Readable step / residual caches for the reference cosmos3 loop, one request and one CFG branch at a time.

The cached "block stack" is the gen pathway of the decoder layers: the und (text) stream never sees gen tokens, so
its keys / values for every layer are computed first, whole, and every cache below works on the gen stream alone
(the engine keeps the same text K/V in its und cache). Each rule is the upstream one named in
manifests/accel/caches.py, written out as in reference/wan/accel.py:

    fbcache      gen layer 0 always; r = out0 - in0; the other layers run iff no r_prev or
                 mean|r - r_prev| / mean|r_prev| > threshold (then r_prev = r and tail = outL - out0); else
                 out = tail + out0. (Upstream also adds a tail residual to the und stream; it never reaches a
                 prediction: only the gen stream is decoded.)
    dbcache      gen layers [0, Fn) always; r = g_Fn - g_0; warmup steps, max_cached, max_continuous and the
                 accumulated diff can forbid the cache; reuse iff diff < threshold: g = middle + g_Fn. Bn = 0 only
                 (the request refuses more: cache-dit would feed the last Bn layers a cached text stream).
    magcache     after the retention steps, accumulate ratio and error from the mag_ratios; skip every gen layer
                 while the error and the skipped-step count allow it: out = in + last residual of the whole stack.
    guidance_interval  the uncond branch runs only on steps in [start, end); elsewhere the cond velocity alone.

taylorseer is refused on cosmos3 (manifests/cosmos3/sampling.py ACCEL_REFUSED says why).

Each call returns the branch's prediction (None when the branch does not run) and one AccelDecision.
"""

from __future__ import annotations

import torch

from manifests.accel import AccelDecision, AccelSpec, AccelSpecError
from manifests.accel.caches import mag_ratios
from manifests.cosmos3.io import Cosmos3ForwardInputs
from reference.cosmos3.model import (
    Cosmos3Transformer,
    apply_rope,
    attention,
    mrope_cos_sin,
)
from reference.cosmos3.packing import pack_sample

HONOURED = ("fbcache", "dbcache", "magcache", "guidance_interval")   # what the cosmos3 loop runs


def relative_change(new: torch.Tensor, old: torch.Tensor) -> float:
    """mean |new - old| / mean |old|, in the tensors' own dtype."""
    return ((new - old).abs().mean() / old.abs().mean()).item()


def gen_layer(layer, gen: torch.Tensor, text_k: torch.Tensor, text_v: torch.Tensor, rope_gen) -> torch.Tensor:
    """The gen half of DecoderLayer.forward: gen queries attend to every text key and every gen key, no mask."""
    q, k, v = layer.gen.qkv(gen)
    q, k = apply_rope(q, *rope_gen), apply_rope(k, *rope_gen)
    gen = gen + layer.gen.o_proj(attention(q, torch.cat([text_k, k]), torch.cat([text_v, v]), causal=False))
    return gen + layer.gen.mlp(layer.gen.mlp_norm(gen))


class BranchCache:
    """The cache of one request's one CFG branch ("cond" or "uncond") for a whole denoising run."""

    def __init__(self, spec: AccelSpec, branch: str, num_steps: int, num_layers: int):
        if spec.name not in HONOURED:
            raise AccelSpecError(f"accel {spec.name}: not available in the cosmos3 loop")
        self.spec, self.branch, self.num_steps, self.L = spec, branch, num_steps, num_layers
        self.knob = spec.get
        if spec.name == "fbcache" and num_layers < 2:
            raise AccelSpecError("accel fbcache: needs a DiT of at least 2 blocks (a head and a tail)")
        if spec.name == "dbcache" and int(self.knob("fn")) + int(self.knob("bn")) > num_layers:
            raise AccelSpecError(f"accel dbcache: fn + bn exceeds the DiT's {num_layers} blocks")
        self.first_residual = None     # fbcache / dbcache: residual of the first layers at the last computed step
        self.middle_residual = None    # fbcache / dbcache: what the skipped layers added at the last computed step
        self.stack_residual = None     # magcache: what the whole gen stack added at the last computed step
        self.cached_steps = []         # dbcache
        self.streak = 0                # dbcache: consecutive cached steps
        self.diff_sum = 0.0            # dbcache: accumulated positive diffs
        self.diff_seen = set()         # dbcache: steps whose diff is already counted
        self.ratio, self.error, self.skipped = 1.0, 0.0, 0   # magcache accumulators
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
    def forward(self, model: Cosmos3Transformer, step: int, inp: Cosmos3ForwardInputs):
        """(prediction or None, AccelDecision) of this branch at `step`."""
        name = self.spec.name
        if name == "guidance_interval":
            start, end = int(self.knob("start")), self.knob("end")
            inside = start <= step and (end is None or step < int(end))
            if self.branch == "uncond" and not inside:
                return None, AccelDecision(step, self.branch, "skip")
            return model(inp), AccelDecision(step, self.branch, "compute", blocks_computed=(0, self.L))

        cfg = model.cfg
        inp.validate(cfg)
        packed = pack_sample(cfg, inp)
        hidden = model.embed(inp, packed)
        cos, sin = mrope_cos_sin(cfg, packed.position_ids, hidden.dtype)
        n = packed.text_len
        und, gen0 = hidden[:n], hidden[n:]
        text_kv = []                   # the und stream first, every layer: it never depends on the gen stream
        for layer in model.layers:
            und, k, v = layer.und_forward(und, (cos[:n], sin[:n]))
            text_kv.append((k, v))

        def layers(g, start, end):
            for i in range(start, end):
                g = gen_layer(model.layers[i], g, *text_kv[i], (cos[n:], sin[n:]))
            return g

        gen, decision = getattr(self, name)(step, gen0, layers)
        out = torch.cat([und, model.gen_norm(gen)])
        return model.decode(inp, packed, out, lambda *_: None), decision

    # ------------------------------------------------------------------ the rules
    def fbcache(self, step, x0, layers):
        x1 = layers(x0, 0, 1)
        r = x1 - x0
        diff = None if self.first_residual is None else relative_change(r, self.first_residual)
        if diff is not None and not diff > float(self.knob("threshold")):
            return self.middle_residual + x1, AccelDecision(step, self.branch, "reuse", blocks_computed=(0, 1),
                                                            blocks_reused=(1, self.L), metric=diff)
        self.first_residual = r                          # only a computed step replaces the reference residual
        out = layers(x1, 1, self.L)
        self.middle_residual = out - x1
        return out, AccelDecision(step, self.branch, "compute", blocks_computed=(0, self.L), metric=diff)

    def dbcache(self, step, x0, layers):
        fn, bn, L = int(self.knob("fn")), int(self.knob("bn")), self.L
        threshold = float(self.knob("threshold"))
        if self.cached_steps[-1:] != [step - 1]:         # the previous step computed: the streak is broken
            self.streak = 0
        h = layers(x0, 0, fn)
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
            h = layers(self.middle_residual + h, L - bn, L)
            return h, AccelDecision(step, self.branch, "reuse", blocks_computed=(0, fn), blocks_reused=(fn, L - bn),
                                    metric=diff)
        self.first_residual = r
        middle = layers(h, fn, L - bn)
        self.middle_residual = middle - h
        return layers(middle, L - bn, L), AccelDecision(step, self.branch, "compute", blocks_computed=(0, L),
                                                        metric=diff)

    def magcache(self, step, x0, layers):
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
        out = layers(x0, 0, self.L)
        self.stack_residual = out - x0
        return out, AccelDecision(step, self.branch, "compute", blocks_computed=(0, self.L), metric=metric)
