"""Cosmos3Fast: the cosmos3 omni MoT transformer, batched across packed samples, with an und-stream cache.

One `forward_batch` call runs several packed samples (different prompts, shapes, modalities,
timesteps; one CFG branch each) as two flat token streams:

  U: the text tokens of every distinct prompt whose und keys/values are not cached (causal per prompt);
  G: the generation tokens of every sample (vision | sound | action per sample, back to back).

Projections, norms and MLPs run once over each stream (fused QKV / gate-up weights); attention is ONE call per
layer through `optimized.attention.attend` on the padded batch (und: causal over its own text; gen: its own text
keys + its own gen keys, non-causal, pad keys masked; GQA via `enable_gqa`, K/V never repeated).

The gen stream is capture-safe: everything host-side about a batch's layout (packing, position ids / RoPE tables,
timestep rows, masks, gather rows) is built once per layout into a cached `BatchGeometry` on the device, padded to
the family's shape buckets; the step body `gen_body` then has static shapes per bucket and no host sync, and runs
eager, compiled or captured through a `CompileCache` (optimized/runtime/compile.py). The und stream depends only on the text ids,
so its per-layer (k_for_gen, v) after RoPE are cached in a `CacheStore` under a structured
`CacheKey`; on a hit the und pathway is skipped entirely.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from manifests.cosmos3.config import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs, Cosmos3Prediction

from optimized.attention import attend, check_backend, key_padding_mask
from optimized.models.cosmos3 import ops, packing
from optimized.parallel.tp import row_parallel
from optimized.models.cosmos3.tp import read_sharded_state, set_tp_layout, sharded_component
from optimized.models.cosmos3.spec import (
    MODEL_ID, TRANSFORMER, UND_KV_CONTRACT_VERSION, cosmos3_model_spec,
)
from optimized.runtime.cache import CacheKey, CacheStore, content_hash, state_dict_hash
from optimized.runtime.compile import GRAPH_MODES, CompileCache, GraphKey, ShapeBuckets
from optimized.runtime.spec import apply_load_transforms

Trace = Callable[[int, str, torch.Tensor], None]
GEOMETRY_CACHE_ENTRIES = 64   # batch layouts kept on the device (a few KB each at tiny sizes)


@dataclass(frozen=True)
class Ragged:
    """A flat stream of `batch` sequences as a padded [batch, length] view: `pad_index` [batch*length] flat rows (pad
    slots repeat the sequence's last row), `unpad_index` [sum lens] padded slots, `key_mask` [batch, 1, 1, length]."""
    batch: int
    length: int
    pad_index: torch.Tensor
    unpad_index: torch.Tensor
    key_mask: torch.Tensor


def ragged(lens: list[int], device: torch.device) -> Ragged:
    B, Lm = len(lens), max(lens)
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    pad = torch.tensor([a + min(j, n - 1) for a, n in zip(starts, lens) for j in range(Lm)])
    unpad = torch.tensor([s * Lm + j for s, n in enumerate(lens) for j in range(n)])
    return Ragged(B, Lm, pad.to(device), unpad.to(device), key_padding_mask([(n, 0) for n in lens], Lm, 0, device))


@dataclass
class PathWeights:
    """One pathway (und or gen) of one decoder layer, after the load transforms."""

    attn_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_norm_for_gen: torch.Tensor | None
    mlp_norm: torch.Tensor
    mlp_in: torch.Tensor        # gate_up [2I, D] (silu) or up [I, D] (relu2)
    mlp_down: torch.Tensor


@dataclass
class UndKV:
    """Cached und stream of one prompt: keys-for-gen and values after RoPE, [num_layers, L_text, K, d]."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class Cosmos3FastStats:
    forward_calls: int = 0
    samples: int = 0
    und_cache_hits: int = 0        # distinct prompts per call found in the cache
    und_cache_misses: int = 0      # distinct prompts per call looked up and not found
    und_prompts_computed: int = 0  # distinct prompts whose und stream was computed
    und_layers_run: int = 0        # und decoder-layer executions (num_layers per call that computes und)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


class Cosmos3Fast:
    """Built from (config, canonical state dict, device, dtype). See the module docstring."""
    memory_blocks = "layers"   # the per-layer weights blockwise offload streams (optimized/runtime/memory.py)

    def __init__(self, cfg: Cosmos3Config, state_dict: dict[str, torch.Tensor], *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 weights_version: str | None = None, und_cache: CacheStore | None = None,
                 und_cache_bytes: int = 1 << 30, use_und_cache: bool = True, tp=None) -> None:
        """`tp` (an AxisGroup of degree > 1): `state_dict` is this rank's tensor-parallel shard (tp.py
        read_sharded_state), validated against the shard shapes."""
        self.cfg = cfg.validate()
        self.device = torch.device(device)
        self.dtype = dtype
        self.spec = cosmos3_model_spec(cfg)
        component = self.spec.component(TRANSFORMER)
        if tp is not None and tp.world_size > 1:
            component = sharded_component(component, cfg, tp)
        self.params = apply_load_transforms(component, state_dict, dtype=dtype, device=self.device)
        self.weights_version = weights_version or state_dict_hash(state_dict)
        self.und_cache = und_cache if und_cache is not None else CacheStore(und_cache_bytes, name="cosmos3.und_kv")
        self.use_und_cache = use_und_cache
        self.stats = Cosmos3FastStats()
        self.layers = [{path: self._path(i, path) for path in ("und", "gen")} for i in range(cfg.num_layers)]
        self.inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta, device=self.device)
        cfg_json = json.dumps(cfg.to_dict(), sort_keys=True)
        self._cfg_hash = hashlib.sha256(cfg_json.encode()).hexdigest()[:16]
        # the step body's graph: mode, attention backend, shape buckets, names in every GraphKey (configure_graph)
        self.graph_mode, self.attention, self.buckets = "eager", "auto", packing.COSMOS3_BUCKETS
        self.cfg_policy_name, self.variant_name = "any", f"cfg-{self._cfg_hash}"
        self.graph_cache = CompileCache()
        self.row_block = 1024 if self.device.type == "cpu" else 0  # row-local work in cache-resident row blocks
        self.last_step_info: dict[str, str] = {}
        self.sequence_parallel = None   # a GenSequenceParallel (parallelize.py) under ulysses x ring > 1
        self.tp = None                  # the tp AxisGroup under tp > 1 (tp.py): this rank holds heads / tp
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads   # this rank's (tp.py shards them)
        if tp is not None and tp.world_size > 1:
            set_tp_layout(self, tp)
        self.parallel_plan_hash = "single"   # the layout this instance runs (parallelize.py): in every und CacheKey
        self._geometries: OrderedDict[tuple, packing.BatchGeometry] = OrderedDict()
        self._text_kv_memo: OrderedDict[tuple, tuple] = OrderedDict()

    def _path(self, i: int, path: str) -> PathWeights:
        p, g = f"layers.{i}.{path}.", self.params.get
        return PathWeights(
            attn_norm=g(p + "attn_norm.weight"), qkv_w=g(p + "qkv.weight"), qkv_b=g(p + "qkv.bias"),
            o_w=g(p + "o_proj.weight"), o_b=g(p + "o_proj.bias"),
            q_norm=g(p + "q_norm.weight"), k_norm=g(p + "k_norm.weight"), k_norm_for_gen=g(p + "k_norm_for_gen.weight"),
            mlp_norm=g(p + "mlp_norm.weight"),
            mlp_in=g(p + "mlp.gate_up.weight") if self.cfg.hidden_act == "silu" else g(p + "mlp.up_proj.weight"),
            mlp_down=g(p + "mlp.down_proj.weight"),
        )

    # ------------------------------------------------------------------ building blocks
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fn = ops.rms_norm_relu2 if self.cfg.hidden_act == "relu2" else ops.rms_norm_silu
        return fn(x, w, self.cfg.rms_norm_eps)

    def _mlp(self, x: torch.Tensor, w: PathWeights) -> torch.Tensor:
        fn = ops.mlp_relu2 if self.cfg.hidden_act == "relu2" else ops.mlp_silu
        rows = self.row_block
        if rows and x.shape[0] > rows:  # row blocks keep the [rows, I] intermediate cache-resident (rows independent)
            y = torch.cat([fn(self._norm(c, w.mlp_norm), w.mlp_in, w.mlp_down) for c in x.split(rows)])
        else:
            y = fn(self._norm(x, w.mlp_norm), w.mlp_in, w.mlp_down)
        return y if self.tp is None else self.tp.all_reduce_sum(y)   # down_proj row-parallel: partial sums

    def _out_proj(self, o: torch.Tensor, w: PathWeights) -> torch.Tensor:
        """o_proj: row-parallel under tp (partial products all-reduced, the bias added once)."""
        return F.linear(o, w.o_w, w.o_b) if self.tp is None else row_parallel(o, w.o_w, w.o_b, self.tp)

    def _qkv(self, x: torch.Tensor, w: PathWeights):
        H, K, d = self.num_heads, self.num_kv_heads, self.cfg.head_dim
        q, k, v = F.linear(self._norm(x, w.attn_norm), w.qkv_w, w.qkv_b).split([H * d, K * d, K * d], dim=-1)
        return q.view(-1, H, d), k.view(-1, K, d), v.view(-1, K, d)

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """q [n, H, d], k/v [m, K, d] -> [n, H*d]; GQA without repeating K/V."""
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=causal, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(q.shape[0], -1)

    def _rope_tables(self, position_ids: torch.Tensor, axis: torch.Tensor):
        return ops.rope_cos_sin(position_ids, self.inv_freq, axis, self.dtype)

    # ------------------------------------------------------------------ und stream + cache
    def und_cache_key(self, text_ids: torch.Tensor, axis_of_column: torch.Tensor | None = None) -> CacheKey:
        cfg = self.cfg
        if axis_of_column is None:
            axis_of_column = ops.mrope_axis_of_column(cfg.head_dim // 2, cfg.rope_axes_dim)
        cols = "".join(str(int(a)) for a in axis_of_column)
        return CacheKey(
            model_id=MODEL_ID, component_id=TRANSFORMER, weights_version=self.weights_version,
            precision=str(self.dtype).removeprefix("torch."),
            shape_signature=f"text={text_ids.numel()};layers={cfg.num_layers};kv={cfg.num_kv_heads}x{cfg.head_dim}",
            layout_signature=f"cfg={self._cfg_hash};mrope_cols={cols};device={self.device}",
            input_hashes={"text_ids": content_hash(text_ids)},
            cache_contract_version=UND_KV_CONTRACT_VERSION,
            parallel_plan_hash=self.parallel_plan_hash,   # under ulysses the entry holds this rank's KV heads only
        )

    def clear_und_cache(self) -> int:
        """Drop this model's entries (call after editing weights in place)."""
        return self.und_cache.evict_where(lambda k: k.weights_version == self.weights_version)

    def _und_layer(self, x: torch.Tensor, w: PathWeights, rag: "Ragged", cos: torch.Tensor, sin: torch.Tensor):
        """One und layer over a flat text stream of several prompts (`rag`: their padded batch view; causal within
        each). Returns (new hidden, keys after RoPE, keys-for-gen after RoPE, values)."""
        q, k, v = self._qkv(x, w)
        if w.q_norm is not None:
            q, k = self._norm(q, w.q_norm), self._norm(k, w.k_norm)
        k4g = self._norm(k, w.k_norm_for_gen) if w.k_norm_for_gen is not None else None
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        k4g = k if k4g is None else ops.apply_rope(k4g, cos, sin)
        B, Lm = rag.batch, rag.length
        pad = lambda t: t[rag.pad_index].view(B, Lm, t.shape[1], -1).transpose(1, 2)  # noqa: E731
        o = attend(pad(q), pad(k), pad(v), key_mask=rag.key_mask, causal=True, backend=self.attention)
        o = o.transpose(1, 2).reshape(B * Lm, -1)[rag.unpad_index]
        x = x + self._out_proj(o, w)
        return x + self._mlp(x, w), k, k4g, v

    def und_pass(self, texts: list[torch.Tensor], axis: torch.Tensor, want_trace: bool = False):
        """The und pathway over several prompts at once (causal within each). Returns the final hidden
        states [sum L, D], the prompt bounds, per-layer stacked keys / keys-for-gen / values [layers, sum L,
        K, d] and, when tracing, the per-layer hidden states."""
        lens = [t.numel() for t in texts]
        bounds = torch.tensor([0] + lens).cumsum(0).tolist()
        rag = ragged(lens, self.device)
        x = F.embedding(torch.cat(texts).to(self.device), self.params["embed_tokens.weight"])
        pos = torch.cat([packing.text_position_ids(n, self.cfg.enable_fps_modulation) for n in lens], dim=1)
        cos, sin = self._rope_tables(pos, axis)
        ks, k4gs, vs, hidden = [], [], [], []
        for layer in self.layers:
            x, k, k4g, v = self._und_layer(x, layer["und"], rag, cos, sin)
            ks.append(k)
            k4gs.append(k4g)
            vs.append(v)
            if want_trace:
                hidden.append(x)
        self.stats.und_layers_run += len(self.layers)
        self.stats.und_prompts_computed += len(texts)
        return x, bounds, torch.stack(ks), torch.stack(k4gs), torch.stack(vs), hidden

    def _und_stack(self, texts: list[torch.Tensor], axis: torch.Tensor, want_trace: bool):
        """Per-prompt UndKV (text K/V as gen queries see them) and, when tracing, per-prompt lists of
        per-layer und hidden states."""
        _, bounds, _, K, V, hidden = self.und_pass(texts, axis, want_trace)
        kvs = [UndKV(K[:, a:b].contiguous(), V[:, a:b].contiguous()) for a, b in zip(bounds[:-1], bounds[1:])]
        traces = [[h[a:b] for h in hidden] for a, b in zip(bounds[:-1], bounds[1:])] if want_trace else None
        return kvs, traces

    def _und_kv(self, inputs: Sequence[Cosmos3ForwardInputs], axis: torch.Tensor, use_cache: bool,
                want_trace: bool):
        """Per-sample UndKV (cache hits, de-duplicated within the batch), per-sample und traces (None for
        samples served from the cache) and per-sample cache status ("hit" | "miss" | "off")."""
        keys = [self.und_cache_key(x.text_ids, axis) for x in inputs]
        resolved: dict[CacheKey, UndKV] = {}
        todo: dict[CacheKey, list[int]] = {}
        for s, key in enumerate(keys):
            if key in todo:
                todo[key].append(s)
                continue
            if key in resolved:
                continue
            hit = self.und_cache.get(key) if use_cache else None
            if hit is not None:
                resolved[key] = hit if self.sequence_parallel is None else self.sequence_parallel.shard_und(hit)
                self.stats.und_cache_hits += 1
            else:
                todo[key] = [s]
                self.stats.und_cache_misses += int(use_cache)
        traces: list[list[torch.Tensor] | None] = [None] * len(inputs)
        status = ["hit"] * len(inputs)
        if todo:
            kvs, und_traces = self._und_stack([inputs[ss[0]].text_ids for ss in todo.values()], axis, want_trace)
            if self.sequence_parallel is not None:  # kept (and cached) sharded by heads like the gen K/V
                kvs = [self.sequence_parallel.shard_und(kv) for kv in kvs]
            for j, (key, samples) in enumerate(todo.items()):
                resolved[key] = kvs[j]
                if use_cache:
                    self.und_cache.put(key, kvs[j])
                for s in samples:
                    traces[s] = und_traces[j] if want_trace else None
                    status[s] = "miss" if use_cache else "off"
        return [resolved[k] for k in keys], traces, status

    # ------------------------------------------------------------------ gen stream (padded batch, static per bucket)
    def configure_graph(self, mode: str = "eager", *, attention: str | None = None,
                        buckets: ShapeBuckets | None = None, cfg_policy: str | None = None,
                        variant: str | None = None) -> "Cosmos3Fast":
        """How the gen step body runs: "eager", "compile" (torch.compile per bucket) or "cuda" (captured CUDA graph
        per bucket); the attention backend, the shape buckets and the names that go into every GraphKey."""
        if mode not in GRAPH_MODES:
            raise ValueError(f"graph mode must be one of {GRAPH_MODES}, got {mode!r}")
        self.graph_mode = mode
        self.attention = check_backend(attention or self.attention)
        self.buckets = buckets or self.buckets
        self.cfg_policy_name = cfg_policy or self.cfg_policy_name
        self.variant_name = variant or self.variant_name
        self._geometries.clear()
        return self

    def graph_key(self, geo: packing.BatchGeometry) -> GraphKey:
        return GraphKey(family="cosmos3", variant=self.variant_name, weights_version=self.weights_version,
                        dtype=str(self.dtype).removeprefix("torch."), device=str(self.device), bucket=geo.bucket,
                        batch_size=geo.batch, cfg_policy=self.cfg_policy_name, attention=self.attention,
                        mode=self.graph_mode)

    def _geometry(self, inputs: Sequence[Cosmos3ForwardInputs], axis: torch.Tensor) -> packing.BatchGeometry:
        """The batch's padded layout, built once per (sample signatures, buckets) and cached. The functions that
        build it are part of the key: a planted fault (a monkeypatched builder) never reuses a clean geometry."""
        key = (tuple(packing.sample_signature(x) for x in inputs), self.buckets, packing.real_key_lengths,
               ops.mrope_axis_of_column, ops.rope_cos_sin, packing.timestep_embedding_rows, packing.pack_layout)
        geo = self._geometries.get(key)
        if geo is None:
            layouts = [packing.pack_layout(self.cfg, x) for x in inputs]
            geo = packing.build_geometry(layouts, self.buckets, lambda pos: self._rope_tables(pos, axis),
                                         self.device, self.dtype)
            self._geometries[key] = geo
            while len(self._geometries) > GEOMETRY_CACHE_ENTRIES:
                self._geometries.popitem(last=False)
        else:
            self._geometries.move_to_end(key)
        return geo

    def _text_kv(self, und: list[UndKV], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer text K/V of the batch padded to T: [layers, B, T, K, d] each. Memoised on the identity of the
        UndKV entries (the same prompts step after step reuse one padded copy)."""
        key = (tuple(id(u) for u in und), T)
        hit = self._text_kv_memo.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], und)):
            self._text_kv_memo.move_to_end(key)
            return hit[1], hit[2]
        nl, _, K, d = und[0].k.shape
        kk = und[0].k.new_zeros(nl, len(und), T, K, d)
        vv = und[0].v.new_zeros(nl, len(und), T, K, d)
        for s, u in enumerate(und):
            kk[:, s, :u.k.shape[1]] = u.k
            vv[:, s, :u.v.shape[1]] = u.v
        self._text_kv_memo[key] = (list(und), kk, vv)
        while len(self._text_kv_memo) > 4:
            self._text_kv_memo.popitem(last=False)
        return kk, vv

    def _action_linear(self, x: torch.Tensor, name: str, dom: int, n_in: int, n_out: int) -> torch.Tensor:
        """DomainAwareLinear: row `dom` of the weight reshaped to [in, out]; y = x @ W + b, as one
        vector-matrix product per row (bmm over a stride-0 weight: upstream's per-token rounding)."""
        w = self.params[f"{name}.weight"][dom].view(n_in, n_out)
        return torch.bmm(x[:, None], w.expand(x.shape[0], n_in, n_out))[:, 0] + self.params[f"{name}.bias"][dom]

    def _embed_gen(self, inputs: Sequence[Cosmos3ForwardInputs], geo: packing.BatchGeometry) -> torch.Tensor:
        """The padded gen stream [B*N, D]: modality embeddings at their rows, pad rows zero, the timestep embedding
        added on the geometry's timestep rows."""
        cfg, P, dev, dt = self.cfg, self.params, self.device, self.dtype
        D = cfg.hidden_size
        G = torch.zeros(geo.batch * geo.gen_pad, D, device=dev, dtype=dt)
        vis = torch.cat([ops.patchify(x.vision_latents.to(dev, dt), cfg.patch_size) for x in inputs])
        G[geo.vision_rows] = F.linear(vis, P["vision_in.weight"], P["vision_in.bias"])
        if geo.sound_rows is not None:
            snd = torch.cat([x.sound_latents.to(dev, dt).T for x in inputs if x.sound_latents is not None])
            G[geo.sound_rows] = F.linear(snd, P["sound_in.weight"], P["sound_in.bias"]) + P["sound_modality_embed"]
        for x, rows in zip(inputs, geo.action_rows):
            if rows is not None:
                a = self._action_linear(x.action_latents.to(dev, dt), "action_in", x.action_domain_id,
                                        cfg.action_dim, D)
                G[rows] = a + P["action_modality_embed"]
        # timestep embedding: fp32 sinusoid + fp32 MLP per sample, cast, added to the chosen rows only
        t = torch.tensor([float(x.timestep) for x in inputs], dtype=torch.float32, device=dev) * cfg.timestep_scale
        temb = ops.time_embedding(t, P["time_embed.linear_1.weight"], P["time_embed.linear_1.bias"],
                                  P["time_embed.linear_2.weight"], P["time_embed.linear_2.bias"], dt)
        G.view(geo.batch, geo.gen_pad, D).add_(geo.timestep_mask * temb[:, None])
        return G

    def _gen_layer(self, x: torch.Tensor, w: PathWeights, tk: torch.Tensor, tv: torch.Tensor,
                   key_mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   attention: Callable | None = None) -> torch.Tensor:
        """One gen layer over the padded gen stream x [B*N, D]; sample b attends, non-causally, to its text keys
        tk/tv[b] [T, K, d] and its own gen tokens (pad keys masked by `key_mask`). One attention call per layer.
        `attention(q, k, v, tk, tv)` on [B, N, heads, d] replaces it under sequence parallelism (parallelize.py)."""
        H, K, d = self.num_heads, self.num_kv_heads, self.cfg.head_dim
        B = tk.shape[0]
        N = x.shape[0] // B
        blocks = self._row_blocks(x.shape[0])
        if blocks:  # row-local work in cache-resident row blocks (rows are independent outside attention)
            q, k, v = (torch.cat(t) for t in zip(*(self._gen_qkv(x[a:b], w, cos[a:b], sin[a:b]) for a, b in blocks)))
        else:
            q, k, v = self._gen_qkv(x, w, cos, sin)
        if attention is not None:  # this rank's rows against every rank's keys (parallelize.py)
            o = attention(q.view(B, N, H, d), k.view(B, N, K, d), v.view(B, N, K, d), tk, tv).reshape(B * N, H * d)
        else:
            keys = torch.cat([tk, k.view(B, N, K, d)], 1).transpose(1, 2)
            values = torch.cat([tv, v.view(B, N, K, d)], 1).transpose(1, 2)
            o = attend(q.view(B, N, H, d).transpose(1, 2), keys, values, key_mask=key_mask, backend=self.attention)
            o = o.transpose(1, 2).reshape(B * N, H * d)
        if blocks:
            return torch.cat([self._gen_out(x[a:b], o[a:b], w) for a, b in blocks])
        return self._gen_out(x, o, w)

    def _row_blocks(self, n: int) -> list[tuple[int, int]]:
        r = self.row_block
        return [(a, min(a + r, n)) for a in range(0, n, r)] if r and n > r else []

    def _gen_qkv(self, x: torch.Tensor, w: PathWeights, cos: torch.Tensor, sin: torch.Tensor):
        q, k, v = self._qkv(x, w)
        return ops.apply_rope(self._norm(q, w.q_norm), cos, sin), ops.apply_rope(self._norm(k, w.k_norm), cos, sin), v

    def _gen_out(self, x: torch.Tensor, o: torch.Tensor, w: PathWeights) -> torch.Tensor:
        x = x + self._out_proj(o, w)
        return x + self._mlp(x, w)

    def gen_body(self, G: torch.Tensor, text_k: torch.Tensor, text_v: torch.Tensor, key_mask: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
        """The step body: every gen layer and the final norm on static per-bucket shapes, no host sync (what
        `CompileCache` compiles or captures). G [B*N, D]; text_k/v [layers, B, T, K, d]."""
        for li, layer in enumerate(self.layers):
            G = self._gen_layer(G, layer["gen"], text_k[li], text_v[li], key_mask, cos, sin)
        return (self._norm(G, self.params["gen_norm.weight"]),)

    def sp_gen_body(self, G: torch.Tensor, text_k: torch.Tensor, text_v: torch.Tensor, key_mask: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
        """The step body under sequence parallelism (parallelize.py): this rank's gen rows through every layer, the
        collectives between, the whole normed stream gathered back; same inputs and output as `gen_body`."""
        return (self.sequence_parallel.gen_stream(self, G, text_k, text_v, key_mask, cos, sin),)

    # ------------------------------------------------------------------ decode
    def _decode(self, h: torch.Tensor, inputs: Sequence[Cosmos3ForwardInputs],
                geo: packing.BatchGeometry) -> list[Cosmos3Prediction]:
        cfg, P = self.cfg, self.params
        C, p = cfg.latent_channels, cfg.patch_size
        vis = F.linear(h[geo.vision_out_rows], P["vision_out.weight"], P["vision_out.bias"])
        if geo.sound_out_rows is not None:
            snd = F.linear(h[geo.sound_out_rows], P["sound_out.weight"], P["sound_out.bias"])
        preds, v0, s0 = [], 0, 0
        for s, (x, lay) in enumerate(zip(inputs, geo.layouts)):
            T, gh, gw = lay.vision_grid
            H, W = lay.vision_latent_hw
            n_noisy = lay.vision_noisy_frames.numel()
            n = n_noisy * gh * gw
            vision = h.new_zeros(1, C, T, H, W)
            if n:
                vision[0, :, geo.noisy_frames[s]] = ops.unpatchify(vis[v0:v0 + n], (n_noisy, gh, gw), p, C, H, W)
            v0 += n
            sound = action = None
            if lay.sound_mse_loss_indexes is not None:
                ns = lay.sound_mse_loss_indexes.numel()
                sound = h.new_zeros(cfg.sound_dim, lay.num_sound_tokens)
                sound[:, geo.sound_noisy[s]] = snd[s0:s0 + ns].T
                s0 += ns
            if lay.action_mse_loss_indexes is not None:
                action = h.new_zeros(lay.num_action_tokens, cfg.action_dim)
                if geo.action_out_rows[s] is not None:
                    action[geo.action_noisy[s]] = self._action_linear(
                        h[geo.action_out_rows[s]], "action_out", x.action_domain_id, cfg.hidden_size, cfg.action_dim)
            preds.append(Cosmos3Prediction(vision=vision, sound=sound, action=action))
        return preds

    # ------------------------------------------------------------------ entry points
    @torch.inference_mode()
    def forward_batch(self, inputs: Sequence[Cosmos3ForwardInputs], trace: Trace | None = None, *,
                      use_und_cache: bool | None = None) -> list[Cosmos3Prediction]:
        """Run several packed samples (one CFG branch each) in one call; returns one prediction each. The
        layers run as one padded batch through the step body of this bucket (eager / compiled / replayed per
        `configure_graph`; a traced call always runs eager, layer by layer). `last_step_info` says which."""
        if not inputs:
            return []
        cfg = self.cfg
        for x in inputs:
            x.validate(cfg)
        use_cache = self.use_und_cache if use_und_cache is None else use_und_cache
        axis = ops.mrope_axis_of_column(cfg.head_dim // 2, cfg.rope_axes_dim)
        self.stats.forward_calls += 1
        self.stats.samples += len(inputs)

        und, und_traces, und_status = self._und_kv(inputs, axis, use_cache, want_trace=trace is not None)
        geo = self._geometry(inputs, axis)
        G = self._embed_gen(inputs, geo)
        text_k, text_v = self._text_kv(und, geo.text_pad)
        spans = [geo.rows(s) for s in range(geo.batch)]

        if trace is None:
            args = (G, text_k, text_v, geo.key_mask, geo.cos, geo.sin)
            body = self.gen_body if self.sequence_parallel is None else self.sp_gen_body
            runner, info = self.graph_cache.step(self.graph_key(geo), body, args)
            (G,) = runner(*args)
            self.last_step_info = info.as_dict()
        else:
            per_layer = None
            if trace is not None:
                emb = self.params["embed_tokens.weight"]
                for s, (x, (a, b)) in enumerate(zip(inputs, spans)):
                    trace(s, "embed", torch.cat([F.embedding(x.text_ids.to(self.device), emb), G[a:b]]))

                def trace_layer(li: int, G: torch.Tensor) -> None:
                    for s, (a, b) in enumerate(spans):
                        if und_traces[s] is not None:
                            trace(s, f"layers.{li}.und", und_traces[s][li])
                        trace(s, f"layers.{li}.gen", G[a:b])
                per_layer = trace_layer
            if self.sequence_parallel is not None:  # this rank's gen rows (eager); the whole normed stream back
                G = self.sequence_parallel.gen_stream(self, G, text_k, text_v, geo.key_mask, geo.cos, geo.sin,
                                                      per_layer)
            else:
                for li, layer in enumerate(self.layers):
                    G = self._gen_layer(G, layer["gen"], text_k[li], text_v[li], geo.key_mask, geo.cos, geo.sin)
                    per_layer(li, G)
                G = self._norm(G, self.params["gen_norm.weight"])
            self.last_step_info = {"graph": "eager", "bucket": geo.bucket, "graph_cache": "traced"}
        preds = self._decode(G, inputs, geo)
        for pr, st in zip(preds, und_status):
            pr.extras["und_cache"] = st
        if trace is not None:
            for s, ((a, b), pr) in enumerate(zip(spans, preds)):
                trace(s, "gen_norm", G[a:b])
                trace(s, "pred.vision", pr.vision)
                if pr.sound is not None:
                    trace(s, "pred.sound", pr.sound)
                if pr.action is not None:
                    trace(s, "pred.action", pr.action)
        return preds

    @torch.inference_mode()
    def run_layer(self, index: int, und_hidden: torch.Tensor, gen_hidden: torch.Tensor,
                  position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer `index` alone for one sample, on given und [L_text, D] / gen [L - L_text, D] hidden
        states and the sample's [3, L] position ids (block-level parity). Returns (und out, gen out)."""
        cfg, n = self.cfg, und_hidden.shape[0]
        axis = ops.mrope_axis_of_column(cfg.head_dim // 2, cfg.rope_axes_dim)
        cos, sin = self._rope_tables(position_ids, axis)
        layer = self.layers[index]
        u = und_hidden.to(self.device, self.dtype)
        g = gen_hidden.to(self.device, self.dtype)
        u, _, k4g, v = self._und_layer(u, layer["und"], ragged([n], self.device), cos[:n], sin[:n])
        g = self._gen_layer(g, layer["gen"], k4g[None], v[None], None, cos[n:], sin[n:])
        return u, g

    def forward(self, inputs: Cosmos3ForwardInputs, trace: Trace | None = None, **kw) -> Cosmos3Prediction:
        """One sample (a thin wrapper over `forward_batch`)."""
        wrapped = None if trace is None else (lambda _s, name, t: trace(0, name, t))
        return self.forward_batch([inputs], wrapped, **kw)[0]

    __call__ = forward


def load_fast(cfg: Cosmos3Config, state_dict: dict[str, torch.Tensor], *, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32, **kw) -> Cosmos3Fast:
    """Build a Cosmos3Fast from a canonical state dict (strictly validated; declared transforms applied)."""
    return Cosmos3Fast(cfg, state_dict, device=device, dtype=dtype, **kw)


def run_layer(model: Cosmos3Fast, index: int, und_hidden: torch.Tensor, gen_hidden: torch.Tensor,
              position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Module-level form of `Cosmos3Fast.run_layer`."""
    return model.run_layer(index, und_hidden, gen_hidden, position_ids)


def load_sharded(path: str | Path, mesh: Any, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A canonical cosmos3 checkpoint (a transformer dir or a whole-model dir) as this tp rank's Cosmos3Fast, its
    sharded keys read as slices only (the family contract's `load_sharded`)."""
    from manifests.checkpoint import CheckpointError, read_checkpoint

    ckpt = read_checkpoint(path, family="cosmos3")
    if ckpt.partial:
        raise CheckpointError(f"{path}: a partial checkpoint; tensor-parallel loading needs every part")
    cfg = ckpt.typed_config()
    if ckpt.is_model:
        cfg = cfg.transformer
    comp = ckpt.component("transformer" if ckpt.is_model else None)
    tp = mesh.axis("tp")
    state = read_sharded_state(comp, cfg, tp)   # tp.py
    return Cosmos3Fast(cfg, state, device=device, dtype=dtype, weights_version=ckpt.weights_version, tp=tp)


# ------------------------------------------------------------------ the step / residual caches' view of the gen stack
@dataclass
class CachedBatch:
    """One embedded batch for `Cosmos3CachedStack`: the gen stream as x [B, N, D] (pad rows exactly zero), its
    geometry, the per-layer text K/V and the real-row mask [B, N, 1]."""
    x: torch.Tensor
    inputs: list
    geo: packing.BatchGeometry
    text_k: torch.Tensor            # [layers, B, T, K, d]
    text_v: torch.Tensor
    real: torch.Tensor              # bool [B, N, 1]


class Cosmos3CachedStack:
    """Cosmos3Fast as an `optimized.accel.stack.CachedStack`. The cached "block stack" is the gen pathway's layers;
    the und (text) stream never depends on gen tokens, so its per-layer K/V come whole from the und cache and every
    gen layer can run on any subset of rows. Pad rows of the gen stream are kept at exactly 0 after every segment
    (pad keys are masked, so the real rows are unchanged bitwise): a residual's relative L1 over [N_pad, D] then
    equals the one over the sample's real rows, as the reference computes it. `head` returns each row's decoded
    prediction flattened to one vector ([vision | sound | action], `flatten_prediction`): `cached_forward` splits
    one output tensor per row, and cosmos3 has three output heads.
    Eager and single-device (refused under sequence / tensor parallelism by the loop)."""

    def __init__(self, fast: Cosmos3Fast) -> None:
        if fast.sequence_parallel is not None or fast.tp is not None:
            raise ValueError("cosmos3 accel runs on a single-device model (no sequence / tensor parallel plan)")
        self.fast, self.num_layers, self.dtype = fast, fast.cfg.num_layers, fast.dtype
        self.keys_skipped: list[int] = []   # no sparse attention on cosmos3: nothing skipped

    @torch.no_grad()
    def embed(self, inputs: Sequence[Cosmos3ForwardInputs], steps: list[int]) -> CachedBatch:
        fast, cfg = self.fast, self.fast.cfg
        for x in inputs:
            x.validate(cfg)
        axis = ops.mrope_axis_of_column(cfg.head_dim // 2, cfg.rope_axes_dim)
        und, _, _ = fast._und_kv(inputs, axis, fast.use_und_cache, want_trace=False)
        geo = fast._geometry(inputs, axis)
        text_k, text_v = fast._text_kv(und, geo.text_pad)
        B, N = geo.batch, geo.gen_pad
        real = torch.zeros(B, N, 1, dtype=torch.bool, device=fast.device)
        for s in range(B):
            real[s, : geo.layouts[s].gen_len] = True
        G = fast._embed_gen(inputs, geo).view(B, N, -1)
        return CachedBatch(torch.where(real, G, 0.0), list(inputs), geo, text_k, text_v, real)

    @torch.no_grad()
    def run_blocks(self, batch: CachedBatch, x: torch.Tensor, rows: list[int], start: int, end: int) -> torch.Tensor:
        fast, geo = self.fast, batch.geo
        n, N, D = x.shape
        idx = torch.tensor(rows, device=x.device)
        cos = geo.cos.view(geo.batch, N, -1)[idx].reshape(n * N, -1)
        sin = geo.sin.view(geo.batch, N, -1)[idx].reshape(n * N, -1)
        key_mask = geo.key_mask[idx]
        G = x.reshape(n * N, D)
        for li in range(start, end):
            G = fast._gen_layer(G, fast.layers[li]["gen"], batch.text_k[li][idx], batch.text_v[li][idx], key_mask,
                                cos, sin)
        return torch.where(batch.real[idx], G.view(n, N, D), 0.0)

    @torch.no_grad()
    def head(self, batch: CachedBatch, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if rows != list(range(batch.geo.batch)):
            raise ValueError("cosmos3 accel: the head decodes the whole embedded batch")
        fast = self.fast
        h = fast._norm(x.reshape(-1, x.shape[-1]), fast.params["gen_norm.weight"])
        preds = fast._decode(h, batch.inputs, batch.geo)
        return torch.cat([flatten_prediction(p) for p in preds])


def flatten_prediction(pred: Cosmos3Prediction) -> torch.Tensor:
    """[1, M]: vision, then sound, then action, each flattened (one output row of the cached step)."""
    parts = [t.reshape(-1) for t in (pred.vision, pred.sound, pred.action) if t is not None]
    return torch.cat(parts)[None]


def unflatten_prediction(flat: torch.Tensor, like: dict[str, torch.Size]) -> Cosmos3Prediction:
    """The inverse of `flatten_prediction` for a sample whose outputs have the shapes `like` (by modality)."""
    out, at = {}, 0
    for m in ("vision", "sound", "action"):
        if m in like:
            n = int(torch.Size(like[m]).numel())
            out[m] = flat.reshape(-1)[at:at + n].view(like[m])
            at += n
    return Cosmos3Prediction(vision=out["vision"], sound=out.get("sound"), action=out.get("action"))
