"""Wan 2.1 / 2.2 DiT and UMT5 text-encoder configs, and their canonical checkpoint key sets.

Canonical names are the reference implementation's parameter names, which are the upstream names unchanged:
diffusers 0.42.1 `WanTransformer3DModel` for the DiT, transformers `UMT5EncoderModel` for the text encoder (less
`encoder.embed_tokens.weight`, which upstream ties to `shared.weight`; the canonical layout stores it once).

DiT layout (D = num_heads * head_dim, Dt = text_dim, Df = freq_dim, F = ffn_dim):
    patch_embedding [D, in, pt, ph, pw] + bias            Conv3d patchify
    condition_embedder.time_embedder.linear_{1,2}          sinusoid(Df) -> D -> D (SiLU between)
    condition_embedder.time_proj [6D, D]                   SiLU(temb) -> 6 modulation vectors
    condition_embedder.text_embedder.linear_{1,2}          Dt -> D -> D (tanh-GELU between)
    condition_embedder.image_embedder.{norm1, ff, norm2}   image_dim -> D (I2V 14B; + pos_embed for FLF2V)
    blocks.{i}.scale_shift_table [1, 6, D]                 per-block modulation offsets
    blocks.{i}.attn1.{to_q,to_k,to_v,to_out.0,norm_q,norm_k}   self-attention, RMS norm across heads
    blocks.{i}.attn2.{...} (+ add_k_proj, add_v_proj, norm_added_k)   cross-attention (+ image K/V for I2V)
    blocks.{i}.norm2 (cross_attn_norm), blocks.{i}.ffn.net.{0.proj,2}   LayerNorm before cross-attn, GELU FFN
    scale_shift_table [1, 2, D], proj_out [out*pt*ph*pw, D]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from manifests.errors import ManifestError
from manifests.serialise import config_from_dict, config_to_dict

Shapes = dict[str, tuple[int, ...]]


def _need(cond: bool, what: str, msg: str) -> None:
    if not cond:
        raise ManifestError(f"{what}: {msg}")


def _positive_ints(cfg, what: str, names: tuple[str, ...]) -> None:
    for n in names:
        v = getattr(cfg, n)
        _need(isinstance(v, int) and not isinstance(v, bool) and v > 0, what, f"{n} must be a positive int, got {v!r}")


@dataclass(frozen=True)
class WanDiTConfig:
    num_heads: int
    head_dim: int
    in_channels: int
    out_channels: int
    text_dim: int
    freq_dim: int
    ffn_dim: int
    num_layers: int
    patch_size: tuple[int, int, int] = (1, 2, 2)
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"   # the only value released checkpoints use
    eps: float = 1e-6
    image_dim: int | None = None                     # I2V 14B: CLIP embedding width (1280)
    added_kv_proj_dim: int | None = None             # I2V 14B: image K/V projections (= hidden size)
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None             # FLF2V: learned position embedding of the image tokens

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def has_image_branch(self) -> bool:
        return self.added_kv_proj_dim is not None

    def validate(self) -> "WanDiTConfig":
        what = "wan DiT config"
        _positive_ints(self, what, ("num_heads", "head_dim", "in_channels", "out_channels", "text_dim", "freq_dim",
                                    "ffn_dim", "num_layers", "rope_max_seq_len"))
        _need(len(self.patch_size) == 3 and all(isinstance(p, int) and p > 0 for p in self.patch_size), what,
              f"patch_size must be 3 positive ints, got {self.patch_size!r}")
        _need(self.head_dim % 2 == 0 and (self.head_dim // 2) >= 3, what,
              f"head_dim must be even and >= 6 (3D rope splits it), got {self.head_dim}")
        _need(self.qk_norm in ("rms_norm_across_heads",), what,
              f"qk_norm {self.qk_norm!r} not supported (released checkpoints use 'rms_norm_across_heads')")
        _need(isinstance(self.eps, float) and 0 < self.eps < 1, what, f"eps must be in (0, 1), got {self.eps!r}")
        _need((self.image_dim is None) == (self.added_kv_proj_dim is None), what,
              "image_dim and added_kv_proj_dim come together (I2V) or not at all")
        _need(self.added_kv_proj_dim in (None, self.hidden_size), what,
              f"added_kv_proj_dim must equal the hidden size {self.hidden_size} (upstream), got {self.added_kv_proj_dim}")
        _need(self.pos_embed_seq_len is None or self.image_dim is not None, what,
              "pos_embed_seq_len needs the image branch (image_dim)")
        return self

    def rope_dims(self) -> tuple[int, int, int]:
        """Per-axis rotary dims (t, h, w) of one head: h and w get 2 * (head_dim // 6) each, t the rest (upstream)."""
        h = w = 2 * (self.head_dim // 6)
        return self.head_dim - h - w, h, w

    def to_dict(self) -> dict:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WanDiTConfig":
        return config_from_dict(cls, d, "wan DiT")

    @classmethod
    def from_diffusers_config(cls, c: dict) -> "WanDiTConfig":
        """A diffusers `WanTransformer3DModel` config.json (defaults as in diffusers 0.42.1) -> ours."""
        return cls(num_heads=c.get("num_attention_heads", 40), head_dim=c.get("attention_head_dim", 128),
                   in_channels=c.get("in_channels", 16), out_channels=c.get("out_channels", 16),
                   text_dim=c.get("text_dim", 4096), freq_dim=c.get("freq_dim", 256), ffn_dim=c.get("ffn_dim", 13824),
                   num_layers=c.get("num_layers", 40), patch_size=tuple(c.get("patch_size", (1, 2, 2))),
                   cross_attn_norm=c.get("cross_attn_norm", True), qk_norm=c.get("qk_norm", "rms_norm_across_heads"),
                   eps=float(c.get("eps", 1e-6)), image_dim=c.get("image_dim"),
                   added_kv_proj_dim=c.get("added_kv_proj_dim"), rope_max_seq_len=c.get("rope_max_seq_len", 1024),
                   pos_embed_seq_len=c.get("pos_embed_seq_len")).validate()

    def to_diffusers_config(self) -> dict:
        return {"_class_name": "WanTransformer3DModel", "patch_size": list(self.patch_size),
                "num_attention_heads": self.num_heads, "attention_head_dim": self.head_dim,
                "in_channels": self.in_channels, "out_channels": self.out_channels, "text_dim": self.text_dim,
                "freq_dim": self.freq_dim, "ffn_dim": self.ffn_dim, "num_layers": self.num_layers,
                "cross_attn_norm": self.cross_attn_norm, "qk_norm": self.qk_norm, "eps": self.eps,
                "image_dim": self.image_dim, "added_kv_proj_dim": self.added_kv_proj_dim,
                "rope_max_seq_len": self.rope_max_seq_len, "pos_embed_seq_len": self.pos_embed_seq_len}


def _linear(s: Shapes, name: str, cin: int, cout: int, bias: bool = True) -> None:
    s[f"{name}.weight"] = (cout, cin)
    if bias:
        s[f"{name}.bias"] = (cout,)


def dit_key_shapes(cfg: WanDiTConfig) -> Shapes:
    """Every canonical DiT key and its shape (= diffusers `WanTransformer3DModel.state_dict()`)."""
    D, s = cfg.hidden_size, {}
    pt, ph, pw = cfg.patch_size
    s["scale_shift_table"] = (1, 2, D)
    s["patch_embedding.weight"] = (D, cfg.in_channels, pt, ph, pw)
    s["patch_embedding.bias"] = (D,)
    ce = "condition_embedder"
    _linear(s, f"{ce}.time_embedder.linear_1", cfg.freq_dim, D)
    _linear(s, f"{ce}.time_embedder.linear_2", D, D)
    _linear(s, f"{ce}.time_proj", D, 6 * D)
    _linear(s, f"{ce}.text_embedder.linear_1", cfg.text_dim, D)
    _linear(s, f"{ce}.text_embedder.linear_2", D, D)
    if cfg.image_dim is not None:
        ie, E = f"{ce}.image_embedder", cfg.image_dim
        s[f"{ie}.norm1.weight"], s[f"{ie}.norm1.bias"] = (E,), (E,)
        _linear(s, f"{ie}.ff.net.0.proj", E, E)
        _linear(s, f"{ie}.ff.net.2", E, D)
        s[f"{ie}.norm2.weight"], s[f"{ie}.norm2.bias"] = (D,), (D,)
        if cfg.pos_embed_seq_len is not None:
            s[f"{ie}.pos_embed"] = (1, cfg.pos_embed_seq_len, E)
    for i in range(cfg.num_layers):
        b = f"blocks.{i}"
        s[f"{b}.scale_shift_table"] = (1, 6, D)
        for a in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                _linear(s, f"{b}.{a}.{proj}", D, D)
            s[f"{b}.{a}.norm_q.weight"] = (D,)
            s[f"{b}.{a}.norm_k.weight"] = (D,)
        if cfg.has_image_branch:
            _linear(s, f"{b}.attn2.add_k_proj", D, D)
            _linear(s, f"{b}.attn2.add_v_proj", D, D)
            s[f"{b}.attn2.norm_added_k.weight"] = (D,)
        if cfg.cross_attn_norm:
            s[f"{b}.norm2.weight"], s[f"{b}.norm2.bias"] = (D,), (D,)
        _linear(s, f"{b}.ffn.net.0.proj", D, cfg.ffn_dim)
        _linear(s, f"{b}.ffn.net.2", cfg.ffn_dim, D)
    _linear(s, "proj_out", D, cfg.out_channels * pt * ph * pw)
    return s


# (upstream) diffusers 0.42.1 WanTransformer3DModel._keep_in_fp32_modules: from_pretrained(torch_dtype=bf16 / fp16)
# keeps a floating tensor fp32 when one of these names is a dot-separated component of its key
# (model_loading_utils: `m in param_name.split(".")`), e.g. blocks.{i}.norm2.* and image_embedder.norm1/norm2.*
DIT_FP32_MODULES = ("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")


def dit_fp32_keys(cfg: WanDiTConfig) -> list[str]:
    """The DiT keys that stay float32 whatever the run or conversion dtype (the one statement of this rule: the
    converter and the optimized loader both read it)."""
    return [k for k in dit_key_shapes(cfg) if any(m in k.split(".") for m in DIT_FP32_MODULES)]


@dataclass(frozen=True)
class UMT5Config:
    """transformers `UMT5Config` fields that the encoder uses (gated-gelu FFN, per-layer relative bias)."""
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dense_act_fn: str = "gelu_new"                   # tanh-approximated GELU (upstream "gated-gelu")

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv

    def validate(self) -> "UMT5Config":
        what = "UMT5 config"
        _positive_ints(self, what, ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                                    "relative_attention_num_buckets", "relative_attention_max_distance"))
        _need(self.dense_act_fn == "gelu_new", what, f"dense_act_fn {self.dense_act_fn!r} not supported (gelu_new)")
        _need(isinstance(self.layer_norm_epsilon, float) and 0 < self.layer_norm_epsilon < 1, what,
              f"layer_norm_epsilon must be in (0, 1), got {self.layer_norm_epsilon!r}")
        return self

    def to_dict(self) -> dict:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "UMT5Config":
        return config_from_dict(cls, d, "UMT5")

    @classmethod
    def from_transformers_config(cls, c: dict) -> "UMT5Config":
        ff = c.get("feed_forward_proj", "gated-gelu")
        if ff != "gated-gelu":
            raise ManifestError(f"UMT5 config: feed_forward_proj {ff!r} not supported (Wan uses gated-gelu)")
        return cls(vocab_size=c["vocab_size"], d_model=c["d_model"], d_kv=c["d_kv"], d_ff=c["d_ff"],
                   num_layers=c["num_layers"], num_heads=c["num_heads"],
                   relative_attention_num_buckets=c.get("relative_attention_num_buckets", 32),
                   relative_attention_max_distance=c.get("relative_attention_max_distance", 128),
                   layer_norm_epsilon=float(c.get("layer_norm_epsilon", 1e-6))).validate()

    def to_transformers_config(self) -> dict:
        return {"model_type": "umt5", "architectures": ["UMT5EncoderModel"], "vocab_size": self.vocab_size,
                "d_model": self.d_model, "d_kv": self.d_kv, "d_ff": self.d_ff, "num_layers": self.num_layers,
                "num_heads": self.num_heads, "relative_attention_num_buckets": self.relative_attention_num_buckets,
                "relative_attention_max_distance": self.relative_attention_max_distance,
                "layer_norm_epsilon": self.layer_norm_epsilon, "feed_forward_proj": "gated-gelu",
                "dense_act_fn": "gelu_new", "is_gated_act": True, "tie_word_embeddings": False}


def umt5_key_shapes(cfg: UMT5Config) -> Shapes:
    """Every canonical UMT5 encoder key (= transformers `UMT5EncoderModel`, the tied embed_tokens stored once)."""
    d, inner, s = cfg.d_model, cfg.inner_dim, {}
    s["shared.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        b = f"encoder.block.{i}.layer"
        for p in "qkv":
            s[f"{b}.0.SelfAttention.{p}.weight"] = (inner, d)
        s[f"{b}.0.SelfAttention.o.weight"] = (d, inner)
        s[f"{b}.0.SelfAttention.relative_attention_bias.weight"] = (cfg.relative_attention_num_buckets, cfg.num_heads)
        s[f"{b}.0.layer_norm.weight"] = (d,)
        s[f"{b}.1.DenseReluDense.wi_0.weight"] = (cfg.d_ff, d)
        s[f"{b}.1.DenseReluDense.wi_1.weight"] = (cfg.d_ff, d)
        s[f"{b}.1.DenseReluDense.wo.weight"] = (d, cfg.d_ff)
        s[f"{b}.1.layer_norm.weight"] = (d,)
    s["encoder.final_layer_norm.weight"] = (d,)
    return s


def dit_params(cfg: WanDiTConfig) -> int:
    return sum(math.prod(v) for v in dit_key_shapes(cfg).values())
