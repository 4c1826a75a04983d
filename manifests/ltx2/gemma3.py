"""ltx2 text encoder contract: the Gemma 3 text model LTX2Pipeline runs (transformers `Gemma3TextConfig` fields that
change the hidden states, same names; `Gemma3ForConditionalGeneration`'s language model for the released
pipelines) and its canonical keys (the text model's state-dict names, `model.language_model.` stripped).

What both sides compute: all hidden states [B, L, hidden, layers + 1] (the scaled embeddings, then each decoder
layer's output, the last after the final norm), which LTX2Pipeline stacks on the last axis and flattens into the
connectors' input. Left padding (Gemma's), positions 0..L-1 counting the pads; sliding-window layers see keys with
q - window < k <= q, full layers every earlier key; padded query rows are not defined upstream (the connectors drop
them) and are 0 here on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

from manifests.errors import ManifestError

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Gemma3TextSpec:
    vocab_size: int = 262_208
    hidden_size: int = 3840
    intermediate_size: int = 15360
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: int = 256
    sliding_window: int = 1024
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 10_000.0
    rope_global_theta: float = 1_000_000.0
    rope_global_linear_factor: float = 8.0       # Gemma-3-12B: linear scaling on the full-attention layers

    def types(self) -> tuple[str, ...]:
        """Per-layer attention kind; transformers' default pattern: every 6th layer full, the rest sliding."""
        return self.layer_types or tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                         for i in range(self.num_hidden_layers))

    def validate(self) -> Gemma3TextSpec:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ManifestError("gemma3: num_attention_heads must be a multiple of num_key_value_heads")
        if len(self.types()) != self.num_hidden_layers or set(self.types()) - set(LAYER_TYPES):
            raise ManifestError(f"gemma3: layer_types must name {self.num_hidden_layers} of {LAYER_TYPES}")
        return self

    @classmethod
    def from_transformers_config(cls, d: dict) -> Gemma3TextSpec:
        """A `Gemma3TextConfig.to_dict()` (or a Gemma3Config's `text_config`); unsupported settings refused."""
        d = d.get("text_config", d)
        if d.get("use_bidirectional_attention") or d.get("attn_logit_softcapping") is not None:
            raise ManifestError("gemma3: bidirectional attention / attention logit softcapping are not ported")
        rope = d.get("rope_parameters") or {}
        local, full = rope.get("sliding_attention", {}), rope.get("full_attention", {})
        if local.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default",
                                                                                                     "linear"):
            raise ManifestError(f"gemma3: rope types {local.get('rope_type')} / {full.get('rope_type')} not ported")
        names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "query_pre_attn_scalar", "sliding_window")
        return cls(**{k: d[k] for k in names if k in d}, layer_types=tuple(d.get("layer_types") or ()),
                   rope_local_theta=local.get("rope_theta", 10_000.0),
                   rope_global_theta=full.get("rope_theta", 1_000_000.0),
                   rope_global_linear_factor=full.get("factor", 1.0) if full.get("rope_type") == "linear"
                   else 1.0).validate()


TINY = Gemma3TextSpec(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
                      sliding_window=3, layer_types=("sliding_attention", "full_attention"))


def gemma3_key_shapes(c: Gemma3TextSpec) -> dict[str, tuple[int, ...]]:
    d, h, kv, hd, f = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    shapes = {"embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                       p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, h * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            shapes[f"{p}{n}.weight"] = (d,)
    shapes["norm.weight"] = (d,)
    return shapes
