"""cosmos3 reasoning on the resident instance: `ar_prefill` and `ar_token` WorkUnits of an ARDecodeLoop.

Prefill runs the und pathway over every new prompt of the batch at once (varlen, causal per prompt) and
writes its keys/values into the request's KV blocks; each decode step embeds one token per request, attends
over that request's blocks, and samples with the rule in manifests/cosmos3/reasoning.py. KV blocks are
reserved at admission for prompt + max_new_tokens and returned on completion or cancellation. When the
reasoning ends, the request's whole text (prompt + generated) can be exported as an und-stream cache entry
for the generator: the und stream is causal, so its K/V are the same whether built token by token or at once.

Decode steps run one static-shape body per **shape bucket** (`packing.AR_DECODE_BUCKETS`: batch rows and context
blocks padded; pad rows write and read the pool's scratch block, pad keys are masked) through the model's
`CompileCache`, so `configure_graph` makes them compiled or captured like the gen step: every host-side table
(tokens, positions, write slots, block tables, key mask) is built before the body as small device tensors, the body
itself has no host sync. Prefill is varlen and runs eager (once per request).

Steps are functional: `run_step` returns new states (new token lists, a cloned generator) and never changes the
states it is given; its only side effect, writing K/V into the request's blocks at the positions its input state
names, is the same however often the step is re-run from that state (so a batch that fails part-way and is re-run
request by request advances every other request exactly once).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
import torch.nn.functional as F

from manifests import ManifestError
from manifests.cosmos3.reasoning import ReasonRequest
from optimized.models.cosmos3 import ops, packing
from optimized.attention import attend
from optimized.models.cosmos3.model import Cosmos3Fast, UndKV
from optimized.runtime.compile import GraphKey
from optimized.runtime.kv import KVBlockPool
from optimized.runtime.loop import LoopKernel, RequestEstimate, ResourceRequest, WorkPlan


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
        v, idx = x.sort()  # ascending, default (unstable) tie order decides which tied token a cut keeps (upstream)
        cut = v.softmax(-1).cumsum(-1) <= 1 - req.top_p  # equality drops: top_p on a cumulative mass (upstream)
        cut[-1] = False
        x = x.index_fill(0, idx[cut], float("-inf"))
    return int(torch.multinomial(x.softmax(-1), 1, generator=generator))


def clone_generator(g: torch.Generator) -> torch.Generator:
    out = torch.Generator(device=g.device)
    out.set_state(g.get_state())
    return out


def text_positions(cfg, start: int, n: int) -> torch.Tensor:
    """Positions start..start+n-1 on all three mRoPE axes (float when fps modulation is on, as upstream)."""
    return packing.text_position_ids(start + n, cfg.enable_fps_modulation)[:, start:]


class ARDecodeLoop(LoopKernel[ARState]):
    loop_id = "cosmos3.ar_decode"

    def __init__(self, fast: Cosmos3Fast, kv_blocks: int = 512, block_size: int = 16):
        self.fast = fast
        cfg = fast.cfg
        # this rank's KV heads (all of them on one device; under tp its head slice, as the und cache holds)
        self.pool = KVBlockPool(cfg.num_layers, kv_blocks, block_size, fast.num_kv_heads, cfg.head_dim,
                                fast.dtype, fast.device, extra_keys=cfg.has_und_k_norm_for_gen)
        self.axis = ops.mrope_axis_of_column(cfg.head_dim // 2, cfg.rope_axes_dim)
        self.axis_on_device = self.axis.to(fast.device)   # read inside the decode body: no host copy there
        self.last_step_info: dict[str, str] = {}

    # ---- request -> state
    @staticmethod
    def _job(job: ReasonJob | ReasonRequest) -> ReasonJob:
        return job if isinstance(job, ReasonJob) else ReasonJob(job)

    def _validated(self, job: ReasonJob | ReasonRequest) -> ReasonJob:
        job = self._job(job)
        if not isinstance(job.request, ReasonRequest):
            raise ValueError(f"the reasoning loop takes a ReasonRequest, got {type(job.request).__name__}")
        try:
            job.request.validate(self.fast.cfg)
        except ManifestError as e:
            raise ValueError(str(e)) from None
        return job

    def init_state(self, job: ReasonJob | ReasonRequest) -> ARState:
        job = self._validated(job)
        return ARState(job, torch.Generator().manual_seed(job.request.seed), job.request.prompt_ids.tolist())

    def _held_bytes(self, request: ReasonRequest) -> int:
        return self.pool.blocks_for(request.max_total_tokens) * self.pool.bytes_per_block

    def _step_bytes(self, tokens: int) -> int:
        """Transient bytes of a step over `tokens` new tokens: hidden / MLP activations, every layer's K, K-for-gen
        and V of the prefill (kept until written to the blocks), one row of fp32 logits."""
        cfg = self.fast.cfg
        elem = torch.finfo(self.fast.dtype).bits // 8
        kv = 3 * cfg.num_layers * self.fast.num_kv_heads * cfg.head_dim
        return tokens * (8 * cfg.hidden_size + 2 * cfg.intermediate_size + kv) * elem + cfg.vocab_size * 4

    def estimate(self, job: ReasonJob | ReasonRequest) -> RequestEstimate:
        request = self._validated(job).request
        return RequestEstimate(self._held_bytes(request), self._step_bytes(request.prompt_ids.numel()))

    def admission(self, s: ARState) -> ResourceRequest:
        return ResourceRequest(device_bytes=self._held_bytes(s.request))

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
                        resources=ResourceRequest(device_bytes=self._step_bytes(n), cost_seconds=flops / 5e10),
                        shape_signature=f"tokens={n}" if prefill else f"ctx={len(s.tokens)}",
                        parallel_plan_hash=self.fast.parallel_plan_hash,   # AR runs whole on every rank
                        info={"position": len(s.tokens) - 1})

    # ---- steps
    def run_step(self, states: Sequence[ARState], plans: Sequence[WorkPlan]) -> list[ARState]:
        with torch.inference_mode():
            if plans[0].phase == "ar_prefill":
                cached, logits = self._prefill(states)
                self.last_step_info = {"graph": "eager", "bucket": f"ar_prefill;tokens={sum(cached)}",
                                       "graph_cache": "varlen"}
            else:
                cached, logits = self._decode(states)
        for p in plans:  # trace.step says how the body ran: graph (eager/compiled/replayed), bucket, graph_cache
            p.info.update(self.last_step_info)
        return [self._sample(s, c, x) for s, c, x in zip(states, cached, logits)]

    def _prefill(self, states: Sequence[ARState]) -> tuple[list[int], torch.Tensor]:
        """K/V of every prompt into its blocks; (positions cached, the logits choosing each first token)."""
        fast = self.fast
        texts = [torch.tensor(s.tokens) for s in states]
        x, bounds, K, K4g, V, _ = fast.und_pass(texts, self.axis)
        logits = self._logits(x[torch.tensor(bounds[1:]) - 1])
        for i, s in enumerate(states):
            a, b = bounds[i], bounds[i + 1]
            for li in range(fast.cfg.num_layers):
                self.pool.write(li, s.blocks, 0, K[li, a:b], V[li, a:b], K4g[li, a:b])
        return [bounds[i + 1] - bounds[i] for i in range(len(states))], logits

    def _decode(self, states: Sequence[ARState]) -> tuple[list[int], torch.Tensor]:
        """One new token per request: its K/V written to the request's blocks, attention over them; one padded
        batch through the decode body of its bucket (eager / compiled / replayed per the model's graph mode)."""
        fast, pool = self.fast, self.pool
        buckets = packing.AR_DECODE_BUCKETS
        B = len(states)
        rows = buckets.pad("batch", B)
        blocks = buckets.pad("blocks", max(pool.blocks_for(s.cached + 1) for s in states))
        scratch = pool.scratch_block
        # host-side tables of this step (pad rows: token 0 at position 0, writing and reading the scratch block)
        tokens = torch.zeros(rows, dtype=torch.int64)
        tokens[:B] = torch.tensor([s.tokens[-1] for s in states])
        pos = torch.cat([text_positions(fast.cfg, s.cached, 1) for s in states]
                        + [text_positions(fast.cfg, 0, 1)] * (rows - B), dim=1)
        table = torch.full((rows, blocks), scratch, dtype=torch.int64)
        for i, s in enumerate(states):
            n = min(blocks, len(s.blocks))
            table[i, :n] = torch.tensor(s.blocks[:n])
        where = torch.tensor([s.cached for s in states] + [0] * (rows - B))
        slot_block = table.gather(1, (where // pool.block_size)[:, None])[:, 0]
        slot_offset = where % pool.block_size
        key_mask = (torch.arange(blocks * pool.block_size)[None] <= where[:, None]).view(rows, 1, 1, -1)
        args = tuple(t.to(fast.device) for t in (tokens, pos, slot_block, slot_offset, table, key_mask))
        key = GraphKey(family="cosmos3", variant=fast.variant_name, weights_version=fast.weights_version,
                       dtype=str(fast.dtype).removeprefix("torch."), device=str(fast.device),
                       bucket=f"ar_token;B={rows};blocks={blocks}x{pool.block_size}", batch_size=rows,
                       cfg_policy="none", attention=fast.attention, mode=fast.graph_mode)
        runner, info = fast.graph_cache.step(key, self.decode_body, args)
        (logits,) = runner(*args)
        self.last_step_info = info.as_dict()
        return [s.cached + 1 for s in states], logits[:B]

    def decode_body(self, tokens: torch.Tensor, pos: torch.Tensor, slot_block: torch.Tensor,
                    slot_offset: torch.Tensor, table: torch.Tensor, key_mask: torch.Tensor) -> tuple[torch.Tensor]:
        """The decode step body on static per-bucket shapes: tokens [R], pos [3, R], write slot (block, offset)
        [R], block table [R, NB], key mask [R, 1, 1, NB * block_size] -> fp32 logits [R, vocab]. Its one side
        effect, writing each row's K/V into the pool, is the same whenever the body is re-run on the same inputs."""
        fast, pool = self.fast, self.pool
        R = tokens.shape[0]
        x = F.embedding(tokens, fast.params["embed_tokens.weight"])
        cos, sin = fast._rope_tables(pos, self.axis_on_device)
        for li, layer in enumerate(fast.layers):
            w = layer["und"]
            q, k, v = fast._qkv(x, w)
            if w.q_norm is not None:
                q, k = fast._norm(q, w.q_norm), fast._norm(k, w.k_norm)
            k4g = fast._norm(k, w.k_norm_for_gen) if w.k_norm_for_gen is not None else None
            q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
            pool.k[li, slot_block, slot_offset] = k
            pool.v[li, slot_block, slot_offset] = v
            if pool.k_extra is not None:
                pool.k_extra[li, slot_block, slot_offset] = ops.apply_rope(k4g, cos, sin) if k4g is not None else k
            ck = pool.k[li][table].flatten(1, 2).transpose(1, 2)      # [R, K, NB * block_size, d]
            cv = pool.v[li][table].flatten(1, 2).transpose(1, 2)
            o = attend(q[:, :, None], ck, cv, key_mask=key_mask, backend=fast.attention)   # [R, H, 1, d]
            x = x + fast._out_proj(o.reshape(R, -1), w)   # row-parallel under tp (partial sums all-reduced)
            x = x + fast._mlp(x, w)
        return (self._logits(x),)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        p = self.fast.params
        return F.linear(self.fast._norm(hidden, p["und_norm.weight"]), p["lm_head.weight"]).float()

    def _sample(self, s: ARState, cached: int, logits: torch.Tensor) -> ARState:
        """The state after this step: a new state object (new lists, a cloned generator); `s` is left as it was."""
        req = s.request
        if s.flushing:  # the last token's K/V are now cached; nothing more to sample
            return replace(s, cached=cached, done=True, flushing=False)
        generator = clone_generator(s.generator) if req.temperature > 0 else s.generator  # greedy draws nothing
        token = choose_token(logits, req, generator)
        new = replace(s, generator=generator, cached=cached, tokens=s.tokens + [token],
                      generated=s.generated + [token], logits=s.logits + [logits] if s.job.record_logits else s.logits)
        if token == req.eos_token_id:
            new.done, new.stopped_by = True, "eos"
        elif len(new.generated) >= req.max_new_tokens:
            new.stopped_by = "max_new_tokens"
            new.done = not s.job.export_und_kv
            new.flushing = s.job.export_und_kv
        return new

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
        if self.fast.sequence_parallel is not None:   # stored as the generator reads it: this rank's head group
            kv = self.fast.sequence_parallel.shard_und(kv)
        return self.fast.und_cache.put(self.fast.und_cache_key(text_ids), kv)
