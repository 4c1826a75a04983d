"""UMT5Fast: the UMT5 encoder (transformers `UMT5EncoderModel` numerics) with WanPipeline prompt semantics and a
content-hash cache of per-prompt outputs.

`encode(ids_list, max_sequence_length)` follows WanPipeline `_get_t5_prompt_embeds`: ids padded with 0 to the
padded length plus an attention mask, one batched forward, each prompt trimmed to its own length and zero-padded to
`max_sequence_length`. Each prompt's trimmed output depends only on its ids (rows never see each other), so it is
cached under a structured `CacheKey` (weights version, precision, device, config, ids hash): an RL group of K
samples of one prompt, or the same negative prompt every step, encodes once. Duplicates inside one call are
encoded once too.

Speed: fused q/k/v and wi_0/wi_1 GEMMs, SDPA with the relative bias folded into the additive mask, relative
position buckets computed once per length and cached. Precision follows upstream with a bf16 run dtype: `wo` is
kept fp32 (`_keep_in_fp32_modules=["wo"]`), so from the first FFN onwards the residual stream is fp32.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from manifests.wan.dit import UMT5Config

from optimized.models.wan.spec import TEXT_ENCODER, TEXT_EMBED_CONTRACT_VERSION, umt5_component
from optimized.runtime.cache import CacheKey, CacheStore, content_hash, state_dict_hash
from optimized.runtime.spec import apply_load_transforms

MODEL_ID = "wan.umt5"


@dataclass
class UMT5Layer:
    norm_attn: torch.Tensor
    qkv: torch.Tensor          # [3 * inner, d] (q | k | v rows)
    o: torch.Tensor
    rel_bias: torch.Tensor     # [num_buckets, num_heads]: UMT5 has a relative bias in every layer
    norm_ff: torch.Tensor
    wi: torch.Tensor           # [2 * d_ff, d] (wi_0 gate | wi_1 linear rows)
    wo: torch.Tensor           # fp32 (upstream)


@dataclass
class UMT5FastStats:
    cache_hits: int = 0        # prompts served from the cache
    cache_misses: int = 0      # distinct prompts looked up and not found
    prompts_encoded: int = 0   # prompts actually run through the encoder
    forward_calls: int = 0


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # (upstream) transformers NewGELUActivation, written out (not F.gelu(approximate="tanh"): different rounding)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def relative_position_buckets(length: int, num_buckets: int, max_distance: int, device=None) -> torch.Tensor:
    """Bidirectional T5 buckets [length, length] for relative position (key - query) (upstream
    UMT5Attention._relative_position_bucket with is_decoder=False)."""
    pos = torch.arange(length, dtype=torch.long, device=device)
    rel = pos[None, :] - pos[:, None]
    half = num_buckets // 2
    buckets = (rel > 0).to(torch.long) * half
    rel = torch.abs(rel)
    max_exact = half // 2
    is_small = rel < max_exact
    log_ratio = torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact) * (half - max_exact)
    large = torch.clamp_max(max_exact + log_ratio.to(torch.long), half - 1)
    return buckets + torch.where(is_small, rel, large)


class UMT5Fast:
    """Built from (config, canonical state dict, device, dtype). See the module docstring.

    pad_to: "max" runs every batch at `max_sequence_length` tokens as upstream does (the tokenizer pads to 512),
    so a prompt's output never depends on which prompts share its batch; "longest" runs at the longest prompt of the
    batch (faster; padded keys are masked so the result agrees to ~1e-7 but is not bitwise batch-independent)."""

    def __init__(self, cfg: UMT5Config, state: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, weights_version: str | None = None, *,
                 cache: CacheStore | None = None, cache_bytes: int = 1 << 30, use_cache: bool = True,
                 pad_to: str = "max", component_id: str = TEXT_ENCODER) -> None:
        if pad_to not in ("max", "longest"):
            raise ValueError(f"pad_to must be 'max' or 'longest', got {pad_to!r}")
        self.cfg = cfg.validate()
        self.device = torch.device(device)
        self.dtype = dtype
        self.component_id = component_id
        self.component = umt5_component(cfg, component_id)
        self.params = apply_load_transforms(self.component, state, dtype=dtype, device=self.device)
        self.weights_version = weights_version or state_dict_hash(state)
        self.cache = cache if cache is not None else CacheStore(cache_bytes, name="wan.text_embeds")
        self.use_cache = use_cache
        self.pad_to = pad_to
        self.stats = UMT5FastStats()
        self._buckets: dict[int, torch.Tensor] = {}
        self._cfg_hash = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
        P = self.params
        self.layers = []
        for i in range(cfg.num_layers):
            a, f = f"encoder.block.{i}.layer.0.", f"encoder.block.{i}.layer.1."
            self.layers.append(UMT5Layer(
                norm_attn=P[a + "layer_norm.weight"], qkv=P[a + "SelfAttention.qkv.weight"],
                o=P[a + "SelfAttention.o.weight"], rel_bias=P[a + "SelfAttention.relative_attention_bias.weight"],
                norm_ff=P[f + "layer_norm.weight"], wi=P[f + "DenseReluDense.wi.weight"],
                wo=P[f + "DenseReluDense.wo.weight"]))

    # ------------------------------------------------------------------ model
    def buckets(self, length: int) -> torch.Tensor:
        """Relative-position buckets for a length, computed once and cached (per-layer bias = table[buckets])."""
        b = self._buckets.get(length)
        if b is None:
            b = relative_position_buckets(length, self.cfg.relative_attention_num_buckets,
                                          self.cfg.relative_attention_max_distance, self.device)
            self._buckets[length] = b
        return b

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # (upstream) T5 RMS norm: variance in fp32, no mean subtraction; cast to a half weight's dtype before scaling
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.cfg.layer_norm_epsilon)
        if w.dtype in (torch.float16, torch.bfloat16):
            x = x.to(w.dtype)
        return w * x

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, L] int64, mask [B, L] (1 = token) -> last hidden state [B, L, d_model] (padded rows included)."""
        cfg = self.cfg
        B, L = ids.shape
        H, dk = cfg.num_heads, cfg.d_kv
        ids, keep = ids.to(self.device), mask.to(self.device).bool()[:, None, None, :]   # [B, 1, 1, L]
        x = F.embedding(ids, self.params["shared.weight"])
        buckets = self.buckets(L)
        for layer in self.layers:
            n = self._norm(x, layer.norm_attn)
            q, k, v = (t.view(B, L, H, dk).transpose(1, 2) for t in F.linear(n, layer.qkv).chunk(3, dim=-1))
            bias = layer.rel_bias[buckets].permute(2, 0, 1).unsqueeze(0)               # [1, H, L, L]
            attn_mask = torch.where(keep, bias, torch.finfo(k.dtype).min)              # (upstream) sdpa bias mask
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0)   # (upstream) no 1/sqrt(d)
            x = x + F.linear(a.transpose(1, 2).reshape(B, L, -1), layer.o)
            n = self._norm(x, layer.norm_ff)
            gate, lin = F.linear(n, layer.wi).chunk(2, dim=-1)
            h = _gelu_new(gate) * lin
            if h.dtype != layer.wo.dtype:
                h = h.to(layer.wo.dtype)                       # (upstream) fp32 wo: the residual stream turns fp32
            x = x + F.linear(h, layer.wo)
        self.stats.forward_calls += 1
        return self._norm(x, self.params["encoder.final_layer_norm.weight"])

    # ------------------------------------------------------------------ prompts + cache
    def cache_key(self, ids: torch.Tensor) -> CacheKey:
        ids = ids.reshape(-1).to(torch.int64)
        return CacheKey(
            model_id=MODEL_ID, component_id=self.component_id, weights_version=self.weights_version,
            precision=str(self.dtype).removeprefix("torch."),
            shape_signature=f"len={ids.numel()};d={self.cfg.d_model}",
            layout_signature=f"cfg={self._cfg_hash};device={self.device};pad_to={self.pad_to}",
            input_hashes={"text_ids": content_hash(ids.cpu())},
            cache_contract_version=TEXT_EMBED_CONTRACT_VERSION,
        )

    def _run(self, prompts: list[torch.Tensor], max_sequence_length: int) -> list[torch.Tensor]:
        """One batched forward over `prompts` (already truncated); each output trimmed to its length."""
        lens = [p.numel() for p in prompts]
        L = max_sequence_length if self.pad_to == "max" else max(max(lens), 1)
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        mask = torch.zeros(len(prompts), L, dtype=torch.long)
        for r, (p, n) in enumerate(zip(prompts, lens)):
            ids[r, :n] = p
            mask[r, :n] = 1
        out = self.forward(ids, mask)
        self.stats.prompts_encoded += len(prompts)
        return [out[r, :n].clone() for r, n in enumerate(lens)]

    @torch.no_grad()
    def encode(self, ids_list: list[torch.Tensor], max_sequence_length: int) -> torch.Tensor:
        """Token ids per prompt -> [B, max_sequence_length, d_model] in the run dtype: each prompt's output trimmed
        to its length and zero-padded (WanPipeline). Ids longer than max_sequence_length are truncated (the
        tokenizer's truncation=True)."""
        if max_sequence_length <= 0:
            raise ValueError(f"max_sequence_length must be > 0, got {max_sequence_length}")
        prompts = [torch.as_tensor(p).reshape(-1).to(torch.long)[:max_sequence_length].cpu() for p in ids_list]
        keys = [self.cache_key(p) for p in prompts]
        resolved: dict[CacheKey, torch.Tensor] = {}
        todo: dict[CacheKey, torch.Tensor] = {}
        for key, p in zip(keys, prompts):
            if key in resolved or key in todo:
                self.stats.cache_hits += int(self.use_cache)   # a duplicate inside the call is served, not encoded
                continue
            hit = self.cache.get(key) if self.use_cache else None
            if hit is not None:
                resolved[key] = hit
                self.stats.cache_hits += 1
            else:
                todo[key] = p
                self.stats.cache_misses += int(self.use_cache)
        if todo:
            for key, emb in zip(todo, self._run(list(todo.values()), max_sequence_length)):
                resolved[key] = emb
                if self.use_cache:
                    self.cache.put(key, emb)
        out = torch.zeros(len(prompts), max_sequence_length, self.cfg.d_model, dtype=self.dtype, device=self.device)
        for r, key in enumerate(keys):
            emb = resolved[key]
            out[r, :emb.shape[0]] = emb
        return out

    def clear_cache(self) -> int:
        """Drop this encoder's entries (call after editing weights in place)."""
        return self.cache.evict_where(lambda k: k.weights_version == self.weights_version)
