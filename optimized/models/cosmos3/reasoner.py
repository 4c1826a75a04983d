"""cosmos3 reasoning on the resident instance: `ar_prefill` and `ar_token` WorkUnits of an ARDecodeLoop.

Prefill runs the und pathway over every new prompt of the batch at once (varlen, causal per prompt) and
writes its keys/values into the request's KV blocks; each decode step embeds one token per request, attends
over that request's blocks, and samples with the rule in manifests/cosmos3/reasoning.py. KV blocks are
reserved at admission for prompt + max_new_tokens and returned on completion or cancellation. When the
reasoning ends, the request's whole text (prompt + generated) can be exported as an und-stream cache entry
for the generator: the und stream is causal, so its K/V are the same whether built token by token or at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
import torch.nn.functional as F

from manifests import ManifestError
from manifests.cosmos3.reasoning import ReasonRequest
from optimized.models.cosmos3 import ops, packing
from optimized.models.cosmos3.model import Cosmos3Fast, UndKV
from optimized.runtime.kv import KVBlockPool
from optimized.runtime.loop import LoopKernel, ResourceRequest, WorkPlan


@dataclass(frozen=True)
class ReasonJob:
    request: ReasonRequest
    record_logits: bool = False
    export_und_kv: bool = False   # on completion, hand prompt + generated (minus a final EOS) to the generator


@dataclass
class ARState:
    job: ReasonJob
    generator: torch.Generator                     # this request's own sampling generator
    tokens: list[int]                              # prompt + generated so far
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    cached: int = 0                                # positions whose K/V are in the blocks
    pending_logits: torch.Tensor | None = None     # logits that choose the next token
    done: bool = False
    stopped_by: str = ""
    flushing: bool = False                         # one more step only to cache the last token's K/V

    @property
    def request(self) -> ReasonRequest:
        return self.job.request


def choose_token(logits: torch.Tensor, req: ReasonRequest, generator: torch.Generator) -> int:
    """The shared sampling rule (manifests/cosmos3/reasoning.py), implemented here independently."""
    x = logits.float()
    if req.temperature == 0:
        return int(x.argmax())
    x = x / req.temperature
    if req.top_k > 0:
        threshold = x.topk(min(req.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < threshold, float("-inf"))
    if req.top_p < 1:
        p, idx = x.softmax(-1).sort(descending=True, stable=True)
        drop = idx[(p.cumsum(-1) - p) > req.top_p]
        x = x.index_fill(0, drop, float("-inf"))
    return int(torch.multinomial(x.softmax(-1), 1, generator=generator))


def text_positions(cfg, start: int, n: int) -> torch.Tensor:
    """Positions start..start+n-1 on all three mRoPE axes (float when fps modulation is on, as upstream)."""
    return packing.text_position_ids(start + n, cfg.enable_fps_modulation)[:, start:]


class ARDecodeLoop(LoopKernel[ARState]):
    loop_id = "cosmos3.ar_decode"

    def __init__(self, fast: Cosmos3Fast, kv_blocks: int = 512, block_size: int = 16):
        self.fast = fast
        cfg = fast.cfg
        self.pool = KVBlockPool(cfg.num_layers, kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                fast.dtype, fast.device, extra_keys=cfg.has_und_k_norm_for_gen)
        self.axis = ops.mrope_axis_of_column(cfg.head_dim // 2, cfg.rope_axes_dim)

    # ---- request -> state
    def init_state(self, job: ReasonJob | ReasonRequest) -> ARState:
        job = job if isinstance(job, ReasonJob) else ReasonJob(job)
        try:
            job.request.validate(self.fast.cfg)
        except ManifestError as e:
            raise ValueError(str(e)) from None
        return ARState(job, torch.Generator().manual_seed(job.request.seed), job.request.prompt_ids.tolist())

    def admission(self, s: ARState) -> ResourceRequest:
        return ResourceRequest(device_bytes=self.pool.blocks_for(s.request.max_total_tokens) * self.pool.bytes_per_block)

    def reserve(self, s: ARState) -> bool:
        if s.blocks:  # re-admitted after a preemption: it kept its blocks (and their contents)
            return True
        n = self.pool.blocks_for(s.request.max_total_tokens)
        if n > self.pool.num_free:
            return False
        s.blocks = self.pool.allocate(n)
        return True

    def fits_ever(self, s: ARState) -> bool:
        return self.pool.blocks_for(s.request.max_total_tokens) <= self.pool.num_blocks

    def release(self, s: ARState) -> None:
        self.pool.release(s.blocks)
        s.blocks = []

    # ---- planning (pure)
    def plan_step(self, s: ARState) -> WorkPlan:
        cfg = self.fast.cfg
        prefill = s.cached == 0
        n = len(s.tokens) if prefill else 1
        flops = 2 * n * cfg.num_layers * (4 * cfg.hidden_size ** 2 + 3 * cfg.hidden_size * cfg.intermediate_size)
        return WorkPlan(request_id="", loop_id=self.loop_id, phase="ar_prefill" if prefill else "ar_token",
                        step_index=len(s.generated),
                        batch_key=(id(self.fast), "ar_prefill" if prefill else "ar_token"),
                        resources=ResourceRequest(cost_seconds=flops / 5e10),
                        shape_signature=f"tokens={n}" if prefill else f"ctx={len(s.tokens)}",
                        info={"position": len(s.tokens) - 1})

    # ---- steps
    def run_step(self, states: Sequence[ARState], plans: Sequence[WorkPlan]) -> list[ARState]:
        with torch.inference_mode():
            if plans[0].phase == "ar_prefill":
                self._prefill(states)
            else:
                self._decode(states)
        return [self._sample(s) for s in states]

    def _prefill(self, states: Sequence[ARState]) -> None:
        fast = self.fast
        texts = [torch.tensor(s.tokens) for s in states]
        x, bounds, K, K4g, V, _ = fast.und_pass(texts, self.axis)
        logits = self._logits(x[torch.tensor(bounds[1:]) - 1])
        for i, s in enumerate(states):
            a, b = bounds[i], bounds[i + 1]
            for li in range(fast.cfg.num_layers):
                self.pool.write(li, s.blocks, 0, K[li, a:b], V[li, a:b], K4g[li, a:b])
            s.cached, s.pending_logits = b - a, logits[i]

    def _decode(self, states: Sequence[ARState]) -> None:
        """One new token per request: its K/V appended to the request's blocks, attention over them."""
        fast, cfg = self.fast, self.fast.cfg
        x = F.embedding(torch.tensor([s.tokens[-1] for s in states], device=fast.device),
                        fast.params["embed_tokens.weight"])
        pos = torch.cat([text_positions(cfg, s.cached, 1) for s in states], dim=1)
        cos, sin = fast._rope_tables(pos, self.axis)
        for li, layer in enumerate(fast.layers):
            w = layer["und"]
            q, k, v = fast._qkv(x, w)
            if w.q_norm is not None:
                q, k = fast._norm(q, w.q_norm), fast._norm(k, w.k_norm)
            k4g = fast._norm(k, w.k_norm_for_gen) if w.k_norm_for_gen is not None else None
            q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
            k4g = ops.apply_rope(k4g, cos, sin) if k4g is not None else k
            outs = []
            for i, s in enumerate(states):
                self.pool.write(li, s.blocks, s.cached, k[i:i + 1], v[i:i + 1], k4g[i:i + 1])
                ck, cv = self.pool.read(li, s.blocks, s.cached + 1)
                outs.append(fast._attend(q[i:i + 1], ck, cv, causal=False))
            x = x + F.linear(torch.cat(outs), w.o_w, w.o_b)
            x = x + fast._mlp(x, w)
        logits = self._logits(x)
        for i, s in enumerate(states):
            s.cached += 1
            s.pending_logits = logits[i]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        p = self.fast.params
        return F.linear(self.fast._norm(hidden, p["und_norm.weight"]), p["lm_head.weight"]).float()

    def _sample(self, s: ARState) -> ARState:
        req = s.request
        if s.flushing:  # the last token's K/V are now cached; nothing more to sample
            s.done, s.flushing, s.pending_logits = True, False, None
            return s
        token = choose_token(s.pending_logits, req, s.generator)
        if s.job.record_logits:
            s.logits.append(s.pending_logits)
        s.generated.append(token)
        s.tokens.append(token)
        s.pending_logits = None
        if token == req.eos_token_id:
            s.done, s.stopped_by = True, "eos"
        elif len(s.generated) >= req.max_new_tokens:
            s.stopped_by = "max_new_tokens"
            s.done = not s.job.export_und_kv
            s.flushing = s.job.export_und_kv
        return s

    def is_done(self, s: ARState) -> bool:
        return s.done

    def finalize(self, s: ARState) -> dict:
        text = s.tokens[:-1] if s.stopped_by == "eos" else list(s.tokens)  # what a generator prompt would use
        exported = self.export_und_kv(s, torch.tensor(text)) if s.job.export_und_kv else False
        return {"tokens": list(s.generated), "logits": s.logits, "stopped_by": s.stopped_by,
                "text_ids": torch.tensor(text), "und_kv_exported": exported}

    # ---- hand-off to the generator
    def export_und_kv(self, s: ARState, text_ids: torch.Tensor) -> bool:
        """Put the und-stream K/V of `text_ids` into the generator's cache if they are a prefix of what this
        request has computed (the und stream is causal: a prefix's K/V do not depend on what follows)."""
        n = text_ids.numel()
        if n > s.cached or s.tokens[:n] != text_ids.tolist() or not s.blocks:
            return False
        layers = range(self.fast.cfg.num_layers)
        extra = self.pool.k_extra is not None
        ks = [self.pool.read(li, s.blocks, n, extra=extra) for li in layers]
        kv = UndKV(torch.stack([k for k, _ in ks]).clone(), torch.stack([v for _, v in ks]).clone())
        return self.fast.und_cache.put(self.fast.und_cache_key(text_ids), kv)
