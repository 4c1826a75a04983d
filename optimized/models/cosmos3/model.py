"""Cosmos3Fast: the cosmos3 omni MoT transformer, batched across packed samples, with an und-stream cache.

One `forward_batch` call runs several packed samples (different prompts, shapes, modalities,
timesteps; one CFG branch each) as two flat token streams:

  U: the text tokens of every distinct prompt whose und keys/values are not cached (causal per prompt);
  G: the generation tokens of every sample (vision | sound | action per sample, back to back).

Projections, norms and MLPs run once over each flat stream (fused QKV / gate-up weights); attention
runs per sample with SDPA (und: causal over its own text; gen: its own text keys + its own gen keys,
non-causal; GQA via `enable_gqa`, K/V never repeated). The und stream depends only on the text ids,
so its per-layer (k_for_gen, v) after RoPE are cached in a `CacheStore` under a structured
`CacheKey`; on a hit the und pathway is skipped entirely.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from manifests.cosmos3.config import Cosmos3Config
from manifests.cosmos3.io import Cosmos3ForwardInputs, Cosmos3Prediction

from optimized.models.cosmos3 import ops, packing
from optimized.models.cosmos3.packing import PackedLayout
from optimized.models.cosmos3.spec import (
    MODEL_ID, TRANSFORMER, UND_KV_CONTRACT_VERSION, cosmos3_model_spec,
)
from optimized.runtime.cache import CacheKey, CacheStore, content_hash, state_dict_hash
from optimized.runtime.spec import apply_load_transforms

Trace = Callable[[int, str, torch.Tensor], None]


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

    def __init__(self, cfg: Cosmos3Config, state_dict: dict[str, torch.Tensor], *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 weights_version: str | None = None, und_cache: CacheStore | None = None,
                 und_cache_bytes: int = 1 << 30, use_und_cache: bool = True) -> None:
        self.cfg = cfg.validate()
        self.device = torch.device(device)
        self.dtype = dtype
        self.spec = cosmos3_model_spec(cfg)
        self.params = apply_load_transforms(self.spec.component(TRANSFORMER), state_dict, dtype=dtype,
                                            device=self.device)
        self.weights_version = weights_version or state_dict_hash(state_dict)
        self.und_cache = und_cache if und_cache is not None else CacheStore(und_cache_bytes, name="cosmos3.und_kv")
        self.use_und_cache = use_und_cache
        self.stats = Cosmos3FastStats()
        self.layers = [{path: self._path(i, path) for path in ("und", "gen")} for i in range(cfg.num_layers)]
        self.inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta, device=self.device)
        cfg_json = json.dumps(cfg.to_dict(), sort_keys=True)
        self._cfg_hash = hashlib.sha256(cfg_json.encode()).hexdigest()[:16]

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
        return fn(self._norm(x, w.mlp_norm), w.mlp_in, w.mlp_down)

    def _qkv(self, x: torch.Tensor, w: PathWeights):
        H, K, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
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
        )

    def clear_und_cache(self) -> int:
        """Drop this model's entries (call after editing weights in place)."""
        return self.und_cache.evict_where(lambda k: k.weights_version == self.weights_version)

    def _und_layer(self, x: torch.Tensor, w: PathWeights, bounds: list[int], cos: torch.Tensor, sin: torch.Tensor):
        """One und layer over a flat text stream (prompts at `bounds`, causal within each).
        Returns (new hidden, keys after RoPE, keys-for-gen after RoPE, values)."""
        q, k, v = self._qkv(x, w)
        if w.q_norm is not None:
            q, k = self._norm(q, w.q_norm), self._norm(k, w.k_norm)
        k4g = self._norm(k, w.k_norm_for_gen) if w.k_norm_for_gen is not None else None
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        k4g = k if k4g is None else ops.apply_rope(k4g, cos, sin)
        o = torch.cat([self._attend(q[a:b], k[a:b], v[a:b], causal=True) for a, b in zip(bounds[:-1], bounds[1:])])
        x = x + F.linear(o, w.o_w, w.o_b)
        return x + self._mlp(x, w), k, k4g, v

    def und_pass(self, texts: list[torch.Tensor], axis: torch.Tensor, want_trace: bool = False):
        """The und pathway over several prompts at once (causal within each). Returns the final hidden
        states [sum L, D], the prompt bounds, per-layer stacked keys / keys-for-gen / values [layers, sum L,
        K, d] and, when tracing, the per-layer hidden states."""
        lens = [t.numel() for t in texts]
        bounds = torch.tensor([0] + lens).cumsum(0).tolist()
        x = F.embedding(torch.cat(texts).to(self.device), self.params["embed_tokens.weight"])
        pos = torch.cat([packing.text_position_ids(n, self.cfg.enable_fps_modulation) for n in lens], dim=1)
        cos, sin = self._rope_tables(pos, axis)
        ks, k4gs, vs, hidden = [], [], [], []
        for layer in self.layers:
            x, k, k4g, v = self._und_layer(x, layer["und"], bounds, cos, sin)
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
                resolved[key] = hit
                self.stats.und_cache_hits += 1
            else:
                todo[key] = [s]
                self.stats.und_cache_misses += int(use_cache)
        traces: list[list[torch.Tensor] | None] = [None] * len(inputs)
        status = ["hit"] * len(inputs)
        if todo:
            kvs, und_traces = self._und_stack([inputs[ss[0]].text_ids for ss in todo.values()], axis, want_trace)
            for j, (key, samples) in enumerate(todo.items()):
                resolved[key] = kvs[j]
                if use_cache:
                    self.und_cache.put(key, kvs[j])
                for s in samples:
                    traces[s] = und_traces[j] if want_trace else None
                    status[s] = "miss" if use_cache else "off"
        return [resolved[k] for k in keys], traces, status

    # ------------------------------------------------------------------ gen stream
    def _action_linear(self, x: torch.Tensor, name: str, dom: int, n_in: int, n_out: int) -> torch.Tensor:
        """DomainAwareLinear: row `dom` of the weight reshaped to [in, out]; y = x @ W + b, as one
        vector-matrix product per row (bmm over a stride-0 weight: upstream's per-token rounding)."""
        w = self.params[f"{name}.weight"][dom].view(n_in, n_out)
        return torch.bmm(x[:, None], w.expand(x.shape[0], n_in, n_out))[:, 0] + self.params[f"{name}.bias"][dom]

    def _embed_gen(self, inputs: Sequence[Cosmos3ForwardInputs], layouts: list[PackedLayout],
                   starts: list[int]) -> torch.Tensor:
        cfg, P, dev, dt = self.cfg, self.params, self.device, self.dtype
        D = cfg.hidden_size
        G = torch.empty(starts[-1], D, device=dev, dtype=dt)
        vis = torch.cat([ops.patchify(x.vision_latents.to(dev, dt), cfg.patch_size) for x in inputs])
        vis = F.linear(vis, P["vision_in.weight"], P["vision_in.bias"])
        snd_items = [x.sound_latents.to(dev, dt).T for x in inputs if x.sound_latents is not None]
        if snd_items:
            snd = F.linear(torch.cat(snd_items), P["sound_in.weight"], P["sound_in.bias"]) + P["sound_modality_embed"]
        v0 = s0 = 0
        for x, lay, g in zip(inputs, layouts, starts):
            nv, ns, na = lay.num_vision_tokens, lay.num_sound_tokens, lay.num_action_tokens
            G[g:g + nv] = vis[v0:v0 + nv]
            if ns:
                G[g + nv:g + nv + ns] = snd[s0:s0 + ns]
            if na:
                a = self._action_linear(x.action_latents.to(dev, dt), "action_in", x.action_domain_id,
                                        cfg.action_dim, D)
                G[g + nv + ns:g + nv + ns + na] = a + P["action_modality_embed"]
            v0, s0 = v0 + nv, s0 + ns
        # timestep embedding: fp32 sinusoid + fp32 MLP per sample, cast, added to the chosen rows only
        t = torch.tensor([float(x.timestep) for x in inputs], dtype=torch.float32, device=dev) * cfg.timestep_scale
        temb = ops.time_embedding(t, P["time_embed.linear_1.weight"], P["time_embed.linear_1.bias"],
                                  P["time_embed.linear_2.weight"], P["time_embed.linear_2.bias"], dt)
        rows, owner = [], []
        for s, (lay, g) in enumerate(zip(layouts, starts)):
            r = packing.timestep_embedding_rows(lay) - lay.text_len + g
            rows.append(r)
            owner.append(torch.full_like(r, s))
        rows_t = torch.cat(rows).to(dev)
        G.index_add_(0, rows_t, temb[torch.cat(owner).to(dev)])
        return G

    def _gen_layer(self, x: torch.Tensor, w: PathWeights, text_kv: list[tuple[torch.Tensor, torch.Tensor]],
                   bounds: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One gen layer over the flat gen stream (samples at `bounds`); sample s attends, non-causally,
        to its own text keys/values `text_kv[s]` and its own gen tokens."""
        q, k, v = self._qkv(x, w)
        q = ops.apply_rope(self._norm(q, w.q_norm), cos, sin)
        k = ops.apply_rope(self._norm(k, w.k_norm), cos, sin)
        outs = []
        for (tk, tv), a, b in zip(text_kv, bounds[:-1], bounds[1:]):
            outs.append(self._attend(q[a:b], torch.cat([tk, k[a:b]]), torch.cat([tv, v[a:b]]), causal=False))
        x = x + F.linear(torch.cat(outs), w.o_w, w.o_b)
        return x + self._mlp(x, w)

    # ------------------------------------------------------------------ decode
    def _decode(self, h: torch.Tensor, inputs: Sequence[Cosmos3ForwardInputs], layouts: list[PackedLayout],
                starts: list[int]) -> list[Cosmos3Prediction]:
        cfg, P = self.cfg, self.params
        C, p = cfg.latent_channels, cfg.patch_size

        def local(idx: torch.Tensor, lay: PackedLayout, g: int) -> torch.Tensor:
            return (idx - lay.text_len + g).to(self.device)

        vis_rows = torch.cat([local(l.vision_mse_loss_indexes, l, g) for l, g in zip(layouts, starts)])
        vis = F.linear(h[vis_rows], P["vision_out.weight"], P["vision_out.bias"])
        has_sound = [l.sound_mse_loss_indexes is not None for l in layouts]
        if any(has_sound):
            snd_rows = torch.cat([local(l.sound_mse_loss_indexes, l, g)
                                  for l, g, hs in zip(layouts, starts, has_sound) if hs])
            snd = F.linear(h[snd_rows], P["sound_out.weight"], P["sound_out.bias"])
        preds, v0, s0 = [], 0, 0
        for x, lay, g in zip(inputs, layouts, starts):
            T, gh, gw = lay.vision_grid
            H, W = lay.vision_latent_hw
            noisy = lay.vision_noisy_frames.to(self.device)
            n = noisy.numel() * gh * gw
            vision = h.new_zeros(1, C, T, H, W)
            if n:
                vision[0, :, noisy] = ops.unpatchify(vis[v0:v0 + n], (noisy.numel(), gh, gw), p, C, H, W)
            v0 += n
            sound = action = None
            if lay.sound_mse_loss_indexes is not None:
                ns = lay.sound_mse_loss_indexes.numel()
                sound = h.new_zeros(cfg.sound_dim, lay.num_sound_tokens)
                sound[:, lay.sound_noisy_frames.to(self.device)] = snd[s0:s0 + ns].T
                s0 += ns
            if lay.action_mse_loss_indexes is not None:
                action = h.new_zeros(lay.num_action_tokens, cfg.action_dim)
                if lay.action_mse_loss_indexes.numel():
                    rows = h[local(lay.action_mse_loss_indexes, lay, g)]
                    action[lay.action_noisy_frames.to(self.device)] = self._action_linear(
                        rows, "action_out", x.action_domain_id, cfg.hidden_size, cfg.action_dim)
            preds.append(Cosmos3Prediction(vision=vision, sound=sound, action=action))
        return preds

    # ------------------------------------------------------------------ entry points
    @torch.inference_mode()
    def forward_batch(self, inputs: Sequence[Cosmos3ForwardInputs], trace: Trace | None = None, *,
                      use_und_cache: bool | None = None) -> list[Cosmos3Prediction]:
        """Run several packed samples (one CFG branch each) in one call; returns one prediction each."""
        if not inputs:
            return []
        cfg = self.cfg
        use_cache = self.use_und_cache if use_und_cache is None else use_und_cache
        layouts = [packing.pack_layout(cfg, x) for x in inputs]
        axis = ops.mrope_axis_of_column(cfg.head_dim // 2, cfg.rope_axes_dim)
        self.stats.forward_calls += 1
        self.stats.samples += len(inputs)

        und, und_traces, und_status = self._und_kv(inputs, axis, use_cache, want_trace=trace is not None)
        starts = torch.tensor([0] + [l.gen_len for l in layouts]).cumsum(0).tolist()
        G = self._embed_gen(inputs, layouts, starts)
        gen_pos = torch.cat([l.position_ids[:, l.text_len:] for l in layouts], dim=1)
        cos, sin = self._rope_tables(gen_pos, axis)
        spans = list(zip(starts[:-1], starts[1:]))

        if trace is not None:
            emb = self.params["embed_tokens.weight"]
            for s, (x, (a, b)) in enumerate(zip(inputs, spans)):
                trace(s, "embed", torch.cat([F.embedding(x.text_ids.to(self.device), emb), G[a:b]]))
        for li, layer in enumerate(self.layers):
            G = self._gen_layer(G, layer["gen"], [(u.k[li], u.v[li]) for u in und], starts, cos, sin)
            if trace is not None:
                for s, (a, b) in enumerate(spans):
                    if und_traces[s] is not None:
                        trace(s, f"layers.{li}.und", und_traces[s][li])
                    trace(s, f"layers.{li}.gen", G[a:b])
        G = self._norm(G, self.params["gen_norm.weight"])
        preds = self._decode(G, inputs, layouts, starts)
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
        u, _, k4g, v = self._und_layer(u, layer["und"], [0, n], cos[:n], sin[:n])
        g = self._gen_layer(g, layer["gen"], [(k4g, v)], [0, g.shape[0]], cos[n:], sin[n:])
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
